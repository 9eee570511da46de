"""Data parallel on 2 CPU ranks under msrun: one all-reduce per window, the same update and window
loss as one process on the global batch.

All scenarios run in one msrun launch of tests/mindspore/dp_ranks.py (starting MindSpore ranks
costs a minute on two cores); each test below checks one behaviour of that run.
"""

from pathlib import Path

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import numpy as np
from mindspore import nn

from tests.mindspore_reference import LOSS, assert_params_close, data, full_batch_steps, grad_fn, net, params
from tests.mindspore_reference import params_differ as differ
from tests.ranks import load_ranks, run_msrun, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

# As in dp_ranks.py.
STEPS, WINDOWS, GLOBAL_MICRO, CLIP = 2, 3, 8, 0.5
ITEM_SIZES = ([5, 3], [1, 2])
FLUSH_STEPS = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("msrun")
    run_msrun([str(Path(__file__).with_name("dp_ranks.py")), str(out)], out)
    return load_ranks(out)


def window_losses(model, windows):
    """The full-batch loss of each window, taken before its step (what window_loss reports)."""
    losses = []
    opt = nn.Momentum(model.trainable_params(), 0.1, momentum=0.9)
    for x, y in windows:
        losses.append(float(LOSS(model(x), y).asnumpy()))
        full_batch_steps(model, opt, [(x, y)], CLIP)
    return losses


def test_parameters_equal_one_process_on_the_global_batch(ranks):
    x, y = data(WINDOWS * STEPS * GLOBAL_MICRO)
    size = STEPS * GLOBAL_MICRO
    windows = [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]
    reference = net()
    expected_losses = window_losses(reference, windows)
    for r in scenario(ranks, "mean"):
        assert r["world_size"] == 2
        assert r["stepped"] == [False, True] * WINDOWS
        assert_params_close(r["params"], params(reference))
        assert r["losses"] == pytest.approx(expected_losses, rel=1e-5)
    r0, r1 = scenario(ranks, "mean")
    assert all(np.array_equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    assert r0["norms"][0] > CLIP  # the clip bit, after the reduction (the norm is the global one)


def test_one_all_reduce_per_window_none_per_micro_batch(ranks):
    for r in scenario(ranks, "mean"):
        # One collective at each boundary, none off it: calls 1..6 with N = 2.
        assert r["counts"] == [i // STEPS for i in range(1, WINDOWS * STEPS + 1)]
        # flush() with nothing held anywhere: the ranks agree on the host, and no graph runs.
        assert (r["flushed"], r["count_after_flush"], r["optimizer_steps"]) == (False, WINDOWS, WINDOWS)


def test_item_counts_are_summed_over_ranks(ranks):
    x, y = data(sum(map(sum, ITEM_SIZES)))
    reference = net()
    expected_loss = float(LOSS(reference(x), y).asnumpy())
    full_batch_steps(reference, nn.SGD(reference.trainable_params(), 0.1), [(x, y)])
    for r in scenario(ranks, "items"):
        assert r["optimizer_steps"] == 1
        assert_params_close(r["params"], params(reference))
        assert r["window_loss"] == pytest.approx(expected_loss, rel=1e-5)
    # The negative twin: each rank normalized by its own items, then averaged over the ranks.
    twin = net()
    per_rank, start = [], 0
    for sizes in ITEM_SIZES:
        n = sum(sizes)
        per_rank.append(grad_fn(twin)(x[start:start + n], y[start:start + n])[1])
        start += n
    nn.SGD(twin.trainable_params(), 0.1)(tuple((a + b) / 2 for a, b in zip(*per_rank, strict=True)))
    assert differ(params(twin), params(reference))


def test_flush_of_equal_partial_windows_equals_one_process(ranks):
    local = GLOBAL_MICRO // 2
    x, y = data((FLUSH_STEPS + 1) * GLOBAL_MICRO)
    full = FLUSH_STEPS * GLOBAL_MICRO
    tail = slice(full, full + GLOBAL_MICRO)  # one micro-batch on each rank: one global micro-batch
    reference = net()
    opt = nn.SGD(reference.trainable_params(), 0.1)
    full_batch_steps(reference, opt, [(x[:full], y[:full])])
    expected_loss = float(LOSS(reference(x[tail]), y[tail]).asnumpy())
    full_batch_steps(reference, opt, [(x[tail], y[tail])])
    assert local * 2 == GLOBAL_MICRO
    for r in scenario(ranks, "flush"):
        assert (r["held"], r["flushed"], r["optimizer_steps"], r["count"]) == (1, True, 2, 2)
        assert_params_close(r["params"], params(reference))
        assert r["window_loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_flush_of_unequal_partial_windows_raises_on_every_rank_and_changes_nothing(ranks):
    for r in scenario(ranks, "unequal"):
        assert len(r["errors"]) == 2
        assert r["errors"][0].startswith("flush(): the ranks hold partial windows of different lengths "
                                         "(from 1 to 2 micro-batches); every rank must feed the same")
        assert "(from 0 to 1 micro-batches)" in r["errors"][1]
        assert r["unchanged"] == [True, True]
        assert (r["optimizer_steps"], r["flushed_after"]) == (0, False)  # discard() then agreed on 0


def test_average_batchnorm_leaves_the_ranks_with_the_mean_of_their_statistics(ranks):
    r0, r1 = scenario(ranks, "batchnorm")
    averaged = (r0["averaged"]["stats"], r1["averaged"]["stats"])
    plain = (r0["plain"]["stats"], r1["plain"]["stats"])
    assert all(np.array_equal(a, b) for a, b in zip(*averaged, strict=True))
    # The negative twin: without averaging, each rank keeps statistics of its own micro-batches.
    assert differ(*plain)
    # The running statistics are affine in the batch statistics, and the parameters are the same
    # in both runs (the gradients are reduced either way), so averaging at each boundary gives the
    # mean of the per-rank statistics.
    assert_params_close(averaged[0], [(a + b) / 2 for a, b in zip(*plain, strict=True)])
    assert_params_close(r0["averaged"]["params"], r0["plain"]["params"])
    assert all(np.array_equal(a, b) for a, b in zip(r0["averaged"]["params"], r1["averaged"]["params"],
                                                     strict=True))
