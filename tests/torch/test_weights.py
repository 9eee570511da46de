"""Micro-batch weights as backward seeds: precision per format, and the route for devices
without float64 (Apple's MPS), played on the CPU by declaring it float64-less."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradaccum
from gradaccum.torch import _weights
from tests.reference import clone_model, data, mlp


class NoFloat64(TorchDispatchMode):
    """Fail on any op that makes a float64 tensor: what a float64-less device would refuse."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                raise AssertionError(f"{func} made a float64 tensor")
        return out


def train(model, counts, scaler=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(opt, 3, scaler=scaler)
    x, y = data(sum(counts), torch.float32)
    start = 0
    for n in counts:
        xb, yb = x[start:start + n], y[start:start + n]
        start += n
        acc.backward(nn.functional.cross_entropy(model(xb), yb), torch.tensor(n))
    return acc


def reference(model, counts):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data(sum(counts), torch.float32)
    for w in range(0, len(counts), 3):
        lo, hi = sum(counts[:w]), sum(counts[:w + 3])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()


@pytest.mark.parametrize("scaled", [False, True])
def test_a_device_without_float64_sums_counts_in_int64_and_stays_exact(monkeypatch, scaled):
    monkeypatch.setattr(_weights, "NO_FLOAT64", frozenset({"cpu"}))
    counts = [3, 5, 2, 4, 4, 1]
    model = mlp(torch.float32)
    ref = clone_model(model)
    if scaled:  # GradScaler itself computes 1/scale in float64 (torch's choice): check our record
        acc = train(model, counts[:2], torch.amp.GradScaler("cpu", init_scale=2.0**10))
        assert acc._window.items.dtype == torch.int64 and acc._window.scale.dtype == torch.float32
        acc = train(model := clone_model(ref), counts, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    else:
        with NoFloat64():
            acc = train(model, counts)
    assert acc.optimizer_steps == 2
    reference(ref, counts)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_the_float64_route_is_used_where_float64_exists():
    # Negative twin of the test above: on an ordinary CPU the total is a float64 tensor.
    with pytest.raises(AssertionError, match="float64"), NoFloat64():
        train(mlp(torch.float32), [3, 5, 2])


@pytest.mark.parametrize("dtype, exact_below", [(torch.float32, 2**24), (torch.float16, 2**11),
                                                (torch.bfloat16, 2**8)])
def test_a_seed_n_over_a_power_of_two_is_exact_while_n_fits_the_significand(dtype, exact_below):
    loss = torch.tensor(1.0, dtype=dtype)
    scale = _weights.exact_total(torch.tensor(exact_below), 1)
    for n in (exact_below - 1, exact_below + 1):
        seed = _weights.loss_seed(loss, torch.tensor(n), scale, 1, False)
        fed = seed.to(loss.dtype)  # what autograd's engine backwards from (it casts the seed)
        exact = float(fed) * float(scale) == n
        assert exact == (n < exact_below), (dtype, n)


def test_a_seed_is_a_new_tensor_each_time():
    # A cached seed could become a leaf's .grad and change in place under the next micro-step.
    loss = torch.tensor(2.0)
    a, b = (_weights.loss_seed(loss, None, None, 4, False) for _ in range(2))
    assert a is not b and a.data_ptr() != b.data_ptr()
    n = torch.tensor(3.0)
    assert _weights.loss_seed(loss, n, None, 4, False).data_ptr() != n.data_ptr()
