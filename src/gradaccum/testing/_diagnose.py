"""Why a split differs from the full batch, said only as far as the evidence goes.

The first window that differs is read in this order: how often the optimizer stepped in it; whether
it stepped on a zero gradient, or (on ranks) on gradients the step all-reduced itself
(:mod:`gradaccum.testing._causes`); whether the ranks parted; whether the optimizer saw the full
batch's gradient (then the learning rate differs: a scheduler stepped per micro-batch, a rate k
times the full batch's); after a first window that agreed, whether the previous window's gradient
was still in ``.grad``; in the first window, whether the full batch's gradient is a weighting of
its micro-batches' own at all (else a layer mixes the samples), which hypothesis of
:mod:`gradaccum.testing._evidence` gives the gradient on every split tried, and else what the
micro-batches' weights show (:mod:`gradaccum.testing._combination`). A cause is named when one
explanation stands; otherwise the words give the difference and list the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradaccum.testing import _causes as causes
from gradaccum.testing import _words as words
from gradaccum.testing._clamp import clamped
from gradaccum.testing._combination import solve
from gradaccum.testing._compare import Compared, flat
from gradaccum.testing._evidence import (
    Hypothesis,
    Probe,
    clip,
    close,
    distinct_bases,
    explain,
    scale_under_clip,
    unit,
)
from gradaccum.testing._moved import shrink, why_moved
from gradaccum.testing._naming import evidence, is_token_ratio, loss_scale, name
from gradaccum.testing._probes import batch_counts, make_probes
from gradaccum.testing._runs import Job, Trace, build

__all__ = ["Context", "Finding", "diagnose"]


@dataclass(frozen=True)
class Finding:
    """``words`` for the split's line; ``why`` the evidence, or the candidates."""

    words: str
    why: str


@dataclass
class Context:
    """What every split's diagnosis shares (the probes run once, when first needed)."""

    job: Job
    ref: Trace
    loss_fn: Any
    clip_norm: float | None
    tol: float
    known: dict[tuple[int, ...], Trace]
    _probes: list[Probe] | None = field(default=None, repr=False)

    def probes(self) -> list[Probe]:
        """The first-window probes (:func:`make_probes`), run on the first call."""
        if self._probes is None:
            self._probes = make_probes(self.job, self.ref, self.known, self.loss_fn, self.clip_norm, self.tol)
        return self._probes


def diagnose(c: Compared, ctx: Context) -> Finding:
    """The words for split ``c`` (which differs in window ``c.window``)."""
    assert c.window is not None
    w, trace = c.window, c.traces[0]
    for v in range(w + 1):
        if not trace.steps[v]:
            return Finding(words.NO_UPDATE, "")
        if len(trace.steps[v]) > 1:
            return Finding(words.many_steps(len(trace.steps[v]), v + 1), "")
    for v in range(w + 1):
        if trace.steps[v][0].moved and not ctx.ref.steps[v][0].moved:
            fine = ctx.tol * 1e-3  # 1e-9 in float64, 1e-6 in float32: rounding, no more
            factor = shrink(trace.starts[v], trace.steps[v][0].moved, fine)
            moved, why = why_moved(v + 1, factor, ctx.probes(), 10 * fine)
            return Finding(f"{words.amount(c.ratio, c.cosine)}: {moved}", why)
    names = list(ctx.job.names)
    seen = flat(trace.steps[w][0].grads, names)
    single = len(ctx.ref.steps[w]) == 1  # the reference is the step itself
    unclipped = flat((ctx.ref.pre_clip or [s[0].grads for s in ctx.ref.steps])[w], names) if single else None
    if unclipped is not None:
        said = causes.no_gradient(trace, w, seen, unclipped) or (causes.reduced_twice(
            trace, w, ctx.job.world, seen, unclipped, ctx.tol) if ctx.job.world > 1 else None)
        if said is not None:
            return Finding(f"{words.amount(c.ratio, c.cosine)}: {said[0]}", said[1])
    if c.apart is not None:
        return Finding(words.ranks_apart(c.apart), "")
    head = words.amount(c.ratio, c.cosine)
    if unclipped is None:  # only a reference that is the step itself can do this
        return _candidates(words.differs(c.ratio, c.cosine),
                           [f"the reference, your step on the whole batch as one micro-batch, stepped "
                            f"{len(ctx.ref.steps[w])} times in window {w + 1}: pass loss_fn"])
    full = flat(ctx.ref.steps[w][0].grads, names)
    if close(seen, full, ctx.tol):
        return _learning_rate(c, ctx, head)
    if w > 0:
        stale = flat(trace.steps[w - 1][0].grads, names)
        if close(seen, clip(stale + unclipped, ctx.clip_norm), ctx.tol):
            return Finding(f"{head}: {words.STALE}", f"why: window {w + 1}'s gradient is window {w}'s "
                           f"plus its own{_clipped(ctx)}")
        agreed = f"{w} window{'s' if w > 1 else ''} that agreed"
        return _candidates(f"{words.differs(c.ratio, c.cosine)} in window {w + 1}, after {agreed}",
                           words.LATER)
    return _first_window(c, ctx, head, seen, full)


def _clipped(ctx: Context) -> str:
    return "" if ctx.clip_norm is None else f", clipped at {ctx.clip_norm:g}"


def _candidates(head: str, candidates: tuple[str, ...] | list[str]) -> Finding:
    return Finding(head, "not singled out by the evidence; the candidates: " + "; ".join(candidates))


def _learning_rate(c: Compared, ctx: Context, head: str) -> Finding:
    """The optimizer saw the full batch's gradient: the learning rate (or its state) differs."""
    w, trace = c.window, c.traces[0]
    assert w is not None
    odd = next((v for v in range(w + 1) if trace.scheduler_steps[v] != 1), None)
    mine, theirs = trace.steps[w][0].lrs, ctx.ref.steps[w][0].lrs
    lrs = (f"the learning rate at window {w + 1}'s step was {mine[0]:.4g} where the full batch's is "
           f"{theirs[0]:.4g}")
    if odd is not None and ctx.job.takes_scheduler and mine != theirs:
        return Finding(f"{head}: {words.scheduler(trace.scheduler_steps[odd], odd + 1, len(c.sizes))}",
                       f"why: the gradient is the full batch's; your step called scheduler.step() "
                       f"{trace.scheduler_steps[odd]} times in window {odd + 1}, and {lrs}")
    early = next((v for v in range(w + 1) if _scheduler_first(trace.events[v])), None)
    if early is not None and ctx.job.takes_scheduler and mine != theirs:
        return Finding(f"{head}: {words.SCHEDULER_FIRST}",
                       f"why: the gradient is the full batch's; in window {early + 1} your step called "
                       f"scheduler.step() before optimizer.step(), and {lrs}")
    rate = causes.learning_rate(ctx.probes(), ctx.ref.steps[0][0].lrs[0], len(c.sizes))
    if rate is not None and mine[0] == theirs[0] * len(c.sizes) ** rate[1]:
        return Finding(f"{head}: {rate[0][0]}", rate[0][1])
    bases = distinct_bases(ctx.probes(), ctx.tol) if mine == theirs and ctx.probes() else []
    hidden = next((h for h in (_scale_under_clip(ctx, len(c.sizes), b) for b in bases) if h is not None),
                  None)
    if hidden is not None:
        return Finding(f"{head}: {hidden[0]}", hidden[1])
    if mine != theirs:
        return _candidates(f"{words.differs(c.ratio, c.cosine)}: the gradient is the full batch's, {lrs}",
                           ["a scheduler stepped more or less often than once per optimizer step",
                            "a learning rate your step sets"])
    return _candidates(f"{words.differs(c.ratio, c.cosine)}: the gradient and the learning rate are "
                       "the full batch's",
                       ["the optimizer's state (an extra step earlier, or a second optimizer)",
                        "parameters changed outside optimizer.step()"])


def _first_window(c: Compared, ctx: Context, head: str, seen: Any, full: Any) -> Finding:
    k = len(c.sizes)
    probes = ctx.probes()
    mixed = causes.mixing(probes, lambda: build(ctx.job), ctx.tol) if ctx.loss_fn is not None else None
    if mixed is not None:  # and which micro-batches the loop left out, or an L2 term, if the weights say
        also = causes.from_weights(probes, c.traces[0], causes.start_vectors(ctx.job), ctx.tol, ctx.clip_norm,
                                   k=k)
        if also is None:
            return Finding(f"{head}: {mixed[0]}", mixed[1])
        return Finding(f"{head}: {mixed[0]}; and {also[0]}",
                       f"{mixed[1]}; and {also[1].removeprefix('why: ')}")
    standing = explain(probes, ctx.clip_norm, ctx.tol) if probes else []
    if ctx.job.world > 1 and standing and standing[0] == Hypothesis("full", "exact"):
        for times, summed in ((ctx.job.world, True), (1 / ctx.job.world, False)):
            if close(seen, times * full, ctx.tol):
                return Finding(f"{head}: {words.rank_scale(ctx.job.world, summed)}",
                               "why: the same step on one process gives the full batch's gradient for "
                               f"every split tried, and on the ranks {times:.4g}x it")
        return Finding(f"{head}: exact on one process, not on {ctx.job.world} ranks: a count or a "
                       "gradient taken per rank (pass model=ddp_model to the Accumulator, or sum the "
                       "counts over the ranks)",
                       "why: the same step on one process gives the full batch's gradient for every "
                       "split tried")
    if len(standing) == 1 and ctx.loss_fn is None and standing[0].family == "not divided":
        # Against the step itself on one micro-batch, a fixed N looks the same as no division.
        return _candidates(words.differs(c.ratio, c.cosine), [
            words.not_divided(k), "a fixed N whatever the window holds (without loss_fn the reference "
            "is your step on the whole batch as one micro-batch, which divides by N too)"])
    # One window size alone cannot tell a rule of k from a constant: name nothing from it.
    h = standing[0] if len(standing) == 1 and len({len(p.sizes) for p in probes}) > 1 else None
    # A constant factor below 1 is also what clipping the helper was not told of gives.
    hidden_clip = ctx.clip_norm is None and float(seen.norm()) < float(full.norm()) and (
        h is None or (h.family == "constant" and not is_token_ratio(h.param, ctx.job, ctx.tol)))
    scaled = _clipped_scaled(h, seen, ctx.clip_norm, ctx.tol)
    if scaled is not None:
        ks = evidence(Hypothesis("full", "exact"), probes, None).split(", for ", 1)[1]
        ks = ks.split(", and no other")[0]
        return Finding(f"{head}: {scaled}", f"why: the window gradient is the full batch's direction at the "
                       f"norm {float(seen.norm()):.6g}, for {ks}")
    if h is not None and not hidden_clip:
        why = "why: " + evidence(h, probes, ctx.clip_norm)
        repeated = _repeated_backward(h, c.traces[0], k)
        if repeated is not None:
            return Finding(f"{head}: {words.backward_times(repeated)}",
                           f"{why}; {repeated * k} backward passes in a window of {k} micro-batches")
        if h == Hypothesis("full", "not divided") and _equal_counts(probes, ctx.tol):
            return Finding(f"{head}: {name(h, k, ctx.job, ctx.tol)}; {words.ONE_COUNT_ALIKE}", why)
        return Finding(f"{head}: {name(h, k, ctx.job, ctx.tol)}", why)
    if len(standing) > 1 and {s.family for s in standing} == {"clip own"}:  # every share clipped: no weights
        return Finding(f"{head}: {words.CLIP_OWN}", "why: " + evidence(standing[0], probes, ctx.clip_norm) +
                       f"; the shares weighted {words.weightings(s.base for s in standing[1:])} give them "
                       "too (each clipped on its own, their weights do not show)")
    weighting = {s.base for s in standing}
    hidden = _scale_under_clip(ctx, k, standing[0].base) if len(weighting) == 1 else None
    if hidden is not None:  # the weighting is known, its scale read from clipping's 1e-6
        return Finding(f"{head}: {hidden[0]}", hidden[1])
    if len(weighting) == 1 and "full" not in weighting:  # the weighting is known, its scale clipped
        h = standing[0]
        return Finding(f"{head}: {name(Hypothesis(h.base, 'exact'), k, ctx.job, ctx.tol)} (its scale "
                       "hidden by clipping)", "why: " + evidence(h, probes, ctx.clip_norm, scale_hidden=True))
    read = causes.from_weights(probes, c.traces[0], causes.start_vectors(ctx.job), ctx.tol, ctx.clip_norm,
                               batch_counts(ctx.job.batch), k) if ctx.loss_fn else None
    read = read or (clamped(probes, ctx.tol) if ctx.loss_fn else None)
    if read is not None:
        return Finding(f"{head}: {read[0]}", read[1])
    turned = not close(seen / max(float(seen.norm()), 1e-300), full / max(float(full.norm()), 1e-300),
                       ctx.tol)
    listed = [name(h, k, ctx.job, ctx.tol) for h in standing] or list(
        words.DIRECTION if turned else words.SCALE)
    if hidden_clip and not turned:
        listed.append(f"clipping that the reference does not apply (pass clip_norm=; your step's "
                      f"gradient norm is {float(seen.norm()):.4g}, the full batch's "
                      f"{float(full.norm()):.4g})")
    if ctx.loss_fn is None:
        listed.append("(pass loss_fn: the evidence is sharper against a reference of its own)")
    return _candidates(words.differs(c.ratio, c.cosine), listed)


def _scale_under_clip(ctx: Context, k: int, base: str = "full") -> tuple[str, str] | None:
    """A weighting's direction (the full batch's by default), clipped, at a scale read from
    clip_grad_norm_'s 1e-6: a rule of k (or a constant) that holds on every probe."""
    if ctx.clip_norm is None or ctx.loss_fn is None or ctx.tol > 1e-5:
        return None
    probes = [p for p in ctx.probes() if base in p.bases]
    found = [(len(p.sizes), scale_under_clip(p.seen, p.bases[base], ctx.clip_norm)) for p in probes
             if close(unit(p.seen), unit(p.bases[base]), ctx.tol)]
    scales = sorted({(n, s) for n, s in found if s is not None})
    if len({n for n, _ in scales}) < 2 or len(scales) < len(found) or len(found) < len(probes):
        return None
    for h in (Hypothesis(base, "exact"), Hypothesis(base, "not divided"), Hypothesis(base, "twice"),
              Hypothesis(base, "constant", scales[0][1])):
        if all(abs(s / h.factor(n) - 1) <= 1e-4 for n, s in scales) and h != Hypothesis("full", "exact"):
            shown = ", ".join(dict.fromkeys(f"{s:.4g} on {n}" for n, s in scales))
            ks = ", ".join(dict.fromkeys(str(n) for n, _ in scales))
            by = (f"that weighting at its own scale on k = {ks} micro-batches" if h.family == "exact" else
                  f"it scaled by {shown} micro-batches")
            hides = "" if h.family == "exact" else (
                ": clipping hides the scale while it binds (clip_grad_norm_'s 1e-6 shows it), not on a "
                "window whose gradient is below the clip norm")
            return (f"{name(h, k, ctx.job, ctx.tol)}{hides}",
                    f"why: the window gradient has the direction of the micro-batches weighted "
                    f"{words.weightings([base])}, clipped at {ctx.clip_norm:g}, and its norm short of the "
                    f"clip norm by what {by} gives (clip_grad_norm_ divides by the norm + 1e-6)")
    return None


def _equal_counts(probes: list[Probe], tol: float) -> bool:
    """Every split tried weights its micro-batches equally in the full batch (equal counts)."""
    for p in probes:
        full = solve(p.parts, p.bases["full"], tol) if p.parts is not None else None
        if full is None or float(full.max() - full.min()) > tol * float(full.abs().max()):
            return False
    return True


def _scheduler_first(events: list[tuple[str, int]]) -> bool:
    """The window's one scheduler step came before its optimizer step."""
    kinds = [kind for kind, _ in events]
    return kinds.count("scheduler") == 1 and "step" in kinds and \
        kinds.index("scheduler") < kinds.index("step")


def _clipped_scaled(h: Hypothesis | None, seen: Any, clip_norm: float | None, tol: float) -> str | None:
    """Clipping before a loss scale was undone: the full batch's direction at a constant norm,
    ``clip_norm`` over a power of 2, on every split."""
    if h is None or clip_norm is None or h.base != "full" or h.family != "constant":
        return None
    m = loss_scale(clip_norm / max(float(seen.norm()), 1e-300), max(tol, 1e-6), least=1)
    return words.clipped_scaled(m, clip_norm) if m is not None and m > 0 else None


def _repeated_backward(h: Hypothesis, trace: Trace, k: int) -> int | None:
    """m, when the gradient is m times the full batch's on every split and the window held m
    backward passes per micro-batch (m >= 2)."""
    m = round(h.param)
    if h != Hypothesis("full", "constant", h.param) or m < 2 or abs(h.param - m) > 1e-6 * m:
        return None
    return m if trace.backwards and trace.backwards[0] == m * k else None
