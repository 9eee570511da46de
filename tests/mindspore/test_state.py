"""Checkpoints: a resume in the middle of a window is bit-exact; foreign states are refused."""

import copy
import pickle

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import mindspore
import numpy as np
from mindspore import Tensor, nn

from gradaccum import Schedule
from gradaccum.mindspore import Accumulator
from tests.mindspore_reference import data, grad_fn, net, params

MICRO = 4


def build(model, steps=3, weighting="mean"):
    opt = nn.Momentum(model.trainable_params(), 0.1, momentum=0.9)
    return opt, Accumulator(opt, steps, weighting=weighting)


def feed(model, acc, x, y, weighting):
    fn = grad_fn(model)
    for i in range(0, len(x), MICRO):
        grads = fn(x[i:i + MICRO], y[i:i + MICRO])[1]
        acc(grads) if weighting == "mean" else acc(grads, Tensor(MICRO))


def copy_cell(src, dst):
    for name, p in src.parameters_and_names():
        dict(dst.parameters_and_names())[name].set_data(Tensor(p.asnumpy().copy()))


@pytest.mark.parametrize("weighting", ["mean", "items"])
def test_resume_mid_window_is_bit_exact(weighting):
    x, y = data(8 * MICRO)
    cut = 5 * MICRO  # one window of 3, then 2 of 3
    straight = net()
    _, acc = build(straight, weighting=weighting)
    feed(straight, acc, x, y, weighting)

    first = net()
    opt, acc1 = build(first, weighting=weighting)
    feed(first, acc1, x[:cut], y[:cut], weighting)
    assert (acc1.micro_step, acc1.optimizer_steps) == (2, 1)
    saved = pickle.loads(pickle.dumps({"acc": acc1.state_dict(), "net": params(first)}))

    resumed = net(seed=123)  # other weights: everything must come from the checkpoint
    opt2, acc2 = build(resumed, weighting=weighting)
    for p, value in zip(resumed.trainable_params(), saved["net"], strict=True):
        p.set_data(Tensor(value))
    copy_cell(opt, opt2)  # the optimizer's own state (momentum) is the user's to save
    acc2.load_state_dict(saved["acc"])
    assert (acc2.micro_step, acc2.optimizer_steps) == (2, 1)
    assert acc2.window == acc1.window
    feed(resumed, acc2, x[cut:], y[cut:], weighting)
    assert acc2.optimizer_steps == acc.optimizer_steps == 2
    assert all(np.array_equal(a, b) for a, b in zip(params(straight), params(resumed), strict=True))


def test_resume_without_the_partial_gradients_is_not_exact():
    # The negative twin: a checkpoint without the buffer (what a plain model checkpoint holds).
    x, y = data(6 * MICRO)
    straight = net()
    _, acc = build(straight)
    feed(straight, acc, x, y, "mean")
    first = net()
    opt, acc1 = build(first)
    feed(first, acc1, x[:4 * MICRO], y[:4 * MICRO], "mean")
    state = acc1.state_dict()
    state["grads"] = [np.zeros_like(g) for g in state["grads"]]
    resumed = net()
    opt2, acc2 = build(resumed)
    for p, value in zip(resumed.trainable_params(), params(first), strict=True):
        p.set_data(Tensor(value))
    copy_cell(opt, opt2)
    acc2.load_state_dict(state)
    feed(resumed, acc2, x[4 * MICRO:], y[4 * MICRO:], "mean")
    assert not all(np.array_equal(a, b) for a, b in zip(params(straight), params(resumed), strict=True))


def test_state_records_the_window_like_the_core():
    x, y = data(2 * MICRO)
    model = net()
    _, acc = build(model, steps=3, weighting="items")
    feed(model, acc, x, y, "items")
    state = acc.state_dict()
    assert state["window"] == {"size": 3, "micro_step": 2, "weighting": "items", "items": 2 * MICRO}
    assert state["steps"] == 3 and state["version"] == 1
    assert [g.shape for g in state["grads"]] == [tuple(p.shape) for p in model.trainable_params()]


def test_foreign_states_are_refused_before_anything_changes():
    x, y = data(MICRO)
    model = net()
    _, acc = build(model, steps=3)
    feed(model, acc, x, y, "mean")
    good = acc.state_dict()
    with pytest.raises(TypeError, match="state must be a dict"):
        acc.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="saved with steps=3, this accumulator has steps=2"):
        build(net(), steps=2)[1].load_state_dict(good)
    with pytest.raises(ValueError, match="weighting='mean', this accumulator has weighting='items'"):
        build(net(), steps=3, weighting="items")[1].load_state_dict(good)
    other = nn.SequentialCell(nn.Dense(6, 5), nn.Tanh(), nn.Dense(5, 3))
    fresh = Accumulator(nn.SGD(other.trainable_params(), 0.1), 3)
    with pytest.raises(ValueError, match="other parameters"):
        fresh.load_state_dict(good)
    assert fresh.micro_step == 0


def test_epoch_schedule_takes_effect_at_the_boundary():
    x, y = data(6 * MICRO)
    model = net()
    _, acc = build(model, steps=Schedule({0: 2, 1: 3}, by="epoch"))
    assert acc.steps == 2
    feed(model, acc, x[:MICRO], y[:MICRO], "mean")
    acc.set_epoch(1)  # a window is open: it keeps N = 2
    assert acc.steps == 2
    feed(model, acc, x[MICRO:2 * MICRO], y[MICRO:2 * MICRO], "mean")
    assert (acc.optimizer_steps, acc.steps) == (1, 3)
    acc.set_epoch(0)  # an empty window takes the new N at once
    assert acc.steps == 2


def stateful(weighting="items"):
    """An accumulator after one boundary and two micro-batches of the next window (losses given)."""
    x, y = data(5 * MICRO)
    model = net()
    _, acc = build(model, steps=3, weighting=weighting)
    fn = grad_fn(model)
    for i in range(5):
        loss, grads = fn(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO])
        acc(grads, loss=loss) if weighting == "mean" else acc(grads, MICRO + i, loss=loss)
    return acc


def snapshot(acc):
    return ([b.asnumpy().copy() for b in acc._grads], acc.window, acc.optimizer_steps, acc.epoch,
            acc.window_loss, acc.state_dict()["loss_sum"])


def assert_same(a, b):
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert a[1:] == b[1:]


def edit(**changes):
    """A corruption: ``window__micro_step=7`` sets state["window"]["micro_step"]; KeyError deletes."""
    def apply(state):
        for key, value in changes.items():
            *path, last = key.split("__")
            holder = state
            for part in path:
                holder = holder[part]
            if value is KeyError:
                del holder[last]
            else:
                holder[last] = value
    return apply


def bad_grad(i, value):
    def apply(state):
        state["grads"][i] = value
    return apply


CORRUPTED = [
    ("no optimizer_steps", edit(optimizer_steps=KeyError), ValueError,
     r"state\['optimizer_steps'\] is missing"),
    ("no epoch", edit(epoch=KeyError), ValueError, r"state\['epoch'\] is missing"),
    ("micro_step 7 of 3", edit(window__micro_step=7), ValueError, r"\['micro_step'\] must be in \[0, 3\)"),
    ("micro_step -1", edit(window__micro_step=-1), ValueError, r"\['micro_step'\] must be a non-negative"),
    ("micro_step '1'", edit(window__micro_step="1"), TypeError, r"\['micro_step'\] must be a non-negative"),
    ("weighting tokens", edit(window__weighting="tokens"), ValueError, r"\['weighting'\] must be None"),
    ("weighting None mid-window", edit(window__weighting=None), ValueError, r"\['weighting'\] is None"),
    ("optimizer_steps 'x'", edit(optimizer_steps="x"), TypeError, r"state\['optimizer_steps'\] must be"),
    ("optimizer_steps -5", edit(optimizer_steps=-5), ValueError, r"state\['optimizer_steps'\] must be"),
    ("epoch 1.5", edit(epoch=1.5), TypeError, r"state\['epoch'\] must be"),
    ("skipped_windows -1", edit(skipped_windows=-1), ValueError, r"state\['skipped_windows'\] must be"),
    ("items 0 in an item window", edit(window__items=0), ValueError,
     r"\['items'\] is 0 for weighting='items'"),
    ("items -3", edit(window__items=-3), ValueError, r"\['items'\] must be a finite number >= 0"),
    ("items 9.5", edit(window__items=9.5), ValueError, r"\['items'\] must be an integer count"),
    ("items '9'", edit(window__items="9"), TypeError, r"\['items'\] must be a number"),
    ("size 5 for steps 3", edit(window__size=5), ValueError, r"\['size'\] is 5, but steps=3"),
    ("window a list", edit(window=[3, 2]), TypeError, r"state\['window'\] must be a dict"),
    ("last gradient of the wrong shape", bad_grad(3, np.zeros((2, 2), np.float32)), ValueError,
     r"state\['grads'\]\[3\] has shape \(2, 2\)"),
    ("a gradient of strings", bad_grad(1, np.array(["a"] * 8)), TypeError, r"state\['grads'\]\[1\] must be"),
    ("grads a dict", edit(grads={}), TypeError, r"state\['grads'\] must be a list"),
    ("window_loss 'low'", edit(window_loss="low"), TypeError, r"state\['window_loss'\] must be a number"),
    ("loss_sum True", edit(loss_sum=True), TypeError, r"state\['loss_sum'\] must be a number"),
    ("param_signature 3", edit(param_signature=3), TypeError, r"state\['param_signature'\] must be a list"),
    ("an empty dict", lambda s: s.clear(), ValueError, r"state\['version'\] is missing"),
]


@pytest.fixture(scope="module")
def good_state():
    """One ``stateful()`` state for every corruption (each test edits a deep copy)."""
    return stateful().state_dict()


@pytest.mark.parametrize(("name", "corrupt", "error", "message"), CORRUPTED, ids=[c[0] for c in CORRUPTED])
def test_a_corrupted_state_raises_naming_the_key_and_changes_nothing(name, corrupt, error, message,
                                                                      good_state):
    saved = copy.deepcopy(good_state)
    target = build(net(seed=5), steps=3, weighting="items")[1]
    fn = grad_fn(net(seed=5))
    x, y = data(MICRO, seed=9)
    loss, grads = fn(x, y)
    target(grads, 3, loss=loss)  # a window of its own, to see that it stays
    before = snapshot(target)
    corrupt(saved)
    with pytest.raises(error, match=message):
        target.load_state_dict(saved)
    assert_same(snapshot(target), before)


def test_the_uncorrupted_state_loads():
    # The negative twin of the test above: the same state, unedited, is accepted whole.
    source = stateful()
    target = build(net(seed=5), steps=3, weighting="items")[1]
    target.load_state_dict(source.state_dict())
    assert_same(snapshot(target), snapshot(source))
    assert source.window_loss is not None and source.state_dict()["loss_sum"] is not None


def test_loss_sum_on_an_empty_window_is_refused():
    acc = build(net(), steps=3)[1]
    state = acc.state_dict()
    state["loss_sum"] = 1.0
    with pytest.raises(ValueError, match=r"state\['loss_sum'\] is 1.0 for an empty window"):
        acc.load_state_dict(state)


@pytest.mark.parametrize("weighting", ["mean", "items"])
def test_window_loss_survives_a_resume_mid_window(weighting):
    x, y = data(6 * MICRO)
    fn_args = [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(6)]

    def feed_with_loss(model, acc, batches):
        fn = grad_fn(model)
        for xb, yb in batches:
            loss, grads = fn(xb, yb)
            acc(grads, loss=loss) if weighting == "mean" else acc(grads, MICRO, loss=loss)

    straight = net()
    acc = build(straight, weighting=weighting)[1]
    feed_with_loss(straight, acc, fn_args)
    first = net()
    opt, acc1 = build(first, weighting=weighting)
    feed_with_loss(first, acc1, fn_args[:4])  # one window, then one micro-batch of the next
    saved = pickle.loads(pickle.dumps(acc1.state_dict()))
    resumed = net()
    opt2, acc2 = build(resumed, weighting=weighting)
    for p, value in zip(resumed.trainable_params(), params(first), strict=True):
        p.set_data(Tensor(value))
    copy_cell(opt, opt2)
    acc2.load_state_dict(saved)
    assert acc2.window_loss == acc1.window_loss is not None  # the last window's, restored
    feed_with_loss(resumed, acc2, fn_args[4:])
    assert acc2.window_loss == acc.window_loss  # the open window's loss sum came along


def test_a_resume_and_an_epoch_change_reach_a_graph_that_already_ran():
    # MindSpore 2.10: Parameter.set_data after a graph ran gives new storage the graph never
    # sees. The accumulator writes in place instead; this pins it through a compiled step.
    x, y = data(8 * MICRO)
    model = net()
    _, acc = build(model, steps=Schedule({0: 2, 1: 3}, by="epoch"))
    fn = grad_fn(model)

    @mindspore.jit
    def step(xb, yb):
        return acc(fn(xb, yb)[1])

    batches = [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(8)]
    assert [bool(step(*b)) for b in batches[:2]] == [False, True]
    acc.set_epoch(1)  # windows of 3 from now on
    assert [bool(step(*b)) for b in batches[2:5]] == [False, False, True]
    state = acc.state_dict()
    step(*batches[5])  # one micro-batch more, then back to the saved (empty) window
    acc.load_state_dict(state)
    assert acc.micro_step == 0
    assert [bool(step(*b)) for b in batches[5:8]] == [False, False, True]
