"""What each known mistake is called in a report, and the candidates for each symptom: one place,
so that a diagnosis and a list of candidates say the same thing the same way."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CLIP_EACH", "CLIP_OWN", "DIRECTION", "HIDDEN_SCALE", "LATER", "LAYERS", "MEANS", "MOVED", "NO_UPDATE",
    "ONE_COUNT_ALIKE", "RATIO", "ROWS", "SCALE", "SCHEDULER_FIRST", "STALE", "SUPPORT", "amount",
    "backward_times", "clamped", "clipped_scaled", "count_weights", "decay_by_hand", "differs", "fixed_n",
    "l2_penalty", "learning_rate", "many_steps", "mixing_layer", "never_divided", "no_gradient",
    "not_divided", "rank_scale", "ranks_apart", "ratio_rule", "reduced_twice", "rows_count", "scale_left",
    "scheduler", "twice", "weightings", "wrong_count"
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
CLIP_OWN = ("each micro-batch's gradient clipped on its own before it is added to the window's (a "
            "gradient cleared, clipped and summed into a buffer per micro-batch): clip once per window, "
            "the sum, after the last backward")
ROWS = ("an n_items (or weight) that counts sequences (rows) or padded positions where the loss "
        "averages tokens: weight each micro-batch by its tokens (n_items=count_tokens(labels))")
# Which micro-batches' gradients reached the step (the rules of _combination.SUPPORT_RULES), by how
# the step's backward passes and zero_grad() calls went.
SUPPORT = {
    ("last", "zero_grad"): "only the last micro-batch's gradient reached the step: zero_grad() runs "
                           "before every micro-batch's backward (call it once per window, after step())",
    ("last", "once"): "only the last micro-batch's gradient reached the step: backward() runs once, on "
                      "the last micro-batch's loss (a loss overwritten in the loop: call backward() on "
                      "each micro-batch's loss)",
    ("last", ""): "only the last micro-batch's gradient reached the step: each micro-batch's gradient "
                  "is cleared before the next (.grad zeroed or set to None inside the loop)",
    ("smaller dropped", ""): "the smaller micro-batches were dropped: only the larger ones reached the "
                             "step (keep every micro-batch, a short last one too, weighted by its items)",
    ("first", ""): "only the first micro-batch's gradient reached the step (the loop stops after it, "
                   "or the later ones are cleared)",
    ("first", "repeated"): "the first micro-batch fed k times, the others never: each backward ran on the "
                           "same micro-batch (next(iter(loader)) inside the loop starts a new iterator each "
                           "time: make the iterator once, outside the loop)",
    ("all but last", ""): "the last micro-batch's gradient never reached the step (a loop over the "
                          "micro-batches that stops one short)",
    ("all but first", ""): "the first micro-batch's gradient never reached the step (a loop that skips "
                           "it, micro_batches[1:], or clears its gradient after it)",
}
SCHEDULER_FIRST = ("scheduler.step() runs before optimizer.step() in the window: every step takes the "
                   "next window's learning rate (step the scheduler after optimizer.step())")
ONE_COUNT_ALIKE = ("or the window divided by one micro-batch's count, not the window's: on every split "
                   "tried the micro-batches hold equal counts, so the two give the same gradient (an uneven "
                   "split, splits=[[5, 4, 3]], tells them apart)")
MOVED = ("the parameters changed outside optimizer.step(), before the step (an update or edit of your "
         "own between the backward passes: leave the parameters to the optimizer)")
# A count taken in the wrong place (the rules of _ratios.ratio_rules), by rule: {m}, {n} filled in.
RATIO = {
    "first counted": "the first micro-batch's gradient added {m} times, every other one's once (a "
                     "backward() run {m} times on its loss, a warm-up or check before the loop)",
    "last counted": "the last micro-batch's gradient added {m} times, every other one's once (a "
                    "backward() run again on the last loss after the loop)",
    "own count": "each micro-batch's gradient multiplied by its own count: a summed loss given where a "
                 "mean is expected (with a summed loss pass reduction='sum' to the Accumulator, or "
                 "divide by the window's count)",
    "over own count": "each micro-batch's gradient divided by its own count: a mean loss given where a "
                      "sum is expected (reduction='sum' with a mean loss: drop it, or pass the summed loss)",
    "first's count": "the window divided by the first micro-batch's count, not the window's (sum the "
                     "counts of all the window's micro-batches)",
    "last's count": "the window divided by the last micro-batch's count, not the window's (sum the "
                    "counts of all the window's micro-batches)",
    "off by": "a count off by {m} on every micro-batch: the window divided by the batch's {n} plus "
              "{m} per micro-batch (count exactly what the loss sums: n_items=count_tokens(labels))",
}
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


def weightings(bases: Iterable[str]) -> str:
    """``as a mean of micro-batch means``: the weightings of _evidence, said briefly."""
    said = {"full": "as the full batch", "means": "as a mean of micro-batch means", "items": "by their rows"}
    return " or ".join(said.get(b) or f"by {b.split(':', 1)[1]}'s token counts" for b in bases)


def ratio_rule(found: list[tuple[str, int, int]]) -> str:
    """The rules of _ratios that hold (``(name, m, N)``): one named, or the few these splits leave."""
    said = [RATIO[name].format(m=m, n=n) for name, m, n in found]
    if len(said) == 1:
        return said[0]
    if {f[0] for f in found} == {"first's count", "last's count"}:
        return ("the window divided by one micro-batch's count, not the window's: the first's or the "
                "last's, equal on every split tried (sum the counts of all the window's micro-batches)")
    return "one of these, which the splits tried cannot tell apart: " + "; or ".join(said)


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


def decay_by_hand(rate: float, every: bool) -> str:
    """Parameters shrunk by ``rate`` outside the step: after every backward, or once a window."""
    if every:
        return (f"a weight decay applied by hand after every micro-batch's backward (the parameters times "
                f"1 - {rate:.4g} each time, k times a window): apply it once per window, or use the "
                "optimizer's weight_decay (AdamW)")
    return (f"a weight decay applied by hand once per window, outside the optimizer (the parameters times "
            f"1 - {rate:.4g}), which the reference does not apply: use the optimizer's weight_decay")


def clamped(each: bool, value: str) -> str:
    """A gradient clamped entry by entry at ``value``: after every micro-batch, or once."""
    if each:
        return (f"clamped entry by entry at {value} after every micro-batch (clip_grad_value_ inside the "
                "loop): clamp once per window, after the last backward")
    return (f"clamped entry by entry at {value} (clip_grad_value_), which the reference does not apply "
            "(clamp in loss_fn's reference too, or clip by norm: clip_norm=)")


def scale_left(m: int) -> str:
    """A gradient still multiplied (``m > 0``) or divided (``m < 0``) by a loss scale ``2**|m|``."""
    if m > 0:
        return (f"a loss scale not undone: the gradient is 2**{m} = {2 ** m}x the full batch's on every "
                "split, a GradScaler's scale still on it (step through scaler.step(optimizer), or call "
                "scaler.unscale_(optimizer) before anything reads the gradient)")
    return (f"a loss scale undone twice: the gradient is 1/2**{-m} of the full batch's on every split "
            "(scaler.unscale_ and a division of your own: keep one)")


def clipped_scaled(m: int, clip_norm: float) -> str:
    """Clipped while the gradient still held a loss scale ``2**m``."""
    return (f"clipped before the loss scale was undone: the gradient's norm is clip_norm/2**{m} "
            f"({clip_norm:g}/{2 ** m}) on every split, as when clip_grad_norm_ sees the gradient still "
            f"multiplied by a GradScaler's scale {2 ** m} (call scaler.unscale_(optimizer) before "
            f"clipping); the only other loop that gives it clips at {clip_norm / 2 ** m:.4g} itself")


def backward_times(m: int) -> str:
    """Each micro-batch's loss went through backward() ``m`` times."""
    return (f"backward() runs {m} times on each micro-batch's loss: its gradient is added {m} times "
            "(call it once per micro-batch)")


def never_divided(what: str) -> str:
    """A summed loss never divided by its count (``what``: ``46 tokens of batch[1]``)."""
    return (f"a loss summed over the {what} and never divided by them (divide by the window's count: "
            "n_items=... with reduction='sum', or a mean loss)")


def rows_count(factor: float, where: str, tokens: int, rows: int) -> str:
    """A summed loss divided by the number of sequences where the reference averages tokens."""
    return (f"a loss summed over the {tokens} tokens of {where} and divided by its {rows} sequences "
            f"(rows), not its tokens ({factor:.4g}x whatever the split): n_items counts sequences "
            "(n_items=count_tokens(labels))")


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


def no_gradient(how: str) -> str:
    """The optimizer stepped on a zero gradient: ``how`` is ``"zero_grad"`` (a zero_grad() between
    the last backward and the step), ``"none"`` (no backward reached the parameters) or ``""``."""
    why = {"zero_grad": "zero_grad() runs before step() (call it after step(), or before the "
                        "window's first backward)",
           "none": "no backward() reached the parameters in the window (call backward() on each "
                   "micro-batch's loss)",
           "": "the gradients were cleared between the last backward() and step() (.grad zeroed or "
               "set to None before the step)"}[how]
    return f"the step applied no gradient: {why}"


def learning_rate(rule: str, k: int) -> str:
    """The learning rate at the step scaled by the window's micro-batches (``rule``: times or over)."""
    how = "multiplied" if rule == "times" else "divided"
    return (f"the learning rate {how} by the {k} micro-batches: accumulation already gives the full "
            "batch's gradient, so keep the full batch's learning rate (the window is that batch)")


def l2_penalty(rule: str) -> str:
    """An L2 term held another number of times than the reference's (the rules of
    _combination.L2_RULES)."""
    return {"every": "an L2 penalty added on every micro-batch's loss: the window holds it k times, "
                     "the full batch once (add it once per window, or use the optimizer's weight_decay)",
            "every, none in loss_fn": "an L2 penalty added on every micro-batch's loss, which loss_fn "
                                      "does not hold (add it once per window, and in loss_fn too)",
            "none in loss_fn": "an L2 penalty your step adds once per window and loss_fn does not "
                               "hold (put it in loss_fn, so that the reference is your objective)"}[rule]


def mixing_layer(kind: str, name: str) -> str:
    """A layer that makes the micro-batches' gradients differ from the full batch's, and the fix."""
    if "BatchNorm" in kind:
        return (f"{kind} ('{name}') normalizes each micro-batch with its own mean and variance in "
                "training: no loop over micro-batches gives the full batch's gradient (window "
                "BatchNorm, GroupNorm or frozen statistics: docs/BATCHNORM.md)")
    if "Dropout" in kind:
        return (f"{kind} ('{name}') draws other masks for the micro-batches than for the full batch: "
                "set p=0 or eval mode to test the loop")
    return LAYERS


def rank_scale(world: int, summed: bool) -> str:
    """Exact on one process, ``world`` times (or ``1/world`` of) the full batch's on the ranks."""
    if summed:
        return (f"exact on one process, {world}x on {world} ranks: the gradients summed over the ranks, "
                "not averaged (DistributedDataParallel already averages them: remove an "
                "all_reduce(SUM) of your own, or a loss multiplied by the world size)")
    return (f"exact on one process, 1/{world} of it on {world} ranks: the gradients divided by the "
            "world size on top of DistributedDataParallel's average (remove the division: DDP "
            "already averages)")


def reduced_twice(world: int) -> str:
    """A manual all_reduce(SUM) of the gradients under DDP."""
    return (f"an all_reduce(SUM) of the gradients on top of DistributedDataParallel's average: "
            f"{world}x on every rank (remove the all_reduce: DDP already averages the gradients)")
