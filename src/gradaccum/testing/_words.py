"""What each known mistake is called in a report, and the candidates for each symptom: one place,
so that a diagnosis and a list of candidates say the same thing the same way."""

from __future__ import annotations

__all__ = [
    "CLIP_EACH", "DIRECTION", "HIDDEN_SCALE", "LATER", "LAYERS", "MEANS", "NO_UPDATE", "SCALE", "STALE",
    "amount", "count_weights", "differs", "fixed_n", "many_steps", "not_divided", "ranks_apart",
    "scheduler", "twice", "wrong_count",
]

NO_UPDATE = "no update at all: the optimizer never stepped (a window left pending: flush it)"
MEANS = ("a mean of micro-batch means: a per-micro-batch mean instead of per-token (or per-item; "
         "pass n_items)")
STALE = "the previous window's gradient was still in .grad: zero_grad is missing"
LAYERS = ("a layer that mixes samples or draws random numbers (gradaccum.check_equivalence "
          "names it)")
HIDDEN_SCALE = ("a gradient at another scale, which clipping hides (its direction is the full "
                "batch's on every split)")
CLIP_EACH = "clipped on every micro-batch: clip once per window, after the last backward"
COUNT_SHIFT = ("an n_items that counts {where}'s tokens before the shift, where the loss averages "
               "those after it (count_tokens(labels, shift=True))")
COUNT_NO_SHIFT = ("an n_items that counts {where}'s tokens after a shift the loss does not make "
                  "(count_tokens(labels) without shift=True)")

# The candidates for each symptom, when the evidence singles none out.
SCALE = ("a loss divided by the wrong count (the steps twice, a fixed N on a window that holds "
         "another number of micro-batches, a token count taken before the shift or on one rank only)",
         "a gradient scaled by hand, or a GradScaler's scale not undone")
DIRECTION = ("a per-micro-batch mean instead of per-token (or per-item; pass n_items)",
             "an n_items that counts other tokens than the loss averages (count_tokens(labels, "
             "shift=True) for a causal language model)",
             "clipping on every micro-batch (clip once per window, after the last backward)",
             LAYERS)
LATER = ("a gradient left in .grad from the previous window (zero_grad missing)",
         "state your step keeps from one window to the next (a count or an accumulator not reset)",
         "a learning rate or clipping that differs after the first window")


def amount(ratio: float, cosine: float) -> str:
    """``0.5x the full batch``, or ``1.05x the full batch, in another direction (cosine 0.937393)``."""
    return f"{ratio:.3g}x the full batch" + _turned(cosine)


def differs(ratio: float, cosine: float) -> str:
    """``differs by 0.75x from the full batch`` (and its direction when it turned)."""
    return f"differs by {ratio:.3g}x from the full batch" + _turned(cosine)


def _turned(cosine: float) -> str:
    return f", in another direction (cosine {cosine:.6f})" if cosine < 1 - 1e-5 else ""


def twice(k: int) -> str:
    """The loss divided by N and the window averaged again."""
    return f"divided by the steps twice (the loss by N={k} and again the window)"


def not_divided(k: int) -> str:
    """The sum of the micro-batch means."""
    return f"not divided by the steps: the sum of {k} micro-batch means, not their mean"


def fixed_n(k: int, n: int) -> str:
    """A window of ``k`` micro-batches divided by a fixed ``n``."""
    if k < n:
        return (f"{k} micro-batches divided by {n}: a short last window divided by N={n}, not by the "
                f"{k} it holds")
    return f"{k} micro-batches divided by {n}: a fixed N={n}, not the {k} the window holds"


def wrong_count(factor: float, where: str | None, shifted: int = 0, counted: int = 0) -> str:
    """A constant factor; an unshifted token count when it is the batch's ratio of counts."""
    if where is None:
        return f"a loss divided by a wrong count ({factor:.4g}x whatever the split)"
    if shifted < counted:
        return (f"an unshifted token count: the loss sums the {shifted} tokens of {where} after the "
                f"shift and is divided by the {counted} counted before it (count_tokens(labels, shift=True))")
    return (f"a token count taken after a shift the loss does not make: the loss sums the {shifted} "
            f"tokens of {where} and is divided by {counted}")


def count_weights(base: str) -> str:
    """A mean weighted by the wrong token count (``base``: ``count:<where>`` or ``shifted:<where>``)."""
    kind, where = base.split(":", 1)
    return (COUNT_SHIFT if kind == "count" else COUNT_NO_SHIFT).format(where=where)


def scheduler(steps: int, window: int, k: int) -> str:
    """The scheduler stepped ``steps`` times in one window."""
    how = "once per micro-batch" if steps == k else f"{steps} times"
    return f"the scheduler stepped {how} in window {window}, not once per optimizer step"


def many_steps(steps: int, window: int) -> str:
    """The optimizer stepped ``steps`` times in one window."""
    return f"the optimizer stepped {steps} times in window {window}: the step does not accumulate"


def ranks_apart(apart: float) -> str:
    """The ranks' parameters parted."""
    return (f"the ranks ended {apart:.1e} apart: each rank stepped on its own gradient or count "
            "(pass model=ddp_model to the Accumulator)")
