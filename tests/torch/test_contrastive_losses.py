"""gradaccum.contrastive on one process: clip_loss, info_nce and siglip_loss against their dense
formulas (float64 within 1e-12, loss and every gradient, the scale's and the bias's included;
float32 with assert_close's defaults), no B x B tensor in either pass, as loss_fn of
backward_cached inside a clipped window, the building block rank_local, and bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn.functional import normalize
from torch.utils._python_dispatch import TorchDispatchMode

import gradaccum
from gradaccum.contrastive import clip_loss, info_nce, rank_local, siglip_loss
from tests.contrastive import Towers, full_batch_grads, grads, largest_difference, pairs, step_pre_grads
from tests.contrastive_dense import clip_dense, info_nce_dense, siglip_dense

F64 = torch.float64


def features(rows: int, dim: int = 5, seed: int = 0, dtype: torch.dtype = F64,
             spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=g, dtype=dtype) * spread).requires_grad_()


def scalar(value: float, learnable: bool, dtype: torch.dtype = F64) -> torch.Tensor | float:
    return torch.tensor(value, dtype=dtype, requires_grad=True) if learnable else value


# name -> (tiled, dense, how many scalars it takes)
LOSSES = {
    "clip": (clip_loss, clip_dense, 1),
    "info_nce": (info_nce, info_nce_dense, 1),
    "siglip": (siglip_loss, siglip_dense, 2),
}


def both(name: str, a, b, scalars, tile):
    """The tiled and the dense loss with every gradient: [loss, da, db, d scalars...]."""
    tiled, dense, _ = LOSSES[name]
    wrt = [a, b, *(s for s in scalars if isinstance(s, torch.Tensor))]
    out = []
    for fn, kw in ((tiled, {"tile": tile}), (dense, {})):
        loss = fn(a, b, *scalars, **kw)
        out.append([loss.detach(), *torch.autograd.grad(loss, wrt)])
    return out


SHAPES = {"tile-over-B": (13, 13, 64), "tile-divides-B": (12, 12, 4), "tile-does-not-divide": (13, 13, 5),
          "one-pair": (1, 1, 1), "tile-1": (9, 9, 1), "hard-negatives": (13, 20, 6)}
EXACT = [pytest.param(name, *shape, learnable, id=f"{name}-{case}-{'tensor' if learnable else 'float'}-scale")
         for name in LOSSES for case, shape in SHAPES.items() for learnable in (True, False)
         if case != "hard-negatives" or name == "info_nce"]  # only info_nce takes extra keys


@pytest.mark.parametrize("name, rows, keys, tile, learnable", EXACT)
def test_the_loss_and_every_gradient_are_the_dense_formulas(name, rows, keys, tile, learnable):
    a, b = features(rows, seed=1), features(keys, seed=2)
    scalars = [scalar(1.7, learnable), scalar(-2.5, learnable)][:LOSSES[name][2]]
    got, want = both(name, a, b, scalars, tile)
    assert len(got) == len(want) == 3 + learnable * len(scalars)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert float((g - w).abs().max()) < 1e-12
    if rows > 1:  # (one pair: CLIP's and InfoNCE's loss is 0 whatever the features)
        assert float(want[1].abs().max()) > 1e-2 and (not learnable or float(want[-1].abs()) > 1e-3)


@pytest.mark.parametrize("name", LOSSES)
def test_large_logits_stay_exact(name):
    # unnormalized vectors, scale 30: logits in the hundreds, where a plain exp overflows float32
    a, b = features(40, seed=3, spread=3.0), features(40, seed=4, spread=3.0)
    scalars = [scalar(30.0, True), scalar(-10.0, True)][:LOSSES[name][2]]
    got, want = both(name, a, b, scalars, 16)
    assert float((a.detach() @ b.detach().T * 30).abs().max()) > 200
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) / max(1.0, float(w.abs().max())) < 1e-12


@pytest.mark.parametrize("name", LOSSES)
def test_float32_is_the_dense_loss_to_float32_rounding(name):
    a = normalize(features(300, dim=16, seed=5, dtype=torch.float32), dim=1)
    b = normalize(features(300, dim=16, seed=6, dtype=torch.float32), dim=1)
    scalars = [torch.tensor(1 / 0.07, requires_grad=True), torch.tensor(-10.0, requires_grad=True)]
    got, want = both(name, a, b, scalars[:LOSSES[name][2]], 64)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_frozen_side_gets_no_gradient_and_the_other_stays_exact():
    a, b = features(10, seed=7), features(10, seed=8).detach()
    s = scalar(2.0, True)
    ga, gs = torch.autograd.grad(clip_loss(a, b, s, tile=3), [a, s])
    wa, ws = torch.autograd.grad(clip_dense(a, b, s), [a, s])
    assert float((ga - wa).abs().max()) < 1e-12 and float((gs - ws).abs()) < 1e-12


class Sizes(TorchDispatchMode):
    """The largest number of elements of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("name", LOSSES)
def test_no_op_makes_a_b_by_b_tensor_in_the_forward_or_the_backward_pass(name):
    rows, dim, tile = 96, 4, 16  # B*B = 9,216; one tile 256; the features and their grads 2*384+2
    a, b = features(rows, dim, seed=9), features(rows, dim, seed=10)
    scalars = [scalar(2.0, True), scalar(-1.0, True)][:LOSSES[name][2]]
    tiled, dense, _ = LOSSES[name]
    for fn, kw in ((tiled, {"tile": tile}), (dense, {})):
        with Sizes() as sizes:
            loss = fn(a, b, *scalars, **kw)
            grads = torch.autograd.grad(loss, [a, b, *scalars])
        if fn is dense:  # the negative twin: the mode sees the dense formula's B x B logits
            assert sizes.largest >= rows * rows
        else:
            assert sizes.largest <= 2 * rows * dim + 2 < rows * rows
            tiled_loss, tiled_grads = loss, grads
    assert float((tiled_loss - loss).detach().abs()) < 1e-12
    assert max(float((g - w).abs().max()) for g, w in zip(tiled_grads, grads, strict=True)) < 1e-12


def test_the_default_tile_is_exact_too():
    a, b = features(1100, dim=3, seed=11), features(1100, dim=3, seed=12)  # over one 1,024 tile
    s = scalar(3.0, True)
    got = torch.autograd.grad(clip_loss(a, b, s), [a, b, s])
    want = torch.autograd.grad(clip_dense(a, b, s), [a, b, s])
    assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) < 1e-12


@pytest.mark.parametrize("name", LOSSES)
def test_under_autocast_the_products_run_in_its_dtype_and_the_sums_in_float32(name):
    a = normalize(features(50, dim=8, seed=13, dtype=torch.float32), dim=1)
    b = normalize(features(50, dim=8, seed=14, dtype=torch.float32), dim=1)
    scalars = [10.0, -5.0][:LOSSES[name][2]]
    tiled, dense, _ = LOSSES[name]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = tiled(a, b, *scalars, tile=16)
        want = dense(a, b, *scalars)  # autocast: a bf16 a @ b.T, a float32 cross-entropy
        got_grads, want_grads = (torch.autograd.grad(x, [a]) for x in (inside, want))
    rounded = tiled(a.bfloat16(), b.bfloat16(), *scalars, tile=16)  # bf16 features: bf16 products
    plain = tiled(a, b, *scalars, tile=16)
    assert inside.dtype == rounded.dtype == torch.float32 and torch.equal(inside, rounded)
    assert not torch.equal(inside, plain)  # the negative twin: autocast did change the products
    torch.testing.assert_close(inside, want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_grads[0], want_grads[0], rtol=5e-2, atol=5e-3)


def test_double_backward_is_refused_with_a_clear_error():
    a, b = features(6, seed=15), features(6, seed=16)
    loss = clip_loss(a, b, 2.0, tile=4)
    with pytest.raises(RuntimeError, match="do not support double backward"):
        torch.autograd.grad(loss, [a], create_graph=True)


def test_the_module_is_an_attribute_of_gradaccum_and_imports_by_name():
    import gradaccum.contrastive as module

    assert gradaccum.contrastive is module and gradaccum.contrastive.clip_loss is clip_loss
    assert sorted(module.__all__) == ["clip_loss", "info_nce", "rank_local", "siglip_loss"]


# ---------------------------------------------------------------- as loss_fn of backward_cached

def tiled_clip(model, tile):
    return lambda i, t: clip_loss(normalize(i, dim=1), normalize(t, dim=1), model.logit_scale.exp(),
                                  tile=tile)


def dense_clip(model):
    return lambda i, t: clip_dense(normalize(i, dim=1), normalize(t, dim=1), model.logit_scale.exp())


@pytest.mark.parametrize("size", [24, 5], ids=["unchunked", "chunks-of-5"])
def test_as_loss_fn_of_backward_cached_in_a_clipped_window_it_is_the_full_batch(size):
    base = Towers()
    batches = [gradaccum.chunks(pairs(24, seed=s), size) for s in (1, 2, 3, 4)]
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, 2, model=model, clip_norm=0.05)
    seen = step_pre_grads(acc, model)
    for chunks in batches:
        acc.backward_cached(lambda c: model(*c), tiled_clip(model, 7), chunks)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    norms, wants = [], []
    for window in (batches[:2], batches[2:]):
        full_batch_grads(ref, window, dense_clip(ref))
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        wants.append(grads(ref))  # what the optimizer sees: clipped
        ref_opt.step()
    assert min(norms) > 0.05  # clipping acted
    assert len(seen) == 2 and all(largest_difference(s, w) < 1e-12 for s, w in zip(seen, wants, strict=True))
    assert largest_difference(dict(model.named_parameters()), dict(ref.named_parameters())) < 1e-12


# ---------------------------------------------------------------- rank_local on one process

def supcon_rows(temperature):
    def rows(part, z, labels):
        logits = (z[part] @ z.T) / temperature
        mine = torch.arange(len(z))[part]
        self_mask = mine[:, None] == torch.arange(len(z))[None, :]
        logits = logits.masked_fill(self_mask, float("-inf"))
        log_prob = logits - logits.logsumexp(1, keepdim=True)
        positives = (labels[part][:, None] == labels[None, :]) & ~self_mask
        return -(log_prob.masked_fill(~positives, 0).sum(1) / positives.sum(1).clamp(min=1)).sum()
    return rows


def test_rank_local_on_one_process_is_the_loss_over_every_row():
    from tests.contrastive import supcon_loss

    z, labels = features(16, seed=17), torch.arange(16) % 4
    t = torch.tensor(0.5, dtype=F64, requires_grad=True)
    got = rank_local(supcon_rows(t), len(z), normalize(z, dim=1), labels) / len(z)
    want = supcon_loss(z, labels, temperature=0.5)
    assert float((got - want).detach().abs()) < 1e-12
    g, w = torch.autograd.grad(got, z), torch.autograd.grad(want, z)
    assert float((g[0] - w[0]).abs().max()) < 1e-12


def test_rank_local_refuses_bad_arguments():
    z = features(4, seed=18)
    with pytest.raises(TypeError, match="loss_rows must be callable"):
        rank_local("sum", 4, z)
    for rows in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="rows must be a positive int"):
            rank_local(lambda part, z: z[part].sum(), rows, z)
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(4,\)"):
        rank_local(lambda part, z: z[part].sum(1), 4, z)


# ---------------------------------------------------------------- bad input

def call(name, a, b, *scalars, **kw):
    fn, _, count = LOSSES[name]
    scalars = (*scalars, 1.0, 1.0)[:count]
    return fn(a, b, *scalars, **kw)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("tile, error, text", [
    (0, ValueError, "got 0"), (-3, ValueError, "got -3"), (2.5, TypeError, r"got 2\.5 \(float\)"),
    (True, TypeError, r"got True \(bool\)"), ("4", TypeError, r"got '4' \(str\)")])
def test_a_bad_tile_is_refused(name, tile, error, text):
    a, b = features(4), features(4, seed=1)
    with pytest.raises(error, match="tile must be a positive integer.*" + text):
        call(name, a, b, tile=tile)


@pytest.mark.parametrize("name", LOSSES)
def test_mismatched_features_are_refused_naming_both(name):
    first, second = ("queries", "keys") if name == "info_nce" else ("a", "b")
    a = features(4)
    cases = [
        (features(4, dim=6), f"{first} and {second} must have the same width.*\\(4, 5\\).*\\(4, 6\\)"),
        (features(4).float(), f"{first} is torch.float64 and {second} is torch.float32"),
        (torch.zeros(4, 5, dtype=F64, device="meta"), f"{first} is on cpu and {second} on meta"),
        (torch.zeros(4, 5, 1, dtype=F64), f"{second} must be a floating tensor of shape \\(rows, dim\\)"),
        (torch.zeros(4, 5, dtype=torch.int64), f"{second} must be a floating tensor"),
        (torch.zeros(0, 5, dtype=F64), f"{second} has no rows"),
    ]
    for b, text in cases:
        with pytest.raises(ValueError, match=text):
            call(name, a, b)
    with pytest.raises(TypeError, match=f"{first} must be a tensor"):
        call(name, [[1.0]], a)
    if name != "info_nce":
        for rows in (3, 6):
            with pytest.raises(ValueError, match=f"a has 4 rows and b {rows}: row i of each is one pair"):
                call(name, a, features(rows))


def test_keys_fewer_than_queries_are_refused():
    with pytest.raises(ValueError, match="keys has 3 rows, fewer than the 4 of queries"):
        info_nce(features(4), features(3), 1.0)


@pytest.mark.parametrize("name, position", [(name, k) for name in LOSSES for k in range(LOSSES[name][2])])
def test_a_non_scalar_or_non_finite_scale_is_refused(name, position):
    arg = {"clip": "logit_scale", "info_nce": "scale", "siglip": "logit_scale"}[name] if position == 0 \
        else "logit_bias"
    a, b = features(4), features(4, seed=1)
    cases = [(torch.ones(2, dtype=F64), ValueError, r"must be a scalar .*shape \(2,\)"),
             (math.inf, ValueError, "must be finite, got inf"),
             (torch.tensor(math.nan, dtype=F64), ValueError, "must be finite, got nan"),
             (torch.tensor(1, dtype=torch.int64), ValueError, "must be a floating tensor"),
             (torch.tensor(1.0, dtype=F64, device="meta"), ValueError, "is on meta"),
             ("2", TypeError, "must be a real number"), (None, TypeError, "must be a real number")]
    for value, error, text in cases:
        scalars = [1.0, 1.0]
        scalars[position] = value
        with pytest.raises(error, match=f"{arg} {text}"):
            call(name, a, b, *scalars)
