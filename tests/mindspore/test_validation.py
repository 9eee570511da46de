"""Bad input: an error naming the argument and its value, before any state changes; inside a
graph, when the graph compiles (and the graph stays usable afterwards)."""

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import mindspore
import numpy as np
from mindspore import Tensor, nn

from gradaccum import Schedule
from gradaccum.mindspore import Accumulator
from tests.mindspore_reference import data, grad_fn, net


def sgd(model=None):
    return nn.SGD((model or net()).trainable_params(), 0.1)


@pytest.mark.parametrize("steps", [0, -1, 2.5, "2", True, None])
def test_bad_steps(steps):
    with pytest.raises((TypeError, ValueError), match="steps") as info:
        Accumulator(sgd(), steps)
    assert repr(steps) in str(info.value)


def test_callable_schedule_counted_in_optimizer_steps_is_refused():
    with pytest.raises(TypeError, match=r"steps=.*compiled graph"):
        Accumulator(sgd(), lambda k: 2)
    Accumulator(sgd(), Schedule(lambda e: 2, by="epoch"))  # read on the host by set_epoch


@pytest.mark.parametrize("clip_norm", [0, -1.0, float("nan"), "1", True])
def test_bad_clip_norm(clip_norm):
    with pytest.raises((TypeError, ValueError), match="clip_norm"):
        Accumulator(sgd(), 2, clip_norm=clip_norm)


def test_bad_optimizer_and_weighting():
    model = net()
    with pytest.raises(TypeError, match=r"optimizer must be a mindspore\.nn\.Optimizer, got list"):
        Accumulator(model.trainable_params(), 2)
    with pytest.raises(ValueError, match="weighting must be 'mean' or 'items', got 'tokens'"):
        Accumulator(sgd(model), 2, weighting="tokens")


def unchanged(acc, model, before):
    assert acc.micro_step == 1
    assert all(np.array_equal(b.asnumpy(), g) for b, g in zip(acc._grads, before, strict=True))
    assert not all(np.array_equal(b.asnumpy(), 0) for b in acc._grads)


@pytest.mark.parametrize(("n_items", "error", "message"), [
    (0, ValueError, "n_items must be >= 1, got 0"),
    (2.5, TypeError, "n_items must be an integer count, got 2.5"),
    (True, TypeError, "n_items must be an integer count, got True"),
    ("4", TypeError, "n_items must be an int or an integer Tensor"),
    (Tensor(4.0, mindspore.float32), TypeError, "n_items must be an integer count, got a Float32"),
    (Tensor(np.array([2, 2], np.int32)), ValueError, r"n_items must be a scalar, got .*\(2,\)"),
    (None, ValueError, "n_items=None: this Accumulator has weighting='items'"),
])
def test_bad_n_items_changes_nothing(n_items, error, message):
    model = net()
    x, y = data(8)
    acc = Accumulator(sgd(model), 2, weighting="items")
    fn = grad_fn(model)
    acc(fn(x[:4], y[:4])[1], 4)
    before = [b.asnumpy().copy() for b in acc._grads]
    with pytest.raises(error, match=message):
        acc(fn(x[4:], y[4:])[1], n_items)
    unchanged(acc, model, before)


def test_n_items_on_a_mean_accumulator_is_refused():
    model = net()
    x, y = data(4)
    acc = Accumulator(sgd(model), 2)
    with pytest.raises(ValueError, match="n_items was given to an Accumulator with weighting='mean'"):
        acc(grad_fn(model)(x, y)[1], 4)
    assert acc.micro_step == 0


def test_wrong_number_of_gradients_is_refused():
    model = net()
    x, y = data(4)
    acc = Accumulator(sgd(model), 2)
    with pytest.raises(ValueError, match="grads holds 3 tensors for the optimizer's 4 parameters"):
        acc(grad_fn(model)(x, y)[1][:3])


def test_in_a_graph_bad_input_fails_the_compile_and_the_graph_still_works():
    model = net()
    x, y = data(12)
    acc = Accumulator(sgd(model), 2, weighting="items")
    fn = grad_fn(model)

    @mindspore.jit
    def train_step(xb, yb, n):
        return acc(fn(xb, yb)[1], n)

    train_step(x[:4], y[:4], Tensor(4, mindspore.int32))
    before = [b.asnumpy().copy() for b in acc._grads]
    with pytest.raises(TypeError, match="n_items must be an integer count, got a Float32"):
        train_step(x[4:8], y[4:8], Tensor(4.0, mindspore.float32))
    unchanged(acc, model, before)
    assert bool(train_step(x[4:8], y[4:8], Tensor(4, mindspore.int32)))
    assert acc.optimizer_steps == 1


@pytest.mark.parametrize("epoch", [-1, 1.5, None])
def test_bad_epoch(epoch):
    acc = Accumulator(sgd(), Schedule({0: 2, 1: 4}, by="epoch"))
    with pytest.raises((TypeError, ValueError), match="epoch"):
        acc.set_epoch(epoch)


def test_data_parallel_needs_init_and_a_bool():
    acc = Accumulator(sgd(), 2)
    assert acc.world_size == 1  # no mindspore.communication.init(): one process, no reduction
    assert Accumulator(sgd(), 2, data_parallel=False).world_size == 1
    with pytest.raises(ValueError, match=r"data_parallel=True needs mindspore\.communication\.init\(\)"):
        Accumulator(sgd(), 2, data_parallel=True)
    with pytest.raises(TypeError, match="data_parallel must be None, True or False, got 'yes'"):
        Accumulator(sgd(), 2, data_parallel="yes")


def test_average_batchnorm_needs_a_cell_with_batchnorm_statistics():
    with pytest.raises(TypeError, match=r"average_batchnorm must be a mindspore\.nn\.Cell, got list"):
        Accumulator(sgd(), 2, average_batchnorm=[])
    with pytest.raises(ValueError, match="average_batchnorm=SequentialCell: the model has no BatchNorm"):
        Accumulator(sgd(), 2, average_batchnorm=net())
    model = nn.SequentialCell(nn.Dense(3, 4), nn.BatchNorm1d(4))
    acc = Accumulator(sgd(model), 2, average_batchnorm=model)
    assert acc.world_size == 1  # one process: nothing to average, accepted
