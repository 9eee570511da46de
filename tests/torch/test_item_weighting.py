"""Item weighting that stays exact in practice: provisional totals, summed losses, empty
micro-batches and windows, float weights, fp16 with a GradScaler, short error hints."""

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import (
    PAD,
    VOCAB,
    assert_params_close,
    bitwise_equal,
    clone_model,
    data,
    lm_loss,
    mlp,
    padded,
    snapshot,
    tiny_lm,
)


def full_batch_step(ref, opt, tokens, targets):
    opt.zero_grad()
    lm_loss(ref, tokens, targets).backward()
    opt.step()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_summed_losses_with_empty_micro_batches_equal_the_full_batch(as_tensor):
    model = tiny_lm()
    ref = clone_model(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    acc = gradaccum.Accumulator(opt, 4)
    for w in range(3):
        tokens, targets = padded(8, 6, seed=w, empty=(0, 1, 4, 5))  # micro-batches 0 and 2: no target
        for tb, yb in zip(tokens.split(2), targets.split(2), strict=True):
            n = gradaccum.count_tokens(yb)
            acc.backward(lm_loss(model, tb, yb, "sum"), n if as_tensor else int(n), reduction="sum")
        full_batch_step(ref, ref_opt, tokens, targets)
    assert acc.optimizer_steps == 3
    assert_params_close(model, ref, torch.float64)


def test_a_window_without_items_takes_no_step():
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    acc = gradaccum.Accumulator(opt, 2, scheduler=sched)
    tokens, targets = padded(4, 5, seed=0, empty=range(4))
    before = snapshot(model)
    stepped = [acc.backward(lm_loss(model, tb, yb, "sum"), n_items=0, reduction="sum")
               for tb, yb in zip(tokens.split(2), targets.split(2), strict=True)]
    assert stepped == [False, False]
    assert bitwise_equal(model, before)
    assert acc.optimizer_steps == 0 and acc.micro_step == 0 and sched.last_epoch == 0
    assert all(p.grad is None for p in model.parameters())
    # The next window with items steps as usual.
    tokens, targets = padded(4, 5, seed=1)
    for tb, yb in zip(tokens.split(2), targets.split(2), strict=True):
        acc.backward(lm_loss(model, tb, yb, "sum"), gradaccum.count_tokens(yb), reduction="sum")
    assert acc.optimizer_steps == 1 and not bitwise_equal(model, before)


def test_float_weights_give_the_weighted_mean():
    model = mlp()
    ref = clone_model(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    acc = gradaccum.Accumulator(opt, 3)
    x, y = data(9)
    w = torch.rand(9, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.1
    for i, (xb, yb, wb) in enumerate(zip(x.split(3), y.split(3), w.split(3), strict=True)):
        per = nn.functional.cross_entropy(model(xb), yb, reduction="none")
        weight = wb.sum() if i % 2 else float(wb.sum())  # a float tensor or a Python float
        acc.backward((per * wb).sum() / wb.sum(), n_items=weight)
    ref_opt.zero_grad()
    ((nn.functional.cross_entropy(ref(x), y, reduction="none") * w).sum() / w.sum()).backward()
    ref_opt.step()
    assert_params_close(model, ref, torch.float64)


def count_foreach_mul(monkeypatch):
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("counts, passes", [([4, 4, 4], 0), ([4, 2, 4], 1)])
def test_a_full_window_of_equal_counts_needs_no_gradient_pass(monkeypatch, counts, passes):
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1, foreach=False), 3)
    x, y = data(12)
    calls = count_foreach_mul(monkeypatch)
    start = 0
    for n in counts:
        acc.backward(nn.functional.cross_entropy(model(x[start:start + n]), y[start:start + n]), n)
        start += n
    assert acc.optimizer_steps == 1 and len(calls) == passes


def test_item_weighted_gradients_stay_at_mean_scale():
    # The loss fed to backward is scaled by n_i / (n_1 * N): a window of equal counts has the
    # gradient magnitude of the plain mean, not n_items times it (what overflowed fp16).
    grads = {}
    for n in (None, 1024):
        model = mlp()
        acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.0), 2)
        x, y = data(8)
        acc.backward(nn.functional.cross_entropy(model(x[:4]), y[:4]), n)
        grads[n] = model[0].weight.grad.clone()
    torch.testing.assert_close(grads[1024], grads[None], atol=1e-15, rtol=1e-12)


def fp16_skips(feed, windows=12, steps=4, tokens=256):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, VOCAB))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    acc = gradaccum.Accumulator(opt, steps, scaler=torch.amp.GradScaler("cpu"))
    g = torch.Generator().manual_seed(1)
    for _ in range(windows * steps):
        ids = torch.randint(0, VOCAB, (tokens,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(ids), ids)
        feed(acc, loss, tokens)
    return acc.skipped_windows


def test_fp16_with_n_items_skips_no_more_windows_than_without():
    plain = fp16_skips(lambda acc, loss, n: acc.backward(loss))
    weighted = fp16_skips(lambda acc, loss, n: acc.backward(loss, n_items=n))
    # Negative twin: 0.1.0 multiplied the loss by n_items before scaling, and overflowed more.
    multiplied = fp16_skips(lambda acc, loss, n: acc.backward(loss * n))
    assert weighted <= plain
    assert multiplied > plain


@pytest.mark.parametrize("kwargs, match", [
    ({"n_items": 0}, "reduction='sum'"),
    ({"n_items": None, "reduction": "sum"}, "n_items=None with reduction='sum'"),
    ({"n_items": 3, "reduction": "max"}, "reduction must be"),
    ({"n_items": 2**60}, "n_items=1152921504606846976 is beyond"),
    ({"n_items": -1.5}, "n_items must be >= 0"),
])
def test_bad_counts_and_reductions_are_refused_before_anything_changes(kwargs, match):
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = data(4)
    with pytest.raises(ValueError, match=match):
        acc.backward(nn.functional.cross_entropy(model(x), y), **kwargs)
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


@dataclasses.dataclass
class FakeOutput:
    loss: torch.Tensor
    logits: torch.Tensor


@pytest.mark.parametrize("wrap, hint", [
    (lambda logits, loss: (logits, loss), "loss element"),
    (lambda logits, loss: [logits, loss], "loss element"),
    (lambda logits, loss: FakeOutput(loss, logits), "outputs.loss"),
    (lambda logits, loss: {"loss": loss, "logits": logits}, "outputs.loss"),
])
def test_a_model_output_instead_of_a_loss_gets_a_short_hint(wrap, hint):
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = data(64)
    logits = model(x)
    with pytest.raises(TypeError, match=hint) as info:
        acc.backward(wrap(logits, nn.functional.cross_entropy(logits, y)))
    assert len(str(info.value)) <= 300


def test_count_tokens_counts_what_a_causal_lm_loss_sees():
    labels = torch.tensor([[5, 7, 2, PAD], [3, PAD, PAD, PAD]])
    assert gradaccum.count_tokens(labels).item() == 4
    shifted = gradaccum.count_tokens(labels, shift=True)
    assert shifted.item() == 2 and shifted.dim() == 0 and shifted.dtype == torch.int64
    assert gradaccum.count_tokens(labels, ignore_index=2).item() == 7
    with pytest.raises(TypeError, match="labels"):
        gradaccum.count_tokens(labels.float())


def test_shifted_count_makes_a_causal_lm_exact_and_the_unshifted_one_does_not():
    # A causal LM predicts token t+1 from position t: its loss averages labels[..., 1:].
    def causal_loss(model, tokens, labels):
        logits = model(tokens)[:, :-1]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=PAD)

    results = {}
    for shift in (True, False):
        model = tiny_lm()
        ref = clone_model(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
        acc = gradaccum.Accumulator(opt, 3)
        tokens, labels = padded(6, 7, seed=5)
        for tb, lb in zip(tokens.split(2), labels.split(2), strict=True):
            acc.backward(causal_loss(model, tb, lb), gradaccum.count_tokens(lb, shift=shift))
        ref_opt.zero_grad()
        causal_loss(ref, tokens, labels).backward()
        ref_opt.step()
        results[shift] = max((a - b).abs().max().item()
                             for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert results[True] < 1e-12 < 1e-6 < results[False]


def test_no_gradient_in_a_window_warns_once():
    model, other = mlp(), mlp(seed=1)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    x, y = data(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            acc.backward(nn.functional.cross_entropy(other(x), y))  # a loss from another model
    assert sum("received a gradient" in str(w.message) for w in caught) == 1


def test_autobatch_feeds_summed_losses_with_empty_micro_batches():
    model = tiny_lm()
    ref = clone_model(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    auto = gradaccum.AutoBatch(gradaccum.Accumulator(opt, 1), micro_batch=2)
    tokens, targets = padded(6, 5, seed=7, empty=(2, 3))  # the second micro-batch has no target

    def loss_fn(mb):
        return lm_loss(model, mb[0], mb[1], "sum"), gradaccum.count_tokens(mb[1])

    assert auto.step((tokens, targets), loss_fn, reduction="sum")
    full_batch_step(ref, ref_opt, tokens, targets)
    assert auto.last_sizes == [2, 2, 2]
    assert_params_close(model, ref, torch.float64)


def test_fp16_with_varying_counts_skips_no_more_windows_than_without():
    # Padded micro-batches: counts vary, so the provisional total is size times the largest count
    # seen, which keeps every micro-batch's factor at most 1/N once the counts are known.
    lengths = torch.randint(32, 257, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    it = iter(lengths)
    plain = fp16_skips(lambda acc, loss, n: acc.backward(loss))
    weighted = fp16_skips(lambda acc, loss, n: acc.backward(loss, n_items=next(it)))
    assert weighted <= plain


@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_resume_mid_window_with_varying_counts_is_bitwise_equal(as_tensor):
    def run(stop_at=None, state=None):
        model = tiny_lm(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        acc = gradaccum.Accumulator(opt, 3)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            acc.load_state_dict(state["acc"])
        tokens, targets = padded(24, 6, seed=9)
        for i, (tb, yb) in enumerate(zip(tokens.split(2), targets.split(2), strict=True)):
            if state is not None and i < state["i"]:
                continue
            if i == stop_at:
                return {"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict(),
                        "i": i}
            n = gradaccum.count_tokens(yb)
            acc.backward(lm_loss(model, tb, yb), n if as_tensor else int(n))
        return [p.detach().clone() for p in model.parameters()]

    whole = run()
    resumed = run(state=run(stop_at=7))  # window 3, micro-step 1
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
