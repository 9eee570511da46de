"""backward_cached on a CUDA device: the device's RNG replayed (dropout masks drawn on the GPU),
autocast with a GradScaler, and the peak memory of one chunk's graph. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum.torch.cached import replay as _replay
from tests.contrastive import Towers, clip_loss, full_batch_grads, largest_difference, pairs, step_pre_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
N = 48


def cuda_pairs(n, dtype=torch.float64):
    return tuple(t.cuda() for t in pairs(n, dtype=dtype))


def cached_grads(model, batch):
    """The gradient the optimizer sees after one backward_cached window of one call."""
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.0), 1, model=model)
    seen = step_pre_grads(acc, model)
    acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale), batch)
    return seen[0]


def test_cuda_dropout_is_replayed_and_the_device_rng_ends_where_one_forward_leaves_it():
    model = Towers(dropout=0.4).cuda()
    batch = gradaccum.chunks(cuda_pairs(N), 10)
    torch.manual_seed(5)
    got = cached_grads(copy.deepcopy(model), batch)
    after = torch.rand(3, device="cuda")
    torch.manual_seed(5)
    ref = copy.deepcopy(model)
    want = full_batch_grads(ref, [batch], lambda i, t: clip_loss(i, t, ref.logit_scale))
    assert largest_difference(got, want) < 1e-12
    assert torch.equal(torch.rand(3, device="cuda"), after)


def test_without_the_device_states_the_masks_differ(monkeypatch):
    # The negative twin: capture the CPU generator only, as a CPU-only replay would.
    monkeypatch.setattr(_replay.torch.cuda, "is_initialized", lambda: False)
    model = Towers(dropout=0.4).cuda()
    batch = gradaccum.chunks(cuda_pairs(N), 10)
    torch.manual_seed(5)
    got = cached_grads(copy.deepcopy(model), batch)
    monkeypatch.undo()
    torch.manual_seed(5)
    ref = copy.deepcopy(model)
    want = full_batch_grads(ref, [batch], lambda i, t: clip_loss(i, t, ref.logit_scale))
    assert largest_difference(got, want) > 1e-3


def test_fp16_autocast_with_a_gradscaler_on_cuda_skips_an_overflow_and_steps_otherwise():
    model = Towers(dtype=torch.float32).cuda()
    batch = gradaccum.chunks(cuda_pairs(N, torch.float32), 10)
    for scale, stepped in ((2.0 ** 40, False), (2.0 ** 8, True)):
        trained = copy.deepcopy(model)
        scaler = torch.amp.GradScaler("cuda", init_scale=scale)
        acc = gradaccum.Accumulator(torch.optim.SGD(trained.parameters(), lr=0.1), 1, model=trained,
                                    scaler=scaler)
        with torch.autocast("cuda", dtype=torch.float16):
            acc.backward_cached(lambda c, m=trained: m(*c),
                                lambda i, t, m=trained: clip_loss(i, t, m.logit_scale), batch)
        assert acc.optimizer_steps == int(stepped) and acc.skipped_windows == int(not stepped)
        moved = largest_difference(dict(trained.named_parameters()), dict(model.named_parameters()))
        assert (moved > 0) == stepped


def test_peak_memory_holds_one_chunks_activations():
    torch.manual_seed(0)
    layers = [nn.Linear(256, 4096), nn.GELU()]
    for _ in range(6):
        layers += [nn.Linear(4096, 4096), nn.GELU()]
    enc = nn.Sequential(*layers, nn.Linear(4096, 128)).cuda()
    x = torch.randn(4096, 256, device="cuda")
    grad_bytes = sum(p.numel() * p.element_size() for p in enc.parameters())

    def loss_fn(z):
        return nn.functional.cross_entropy(z @ z.T, torch.arange(len(z), device=z.device))

    def peak(fn):
        enc.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base - grad_bytes  # both arms allocate the grads

    acc = gradaccum.Accumulator(torch.optim.SGD(enc.parameters(), lr=0.0), 1, model=enc)
    full = peak(lambda: loss_fn(enc(x)).backward())
    cached = peak(lambda: acc.backward_cached(enc, loss_fn, gradaccum.chunks(x, 512)))
    print(f"peak beyond parameters and gradients: full batch {full / 2**20:.0f} MiB, "
          f"backward_cached (8 chunks) {cached / 2**20:.0f} MiB")
    assert cached < full / 2
