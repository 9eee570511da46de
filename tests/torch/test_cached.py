"""Accumulator.backward_cached against the full batch: one forward and backward of every chunk's
graph at once (float64, 1e-12), and the window it joins (weighting, clipping, scheduler, scaler,
checkpoints, discard, flush), replayed randomness, BatchNorm, memory (bad input and failures:
test_cached_failures.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import gradaccum
from tests.contrastive import (
    D_EMB,
    Towers,
    clip_loss,
    full_batch_grads,
    largest_difference,
    pairs,
    step_pre_grads,
    supcon_loss,
)

N = 24


def clip_of(model):
    """The CLIP loss with ``model``'s learnable temperature."""
    return lambda i, t: clip_loss(i, t, model.logit_scale)


def whole(chunks):
    """The batch the chunks came from."""
    return tuple(torch.cat(z) for z in zip(*chunks, strict=True))


def run_cached(model, batches, *, steps=None, n_items=None, reduction="mean", acc=None, **options):
    """Feed each batch (a list of chunks) to one backward_cached call of a copy of ``model``;
    return the grads the optimizer saw at each step, and the accumulator (``acc.model``: the copy)."""
    model = copy.deepcopy(model)
    if acc is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = gradaccum.Accumulator(opt, len(batches) if steps is None else steps, model=model, **options)
    seen = step_pre_grads(acc, model)
    loss = (lambda i, t: clip_loss(i, t, model.logit_scale)) if reduction == "mean" else (
        lambda i, t: clip_loss(i, t, model.logit_scale) * len(i))
    for k, chunks in enumerate(batches):
        acc.backward_cached(lambda c: model(*c), loss, chunks,
                            None if n_items is None else n_items[k], reduction=reduction)
    return seen, acc


def reference(model, batches, weights=None):
    ref = copy.deepcopy(model)
    return full_batch_grads(ref, batches, lambda i, t: clip_loss(i, t, ref.logit_scale), weights)


@pytest.mark.parametrize("size", [N, 8, 10, 5, 1], ids=lambda s: f"chunks-of-{s}")
def test_the_gradient_is_the_full_batch_gradient_temperature_included(size):
    model = Towers()
    batch = gradaccum.chunks(pairs(N), size)  # 10: uneven chunks (10, 10, 4)
    seen, acc = run_cached(model, [batch])
    want = reference(model, [batch])
    assert largest_difference(seen[0], want) < 1e-12
    assert float(want["logit_scale"].abs()) > 1e-2  # the temperature's gradient is not trivially 0
    assert acc.optimizer_steps == 1 and acc.micro_step == 0


def test_naive_accumulation_of_chunk_losses_is_far_off():
    model = Towers()
    batch = gradaccum.chunks(pairs(N), 8)
    want = reference(model, [batch])
    naive = copy.deepcopy(model)
    acc = gradaccum.Accumulator(torch.optim.SGD(naive.parameters(), lr=0.1), len(batch))
    seen = step_pre_grads(acc, naive)
    for c in batch:
        acc.backward(clip_loss(*naive(*c), naive.logit_scale))
    scale = max(float(g.abs().max()) for g in want.values())
    assert largest_difference(seen[0], want) > 0.05 * scale  # fewer negatives: another objective


def test_steps_one_steps_on_every_call_and_window_loss_is_the_batch_loss():
    model = Towers()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, model=model)
    x, t = pairs(N)
    stepped = []
    for seed in (1, 2, 3):
        x, t = pairs(N, seed=seed)
        with torch.no_grad():
            want = clip_loss(*model(x, t), model.logit_scale)
        stepped.append(acc.backward_cached(lambda c: model(*c), clip_of(model), gradaccum.chunks((x, t), 7)))
        torch.testing.assert_close(acc.window_loss, want, atol=1e-12, rtol=0)
    assert stepped == [True, True, True] and acc.optimizer_steps == 3


def test_a_window_of_two_coupled_batches_is_the_mean_of_their_losses():
    model = Towers()
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2)]
    seen, _ = run_cached(model, batches)
    assert len(seen) == 1
    assert largest_difference(seen[0], reference(model, batches)) < 1e-12
    # The negative twin: one batch of 48 is another objective (more negatives).
    merged = [gradaccum.chunks(tuple(torch.cat(z) for z in zip(pairs(N, seed=1), pairs(N, seed=2),
                                                                 strict=True)), 10)]
    assert largest_difference(seen[0], reference(model, merged)) > 1e-3


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_n_items_weighs_coupled_batches_as_backward_does(reduction):
    model = Towers()
    sizes = (N, 12)
    batches = [gradaccum.chunks(pairs(n, seed=n), 5) for n in sizes]
    seen, acc = run_cached(model, batches, n_items=list(sizes), reduction=reduction)
    want = reference(model, batches, weights=[n / sum(sizes) for n in sizes])
    assert largest_difference(seen[0], want) < 1e-12
    with torch.no_grad():
        losses = [clip_loss(*model(*whole(b)), model.logit_scale) for b in batches]
    want = sum(n * loss for n, loss in zip(sizes, losses, strict=True)) / sum(sizes)
    torch.testing.assert_close(acc.window_loss, want, atol=1e-12, rtol=0)


def test_a_cached_batch_and_a_plain_micro_batch_share_a_window():
    base = Towers()
    model = copy.deepcopy(base)
    batch = gradaccum.chunks(pairs(N), 10)
    x, t = pairs(6, seed=9)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    seen = step_pre_grads(acc, model)
    acc.backward(clip_loss(*model(x, t), model.logit_scale))
    acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale), batch)
    assert largest_difference(seen[0], reference(base, [[(x, t)], batch])) < 1e-12


def test_dropout_is_replayed_and_matches_every_graph_alive_with_the_rng_where_it_would_be():
    model = Towers(dropout=0.4)
    batch = gradaccum.chunks(pairs(N), 7)
    torch.manual_seed(123)
    seen, _ = run_cached(model, [batch])
    after = torch.rand(4)
    torch.manual_seed(123)
    want = reference(model, [batch])  # every chunk's forward in order, one backward
    assert largest_difference(seen[0], want) < 1e-12
    assert torch.equal(torch.rand(4), after)  # the RNG stands where one forward of the batch leaves it
    # The negative twin: without the replay, the second pass draws other masks.
    torch.manual_seed(124)
    other = reference(model, [batch])
    assert largest_difference(other, want) > 1e-3


def test_batchnorm_statistics_are_updated_once_per_chunk():
    model = Towers(batchnorm=True)
    batch = gradaccum.chunks(pairs(N), 10)
    seen, acc = run_cached(model, [batch])
    ref = copy.deepcopy(model)
    want = full_batch_grads(ref, [batch], lambda i, t: clip_loss(i, t, ref.logit_scale))
    assert largest_difference(seen[0], want) < 1e-12
    bn, ref_bn = acc.model.image[1], ref.image[1]
    assert int(bn.num_batches_tracked) == len(batch) == 3
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(bn, name), getattr(ref_bn, name), atol=1e-12, rtol=0)


def test_batchnorm_outside_model_warns_once_and_inside_it_does_not():
    model = Towers(batchnorm=True)
    batch = gradaccum.chunks(pairs(N), 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cached(model, [batch])
    assert not caught
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)  # no model=
    with pytest.warns(UserWarning, match="BatchNorm in training mode") as caught:
        for _ in range(2):
            acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale), batch)
    assert len([w for w in caught if "BatchNorm" in str(w.message)]) == 1


def test_parameters_used_only_in_loss_fn_are_counted_once():
    model = Towers()
    head = nn.Linear(D_EMB, D_EMB).double()  # a projection applied inside the loss
    batch = gradaccum.chunks(pairs(N), 6)
    cached, cached_head = copy.deepcopy(model), copy.deepcopy(head)
    opt = torch.optim.SGD([*cached.parameters(), *cached_head.parameters()], lr=0.1)
    acc = gradaccum.Accumulator(opt, 1, model=cached)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in cached.parameters()]
                                                      + [p.grad.clone() for p in cached_head.parameters()]))
    acc.backward_cached(lambda c: cached(*c), lambda i, t: clip_loss(cached_head(i), t, cached.logit_scale),
                        batch)
    i, t = model(*whole(batch))
    clip_loss(head(i), t, model.logit_scale).backward()
    want = [p.grad for p in [*model.parameters(), *head.parameters()]]
    assert max(float((a - b).abs().max()) for a, b in zip(seen[0], want, strict=True)) < 1e-12
    assert float(head.weight.grad.abs().max()) > 1e-3


def test_labels_pass_through_without_grad_for_supcon():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(N, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (N,))
    ref = copy.deepcopy(enc)
    acc = gradaccum.Accumulator(torch.optim.SGD(enc.parameters(), lr=0.1), 1, model=enc)
    seen: list = []
    acc.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in enc.parameters()]))
    got_labels = []

    def loss_fn(z, labels):
        got_labels.append(labels)
        return supcon_loss(z, labels)

    acc.backward_cached(lambda c: (enc(c[0]), c[1]), loss_fn, gradaccum.chunks((x, y), 5))
    assert torch.equal(got_labels[0], y) and not got_labels[0].requires_grad
    supcon_loss(ref(x), y).backward()
    want = [p.grad for p in ref.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(seen[0], want, strict=True)) < 1e-12


def test_clipping_and_the_scheduler_act_once_per_window():
    model = Towers()
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2, 3, 4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))
    acc = gradaccum.Accumulator(opt, 2, model=model, clip_norm=0.05, scheduler=sched)
    for chunks in batches:
        acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale), chunks)
    assert acc.optimizer_steps == 2 and sched.last_epoch == 2
    ref = Towers()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: 1 / (1 + k))
    norms = []
    for window in (batches[:2], batches[2:]):
        full_batch_grads(ref, window, lambda i, t: clip_loss(i, t, ref.logit_scale))
        norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        ref_sched.step()
    assert min(norms) > 0.05  # clipping acted
    assert largest_difference(dict(model.named_parameters()), dict(ref.named_parameters())) < 1e-12


def test_state_dict_mid_window_resumes_bitwise_in_a_fresh_accumulator():
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2)]

    def fresh(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return gradaccum.Accumulator(opt, 2, model=model)

    def feed(acc, model, chunks):
        acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale), chunks)

    straight = Towers()
    acc = fresh(straight)
    for chunks in batches:
        feed(acc, straight, chunks)
    first = Towers()
    acc1 = fresh(first)
    feed(acc1, first, batches[0])
    state = acc1.state_dict()
    resumed = copy.deepcopy(first)
    acc2 = fresh(resumed)
    acc2.load_state_dict(state)
    assert acc2.micro_step == 1
    feed(acc2, resumed, batches[1])
    assert acc2.optimizer_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters(), strict=True))


def test_discard_and_flush_act_on_cached_batches_as_on_micro_batches():
    base = Towers()
    model = copy.deepcopy(base)
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2, 3)]
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, model=model)
    seen = step_pre_grads(acc, model)
    loss = lambda i, t: clip_loss(i, t, model.logit_scale)  # noqa: E731
    acc.backward_cached(lambda c: model(*c), loss, batches[0])
    acc.discard()
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    for chunks in batches[1:]:
        acc.backward_cached(lambda c: model(*c), loss, chunks)
    assert acc.flush() and len(seen) == 1
    assert largest_difference(seen[0], reference(base, batches[1:])) < 1e-12


def test_a_gradscaler_scales_the_representation_gradient_once():
    model = Towers()
    batch = gradaccum.chunks(pairs(N), 10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    seen, acc = run_cached(model, [batch], scaler=scaler)
    assert acc.optimizer_steps == 1
    assert largest_difference(seen[0], reference(model, [batch])) < 1e-12  # unscaled once: exact


def fp16_run(model, batch, scaler):
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, model=model, scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        acc.backward_cached(lambda c: model(*c), clip_of(model), batch)
    return acc


def test_an_fp16_overflow_under_cpu_autocast_skips_the_window():
    model = Towers(dtype=torch.float32)
    before = copy.deepcopy(model)
    batch = gradaccum.chunks(pairs(N, dtype=torch.float32), 10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # the fp16 representation gradient overflows
    acc = fp16_run(model, batch, scaler)
    assert acc.skipped_windows == 1 and acc.optimizer_steps == 0
    assert scaler.get_scale() == 2.0 ** 39
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    # At a representable scale the same call steps, close to float32's full batch.
    ok = fp16_run(model, batch, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    assert ok.optimizer_steps == 1
    ref = copy.deepcopy(before)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    full_batch_grads(ref, [batch], lambda i, t: clip_loss(i, t, ref.logit_scale))
    opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=2e-3, rtol=2e-3)


def test_accum_dtype_folds_a_cached_batch_into_float32_buffers():
    model = Towers(dtype=torch.bfloat16)
    batch = gradaccum.chunks(pairs(N, dtype=torch.bfloat16), 10)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model,
                                accum_dtype=torch.float32)
    loss = lambda i, t: clip_loss(i.float(), t.float(), model.logit_scale.float())  # noqa: E731
    acc.backward_cached(lambda c: model(*c), loss, batch)
    assert all(p.grad is None for p in model.parameters())  # folded into the buffers
    assert acc._precision.buffers.filled() == [True] * len(list(model.parameters()))


class LiveSaved:
    """Bytes of activations autograd holds for backward (parameters' own storage not counted)."""

    def __init__(self, params):
        self.ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.now = self.peak = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() in self.ptrs:
            return t
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held if isinstance(held, torch.Tensor) else held.t


class _Held:
    def __init__(self, t, live):
        self.t, self.live, self.n = t, live, t.numel() * t.element_size()
        live.now += self.n
        live.peak = max(live.peak, live.now)

    def __del__(self):
        self.live.now -= self.n


def in_batch_negatives(z):
    return nn.functional.cross_entropy(z @ z.T, torch.arange(len(z)))


def test_at_most_one_chunks_graph_is_alive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 512), nn.Tanh(), nn.Linear(512, 4)).double()  # the encoder dominates
    batch = gradaccum.chunks(torch.randn(64, 5, dtype=torch.float64), 16)
    params = list(model.parameters())
    cached = LiveSaved(params)
    acc = gradaccum.Accumulator(torch.optim.SGD(params, lr=0.0), 1, model=model)
    with torch.autograd.graph.saved_tensors_hooks(cached.pack, cached.unpack):
        acc.backward_cached(model, in_batch_negatives, batch)
    one_chunk, loss_only, alive = LiveSaved(params), LiveSaved(params), LiveSaved(params)
    with torch.autograd.graph.saved_tensors_hooks(one_chunk.pack, one_chunk.unpack):
        out = model(batch[0])
    reps = torch.cat([model(c) for c in batch]).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(loss_only.pack, loss_only.unpack):
        loss = in_batch_negatives(reps)
    with torch.autograd.graph.saved_tensors_hooks(alive.pack, alive.unpack):
        every = in_batch_negatives(torch.cat([model(c) for c in batch]))
    assert cached.now == 0  # every graph freed
    assert cached.peak == max(one_chunk.peak, loss_only.peak) == one_chunk.peak
    assert alive.peak > 3 * cached.peak  # all 4 chunks' activations at once
    del out, loss, every



def test_a_later_call_of_the_window_holds_no_second_set_of_gradients():
    # Parameters dominate: eight equal layers, eight rows. The window's first call makes its
    # gradients; the second adds into them in place (0.3.0 set them aside and built a second set,
    # a peak of at least the parameters' bytes). Tensor memory from the profiler's events.
    from gradaccum.torch.memory.probe import cpu_allocations

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)]).double()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.0), 3, model=model)
    batch = gradaccum.chunks(torch.randn(8, 128, dtype=torch.float64), 4)
    call = lambda: acc.backward_cached(model, in_batch_negatives, batch)  # noqa: E731
    _, _, first_end = cpu_allocations(call)
    _, second_peak, second_end = cpu_allocations(call)
    assert first_end >= param_bytes  # the window's gradients
    assert second_end < 1024 and second_peak < param_bytes / 3  # a layer's gradient at a time


@pytest.mark.parametrize("frozen", [("text",), ("image",), ("image", "text")], ids="+".join)
def test_a_frozen_tower_passes_no_gradient_back_as_in_the_full_batch(frozen):
    model = Towers()
    for name in frozen:
        getattr(model, name).requires_grad_(False)
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2)]
    seen, _ = run_cached(model, batches)
    want = reference(model, batches)
    assert all(want[name] is None for name in want if name.startswith(frozen))  # autograd's answer
    assert largest_difference(seen[0], want) < 1e-12
    assert float(want["logit_scale"].abs()) > 1e-2


def test_chunks_of_texts_are_counted_by_no_one_and_their_rows_not_checked():
    # gradaccum cannot read a list of texts' examples (gradaccum.batch_size counts tensors): the
    # rows of encode's output are then not checked against it (docs/CONTRASTIVE.md, Failures).
    torch.manual_seed(0)
    words = [f"w{i}" for i in range(10)]
    embed = nn.Embedding(len(words), 4).double()
    acc = gradaccum.Accumulator(torch.optim.SGD(embed.parameters(), lr=0.1), 1, model=embed)

    def encode(texts):
        return embed(torch.tensor([words.index(t) for t in texts]))

    texts = [words[i % 10] for i in range(0, 21, 3)]
    ref = copy.deepcopy(embed)
    seen = step_pre_grads(acc, embed)
    acc.backward_cached(encode, in_batch_negatives, [texts[:3], texts[3:]])
    in_batch_negatives(ref(torch.tensor([words.index(t) for t in texts]))).backward()
    assert float((seen[0]["weight"] - ref.weight.grad).abs().max()) < 1e-12
    assert acc.backward_cached(lambda t: encode(t)[:1], in_batch_negatives, [texts[:3], texts[3:]])


# ------------------------------------------------------------------ gradaccum.chunks
def test_chunks_splits_tensors_tuples_and_dicts_with_a_short_last_chunk():
    x, y = torch.arange(10), torch.arange(10) * 2
    assert [len(c) for c in gradaccum.chunks(x, 4)] == [4, 4, 2]
    assert [c[1].tolist() for c in gradaccum.chunks((x, y), 6)] == [[0, 2, 4, 6, 8, 10], [12, 14, 16, 18]]
    assert [c["y"].tolist() for c in gradaccum.chunks({"x": x, "y": y}, 5)] == [[0, 2, 4, 6, 8],
                                                                               [10, 12, 14, 16, 18]]
    assert gradaccum.chunks(torch.zeros(0, 3), 2) == []
    assert len(gradaccum.chunks(x, 10)) == len(gradaccum.chunks(x, 99)) == 1


@pytest.mark.parametrize("size, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_chunks_refuses_a_bad_size(size, error):
    with pytest.raises(error, match="size"):
        gradaccum.chunks(torch.zeros(4), size)


def test_chunks_refuses_tensors_of_different_lengths():
    with pytest.raises(ValueError, match="disagree"):
        gradaccum.chunks((torch.zeros(4), torch.zeros(5)), 2)


# ------------------------------------------------------------------ frozen towers (issue 41, item 6)
@pytest.mark.parametrize("steps", [1, 2])
def test_frozen_towers_beside_a_trainable_parameter_no_loss_reaches_train_as_the_full_batch(steps):
    """Only the temperature trains through the loss; one more trainable parameter is used by no
    loss. A full batch gives it no gradient, and so does backward_cached (it was refused)."""
    model = Towers()
    model.image.requires_grad_(False)
    model.text.requires_grad_(False)
    model.unused = nn.Parameter(torch.ones(3, dtype=torch.float64))
    batches = [list(zip(*(z.split(4) for z in pairs(12, seed=s)), strict=True)) for s in range(steps)]
    want = reference(model, batches)
    seen, acc = run_cached(model, batches, steps=steps)
    assert acc.optimizer_steps == 1
    assert seen[0]["unused"] is None and seen[0]["image.0.weight"] is None
    assert float(want["logit_scale"].abs()) > 1e-3
    assert largest_difference(seen[0], want) < 1e-12


def test_an_encode_that_detaches_beside_a_parameter_no_loss_reaches_is_still_refused():
    model = Towers()
    model.unused = nn.Parameter(torch.ones(3, dtype=torch.float64))
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, model=model)
    chunks = list(zip(*(z.split(4) for z in pairs(12)), strict=True))
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"encode reads 8 trainable parameter\(s\).*detached"):
        acc.backward_cached(lambda c: tuple(z.detach() for z in model(*c)), clip_of(model), chunks)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
