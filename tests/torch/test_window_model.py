"""Model-based test: the real Accumulator against an independent float64 model of the window.

Hypothesis drives random sequences of operations (``backward`` with every ``n_items`` form and
both reductions, empty sum-reduced micro-batches, ``micro_batch`` blocks, ``mb.term`` windows,
``flush``, ``discard``, a checkpoint reloaded into a fresh accumulator mid-window, schedules that
change ``steps`` (by optimizer step or by epoch), ``set_epoch`` and ``resize_window`` (each
followed by a reload: a state the accumulator wrote always loads), clipping, an LR scheduler and
a GradScaler that overflows on chosen micro-batches) through :class:`gradaccum.Accumulator` on a
tiny float64 linear model and through :mod:`tests.torch.window_model`, which shares no code with
the accumulator. Each micro-batch's forward takes one of the shapes of ``SHAPES`` (the gradients
views of one buffer; reentrant checkpoint segments of a depth that varies between micro-batches).
After every operation the parameters (to 1e-12), the counters, the window loss and the return
values agree, and an operation that completes no window leaves the parameters
bitwise unchanged.

Profiles (tests/conftest.py): ``ci`` (the default: derandomized, 200 sequences) and ``slow``
(10x: ``pytest tests/torch/test_window_model.py --hypothesis-profile=slow``). A failure prints
the shortest sequence of operations that reproduces it.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.utils.checkpoint import checkpoint

import gradaccum
from tests.torch.window_model import D_IN, D_OUT, LR, Piece, Reference

FORMS = ("int", "float", "i64", "i32", "f64", "f32")
CHECKED = {"sequences": 0, "operations": 0}  # what a run compared (read by scripts that report it)
SCALE0 = 2.0**10


class Poison(torch.autograd.Function):
    """Passes a loss through unchanged; its backward gives every gradient inf (an fp16 overflow
    the GradScaler must catch)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("inf")


def count(form: str, value: float) -> Any:
    """``value`` in one of the forms a user passes ``n_items`` in."""
    if form == "int":
        return int(value)
    if form == "float":
        return float(value)
    dtype = {"i64": torch.int64, "i32": torch.int32, "f64": torch.float64, "f32": torch.float32}[form]
    return torch.tensor(value, dtype=dtype)


# How a micro-batch's forward reaches the parameters (the same function of them): directly; through
# one tensor cat from both, whose backward leaves their gradients views of one buffer (one version
# counter, as an MoE layer's torch.stack of its experts); or as d reentrant checkpoint segments of
# 1/d of the output each, d additions into each gradient per pass, the depth varying by micro-batch.
SHAPES = ("plain", "views", "reentrant 1", "reentrant 2", "reentrant 3")


def forward(model: torch.nn.Linear, x: torch.Tensor, shape: str) -> torch.Tensor:
    """``model(x)`` computed as ``shape`` says."""
    if shape == "views":
        flat = torch.cat([model.weight.reshape(-1), model.bias])
        w, b = flat[: model.weight.numel()].view_as(model.weight), flat[model.weight.numel():]
        return torch.nn.functional.linear(x, w, b)
    if shape.startswith("reentrant"):
        depth = int(shape.split()[1])
        x = x.requires_grad_()
        return sum(checkpoint(lambda t: model(t) / depth, x, use_reentrant=True)  # type: ignore[misc]
                   for _ in range(depth))
    return model(x)


def torch_loss(model: torch.nn.Linear, piece: Piece) -> torch.Tensor:
    x, y = (torch.from_numpy(a) for a in piece.data())
    mask = torch.tensor(piece.mask, dtype=torch.float64)
    out = forward(model, x, SHAPES[piece.seed % len(SHAPES)])
    loss = piece.coef * 0.5 * (((out - y) * mask) ** 2).sum()
    return loss / piece.k if piece.mean else loss


pieces = st.builds(Piece, seed=st.integers(0, 2**16), k=st.integers(1, 4),
                   mask=st.sampled_from([(1.0, 1.0), (1.0, 0.0), (0.0, 1.0)]),
                   coef=st.sampled_from([1.0, 0.5, 3.0]))
mean_counts = st.sampled_from([1, 2, 3, 5, 0.5, 2.25])


class WindowMachine(RuleBasedStateMachine):
    """The Accumulator and the reference, fed the same operations."""

    @initialize(
        schedule=st.sampled_from(["1", "2", "3", "4", "map", "callable", "epochs"]),
        clip=st.sampled_from([None, None, 0.05, 2.0]),
        scheduler=st.booleans(),
        scaler=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(self, schedule: str, clip: float | None, scheduler: bool, scaler: bool, seed: int) -> None:
        CHECKED["sequences"] += 1
        rng = np.random.default_rng(seed)
        w, b = rng.standard_normal((D_OUT, D_IN)), rng.standard_normal(D_OUT)
        if schedule == "map":
            spec: Any = {0: 3, 2: 2, 3: 4}
            sizes = lambda s: 3 if s < 2 else 2 if s < 3 else 4  # noqa: E731
        elif schedule == "callable":
            spec = sizes = lambda s: 1 + s % 3
        elif schedule == "epochs":
            spec = gradaccum.Schedule({0: 3, 1: 2, 3: 4}, by="epoch")
            sizes = lambda e: 3 if e < 1 else 2 if e < 3 else 4  # noqa: E731
        else:
            spec, size = int(schedule), int(schedule)
            sizes = lambda s: size  # noqa: E731
        self.spec, self.clip = spec, clip
        self.model = torch.nn.Linear(D_IN, D_OUT).double()
        with torch.no_grad():
            self.model.weight.copy_(torch.from_numpy(w))
            self.model.bias.copy_(torch.from_numpy(b))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, 0.5) if scheduler else None
        self.scaler = (torch.amp.GradScaler("cpu", init_scale=SCALE0, growth_interval=10**9)
                       if scaler else None)
        self.acc = self._new_accumulator()
        self.ref = Reference(w, b, sizes, clip, scheduler, SCALE0 if scaler else None,
                             by="epoch" if schedule == "epochs" else "step")
        self.before: list[torch.Tensor] = []

    def _new_accumulator(self) -> gradaccum.Accumulator:
        return gradaccum.Accumulator(self.opt, self.spec, clip_norm=self.clip, scheduler=self.sched,
                                     scaler=self.scaler)

    # -- helpers ---------------------------------------------------------------------------
    def _snapshot(self) -> None:
        self.before = [p.detach().clone() for p in self.model.parameters()]

    def _unchanged_unless(self, stepped_or_closed: bool) -> None:
        """The negative twin: no boundary, no change to any parameter, bit for bit."""
        if not stepped_or_closed:
            for p, q in zip(self.model.parameters(), self.before, strict=True):
                assert torch.equal(p, q), "a parameter changed inside a window"

    def _weighting(self) -> str | None:
        return self.ref.window.weighting

    def _loss(self, piece: Piece, overflow: bool) -> torch.Tensor:
        loss = torch_loss(self.model, piece)
        return Poison.apply(loss) if overflow else loss

    # -- operations ------------------------------------------------------------------------
    @precondition(lambda self: self._weighting() in (None, "mean") and not self.ref.window.terms)
    @rule(piece=pieces, overflow=st.booleans())
    def backward_mean(self, piece: Piece, overflow: bool) -> None:
        overflow = overflow and self.scaler is not None
        self._snapshot()
        windows = self.ref.optimizer_steps + self.ref.skipped_windows
        got = self.acc.backward(self._loss(piece, overflow))
        want = self.ref.micro_batch([piece], None, False, overflow)
        assert got == want
        self._unchanged_unless(self.ref.optimizer_steps + self.ref.skipped_windows != windows)

    @precondition(lambda self: self._weighting() in (None, "items"))
    @rule(piece=pieces, form=st.sampled_from(FORMS), summed=st.booleans(), empty=st.booleans(),
          n=mean_counts, overflow=st.booleans())
    def backward_items(self, piece: Piece, form: str, summed: bool, empty: bool, n: float,
                       overflow: bool) -> None:
        overflow = overflow and self.scaler is not None
        if summed:
            piece = Piece(piece.seed, 0 if empty else piece.k, piece.mask, piece.coef, mean=False)
            n = piece.k  # a sum over k items
        elif form in ("int", "i64", "i32"):
            n = max(1, int(n))
        overflow = overflow and piece.k > 0  # no item, no gradient to overflow
        self._snapshot()
        windows = self.ref.optimizer_steps + self.ref.skipped_windows
        loss = self._loss(piece, overflow) if piece.k else self.model(torch.zeros(0, D_IN,
                                                                                 dtype=torch.float64)).sum()
        got = self.acc.backward(loss, count(form, n), reduction="sum" if summed else "mean")
        want = self.ref.micro_batch([piece], n, summed, overflow)
        assert got == want
        self._unchanged_unless(self.ref.optimizer_steps + self.ref.skipped_windows != windows)

    @precondition(lambda self: not self.ref.window.terms)
    @rule(parts=st.lists(pieces, min_size=1, max_size=3), form=st.sampled_from((None, *FORMS)),
          n=mean_counts)
    def micro_batch(self, parts: list[Piece], form: str | None, n: float) -> None:
        weighting = self._weighting()
        if weighting is not None and (form is None) != (weighting == "mean"):
            form = None if weighting == "mean" else "int"
        if form in ("int", "i64", "i32"):
            n = max(1, int(n))
        self._snapshot()
        windows = self.ref.optimizer_steps + self.ref.skipped_windows
        with self.acc.micro_batch(None if form is None else count(form, n)) as mb:
            for piece in parts:
                mb.backward(torch_loss(self.model, piece))
        want = self.ref.micro_batch(parts, None if form is None else n, False)
        assert mb.stepped == want
        self._unchanged_unless(self.ref.optimizer_steps + self.ref.skipped_windows != windows)

    @precondition(lambda self: not self.ref.window.parts)
    @rule(data=st.data(), reload_at=st.integers(-1, 3), try_flush=st.booleans())
    def term_window(self, data: st.DataObject, reload_at: int, try_flush: bool) -> None:
        """A whole window of term blocks (a term's total is its window's; terms need a full one)."""
        size = self.ref.window.size
        summed = data.draw(st.booleans(), label="summed_term")
        blocks = [(data.draw(pieces), data.draw(pieces), data.draw(st.sampled_from(FORMS)),
                   data.draw(st.integers(1, 4))) for _ in range(size)]
        total = float(sum(n for *_, n in blocks))
        for i, (term, plain, form, n) in enumerate(blocks):
            if i == reload_at and i:
                self.reload()
            if try_flush and i == 1:
                self._snapshot()
                with pytest.raises(ValueError, match="term"):
                    self.acc.flush()
                self._unchanged_unless(False)
            term = Piece(term.seed, n if summed else term.k, term.mask, term.coef, mean=not summed)
            with self.acc.micro_batch() as mb:
                t = mb.term(torch_loss(self.model, term), count(form, n), total=total,
                            reduction="sum" if summed else "mean")
                mb.backward(t + torch_loss(self.model, plain))
            assert mb.stepped == self.ref.term_block(term, n, total, plain, summed)
            del mb, t  # a live handle keeps its accumulator alive (reload drops it)

    @rule()
    def flush(self) -> None:
        if self.ref.window.terms:
            with pytest.raises(ValueError):
                self.acc.flush()
            return
        assert self.acc.flush() == self.ref.flush()

    @rule()
    def discard(self) -> None:
        self._snapshot()
        self.acc.discard()
        self.ref.discard()
        self._unchanged_unless(False)
        assert all(p.grad is None for p in self.model.parameters())

    @rule()
    def reload(self) -> None:
        """state_dict through torch.save, into a fresh accumulator (the old one dropped)."""
        buf = io.BytesIO()
        torch.save(self.acc.state_dict(), buf)
        del self.acc
        buf.seek(0)
        state = torch.load(buf, weights_only=False)
        self.acc = self._new_accumulator()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a resume that warns would be a finding
            self.acc.load_state_dict(state)

    @rule(epoch=st.integers(0, 4))
    def set_epoch(self, epoch: int) -> None:
        """A new epoch (any schedule; only an epoch schedule's size follows it), then a reload."""
        self._snapshot()
        self.acc.set_epoch(epoch)
        self.ref.set_epoch(epoch)
        self._unchanged_unless(False)
        self.reload()

    @precondition(lambda self: not self.ref.window.parts)
    @rule(size=st.integers(1, 5))
    def resize_window(self, size: int) -> None:
        """AutoBatch's call on an empty window, then a reload."""
        self.acc.resize_window(size)
        self.ref.resize(size)
        self.reload()

    @precondition(lambda self: bool(self.ref.window.parts))
    @rule(size=st.integers(1, 5))
    def resizing_a_started_window_is_refused(self, size: int) -> None:
        with pytest.raises(ValueError, match="needs an empty window"):
            self.acc.resize_window(size)

    @precondition(lambda self: self._weighting() == "mean" and not self.ref.window.terms)
    @rule(piece=pieces)
    def mixing_is_refused(self, piece: Piece) -> None:
        """The negative check: a count in a window without counts raises, and changes nothing."""
        self._snapshot()
        grads = [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]
        step = self.acc.micro_step
        with pytest.raises(ValueError, match="mixes weightings"):
            self.acc.backward(torch_loss(self.model, piece), 3)
        assert self.acc.micro_step == step
        self._unchanged_unless(False)
        for p, g in zip(self.model.parameters(), grads, strict=True):
            assert (p.grad is None and g is None) or torch.equal(p.grad.nan_to_num(), g.nan_to_num())

    # -- the invariant ---------------------------------------------------------------------
    @invariant()
    def agrees(self) -> None:
        CHECKED["operations"] += 1
        ref, acc = self.ref, self.acc
        assert acc.micro_step == len(ref.window.parts)
        assert acc.steps == ref.window.size
        assert acc.optimizer_steps == ref.optimizer_steps
        assert acc.skipped_windows == ref.skipped_windows
        assert acc.epoch == ref.epoch
        w, b = self.model.weight.detach().numpy(), self.model.bias.detach().numpy()
        np.testing.assert_allclose(w, ref.w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(b, ref.b, rtol=0, atol=1e-12)
        if ref.window_loss is None:
            assert acc.window_loss is None
        else:
            assert acc.window_loss is not None
            np.testing.assert_allclose(float(acc.window_loss), ref.window_loss, rtol=1e-12, atol=1e-12)
        if self.scaler is not None:
            assert self.scaler.get_scale() == ref.scale
        assert self.opt.param_groups[0]["lr"] == pytest.approx(ref.lr(), rel=1e-15)


TestWindowModel = WindowMachine.TestCase
