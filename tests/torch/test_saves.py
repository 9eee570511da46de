"""A checkpoint of the optimizer taken mid-window without the accumulator's state loses the partial
window on resume: the accumulator warns at that window's boundary, once, naming the fix; a
checkpoint that holds both (in either order), or one taken at a boundary, passes in silence."""

import warnings
import weakref

import pytest
import torch

import gradaccum


def setup(steps=4):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, steps)
    x = torch.randn(2, 3)
    return model, opt, acc, lambda: acc.backward(model(x).pow(2).mean())


def saves(action):
    """The gradaccum warnings about saved windows while ``action`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if "saved in the middle of a window" in str(w.message)]


def test_the_optimizer_saved_mid_window_without_the_accumulator_warns_at_the_boundary():
    _, opt, _, feed = setup()

    def run():
        feed(), feed()
        opt.state_dict()  # a checkpoint of model and optimizer only
        assert not saves(feed)  # nothing yet: the window is still open
        feed()

    (message,) = saves(run)
    assert message.startswith("the optimizer's state was saved in the middle of a window (after "
                              "micro-batch 2 of 4) without the accumulator's")
    assert "Save acc.state_dict() beside it" in message
    # Once: the next incomplete save is not warned about again.
    assert not saves(lambda: (feed(), opt.state_dict(), [feed() for _ in range(3)]))


@pytest.mark.parametrize("order", ["optimizer first", "accumulator first", "GUIDE's torch.save"])
def test_a_checkpoint_with_both_states_passes(order, tmp_path):
    model, opt, acc, feed = setup()

    def run():
        feed()
        if order == "optimizer first":
            opt.state_dict(), acc.state_dict()
        elif order == "accumulator first":
            acc.state_dict(), opt.state_dict()
        else:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict()},
                       tmp_path / "ckpt.pt")
        for _ in range(3):
            feed()

    assert saves(run) == []


def test_an_accumulator_state_of_another_point_of_the_window_does_not_count():
    _, opt, acc, feed = setup()
    assert len(saves(lambda: (feed(), acc.state_dict(), feed(), opt.state_dict(), feed(), feed()))) == 1


def test_a_save_at_a_boundary_or_before_a_flush_is_checked_as_its_window_ends():
    _, opt, acc, feed = setup()
    assert saves(lambda: (opt.state_dict(), [feed() for _ in range(4)])) == []  # no partial window
    assert len(saves(lambda: (feed(), opt.state_dict(), acc.flush()))) == 1  # the short last window


def test_a_dropped_accumulator_leaves_no_hook_that_keeps_it():
    _, opt, acc, feed = setup()
    ref = weakref.ref(acc)
    del acc, feed
    assert ref() is None  # the optimizer's hook holds it weakly
    second = gradaccum.Accumulator(opt, 2)  # takes the dead hook off
    assert len(opt._optimizer_state_dict_pre_hooks) == 1 and second.micro_step == 0
    opt.state_dict()
