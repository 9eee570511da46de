"""The hot path at the hand loop's cost, in aten ops (each a kernel launch on a GPU): counted,
so the numbers are the same on every machine (time is the benchmark's, never a test's)."""

import pytest
import torch

import gradaccum
from gradaccum.bench.hot_path import LOOPS, STEPS, OpCounter, make_loops, ops_per_micro_step


@pytest.fixture(scope="module")
def ops():
    return {name: ops_per_micro_step(run) for name, run in make_loops().items()}


def test_the_benchmark_has_the_five_loops(ops):
    assert list(ops) == list(LOOPS)


def test_a_tensor_count_costs_at_most_four_ops_per_micro_step_over_the_hand_token_loop(ops):
    assert ops["gradaccum tensor"] <= ops["hand tokens"] + 4


def test_the_mean_path_costs_at_most_one_op_per_micro_step_over_the_hand_loop(ops):
    assert ops["gradaccum mean"] <= ops["hand mean"] + 1


def test_an_int_count_costs_no_more_than_the_hand_token_loop(ops):
    assert ops["gradaccum int"] <= ops["hand tokens"]


def test_the_counter_counts_what_runs():
    # Negative twin: an extra multiplication per micro-step shows as one more op (two with its
    # backward), so a regression of the hot path cannot pass unseen.
    loops = make_loops()
    base = ops_per_micro_step(loops["gradaccum mean"])
    model = torch.nn.Linear(4, 3)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), STEPS)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def padded() -> None:
        for _ in range(STEPS):
            acc.backward(torch.nn.functional.cross_entropy(model(x), y) * 1.0)
    assert ops_per_micro_step(padded) == base + 2


@pytest.mark.parametrize("count", ["tensor", "int"])
def test_no_value_is_read_back_to_the_host_on_a_micro_step(count):
    # _local_scalar_dense is .item()/float()/bool() on a tensor: a device sync on a GPU. A CPU
    # count is checked through tolist(), which launches nothing.
    seen = []

    class Reads(OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_local_scalar_dense" in str(func):
                seen.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    run = make_loops()[f"gradaccum {count}"]
    run()
    with Reads():
        run()
        run()
    assert seen == []
