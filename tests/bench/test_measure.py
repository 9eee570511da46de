"""The benchmark's instruments: allocator peaks from profiler events, the seed's buffers, timing."""

import torch

from gradaccum.bench.measure import allocator_memory, floor_bytes, interleaved
from gradaccum.bench.seed import SeedAccumulator

CPU = torch.device("cpu")
MIB = 2**20


def test_allocator_peak_is_the_most_held_at_once_and_end_what_is_kept():
    def fn():
        big = torch.empty(MIB // 4)  # 1 MiB of float32
        small = torch.empty(MIB // 8)  # 0.5 MiB, held with big: the peak is 1.5 MiB
        del big
        return small

    kept, mem = allocator_memory(fn, CPU)
    assert mem.peak == MIB + MIB // 2
    assert mem.end == MIB // 2 == kept.numel() * 4


def test_allocations_before_the_measurement_do_not_count():
    before = torch.empty(MIB)  # 4 MiB, allocated before
    _, mem = allocator_memory(lambda: before.add_(1), CPU)  # in place: at most a scalar is new
    assert 0 <= mem.peak < 64 and mem.end == 0


def test_floor_counts_parameters_gradients_and_optimizer_state():
    model = torch.nn.Linear(10, 4)  # 44 float32 parameters
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    assert floor_bytes(model, opt) == 44 * 4 * 2 + state
    assert state >= 44 * 4 * 2  # exp_avg and exp_avg_sq


def test_seed_accumulator_steps_on_the_plain_sum_every_n():
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    acc = SeedAccumulator(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1), 2)
    xs = torch.randn(2, 4, 3)
    assert [acc.backward(model(x).pow(2).mean()) for x in xs] == [False, True]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sum(ref(x).pow(2).mean() for x in xs).backward()  # a sum, not a mean: no normalization
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert all(b.abs().sum() == 0 for b in acc.inner_grads)  # reset from the zeros buffer
    assert all(p.grad is None for p in model.parameters())


def test_interleaved_rotates_the_order_and_skips_the_warm_up_round():
    calls = []
    t = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                     "c": lambda: calls.append("c")}, repeats=3, calls=1)
    assert calls == list("abc" + "abc" + "bca" + "cab")
    assert all(len(v) == 3 for v in t.samples.values())
