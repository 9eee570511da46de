"""``Accumulator.backward_pipeline`` in one process: a one-stage pipeline on a 1-rank gloo group.

The weighting, the boundary and the refusals that need no second rank; the 2- and 4-process runs
are tests/distributed/test_pipeline.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradaccum
from gradaccum.bench.pipeline import (
    PAD,
    build,
    count,
    full_model,
    max_diff,
    reference,
    sgd,
    stage_params,
    token_mean,
    token_sum,
    window_batches,
)
from gradaccum.torch.pipeline.checks import CALL, agreement_vector, read_agreement
from gradaccum.torch.pipeline.feed import pow2_total

STEPS, N_MB = 3, 4
PAGE = Path(__file__).resolve().parents[2] / "docs" / "PIPELINE.md"


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tmp_path_factory.mktemp("pipeline_store")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def pipeline(kind="gpipe", loss_fn=token_sum, clip=0.05, scale_grads=False, **acc_kwargs):
    full = full_model(1)
    schedule, (mod,) = build(kind, full, 0, 1, N_MB, loss_fn, scale_grads=scale_grads)
    acc = gradaccum.Accumulator(sgd(mod.parameters()), STEPS, model=mod, clip_norm=clip, **acc_kwargs)
    return schedule, mod, acc


def data(windows=2):
    return [window_batches(w, STEPS, 1, 8) for w in range(windows)]


@pytest.mark.parametrize(("kind", "reduction", "clip"), [("gpipe", "sum", 0.05), ("1f1b", "mean", None),
                                                         ("gpipe", "mean", 0.05)])
def test_one_stage_equals_one_process_on_the_full_batch(group, kind, reduction, clip):
    schedule, mod, acc = pipeline(kind, token_sum if reduction == "sum" else token_mean, clip)
    windows = data()
    stepped = [acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction=reduction)
               for window in windows for t, y in window[0]]
    ref, losses = reference(1, windows, sgd, clip)
    assert stepped == [False, False, True] * 2
    assert max_diff([mod], stage_params(ref, 0, 1)) < 1e-12
    assert abs(float(acc.window_loss) - losses[-1]) < 1e-12


def test_a_sum_reduced_batch_takes_its_count_as_one_number(group):
    # With reduction="sum" the batch's count is enough (a function per micro-batch is not needed).
    schedule, mod, acc = pipeline()
    windows = data()
    for window in windows:
        for t, y in window[0]:
            acc.backward_pipeline(schedule, t, target=y, n_items=int((y != PAD).sum()), reduction="sum")
    ref, _ = reference(1, windows, sgd, 0.05)
    assert max_diff([mod], stage_params(ref, 0, 1)) < 1e-12


def test_losses_passed_to_step_get_each_micro_batch_loss_as_loss_fn_returned_it(group):
    # The schedule backpropagates each mean times its count; `losses` gets the means themselves.
    schedule, mod, acc = pipeline(loss_fn=token_mean)
    t, y = data(1)[0][0][0]
    chunks = zip(t.tensor_split(N_MB), y.tensor_split(N_MB), strict=True)
    with torch.no_grad():
        want = [token_mean(mod(tc), yc) for tc, yc in chunks]
    losses: list[torch.Tensor] = []
    acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="mean", losses=losses)
    assert len(losses) == N_MB
    for got, expected in zip(losses, want, strict=True):
        torch.testing.assert_close(got.detach(), expected, atol=1e-12, rtol=0)


def test_no_loss_fn_and_scale_grads_are_refused_before_anything_runs(group):
    for options, words in (({"loss_fn": None}, "has no loss_fn"),
                           ({"scale_grads": True}, "scale_grads=True")):
        schedule, mod, acc = pipeline(**options)
        before = [p.detach().clone() for p in mod.parameters()]
        t, y = data(1)[0][0][0]
        with pytest.raises(ValueError, match=words):
            acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="sum")
        assert acc.micro_step == 0 and all(p.grad is None for p in mod.parameters())
        assert all(torch.equal(p, b) for p, b in zip(mod.parameters(), before, strict=True))


def test_a_pipeline_window_refuses_a_plain_backward(group):
    schedule, mod, acc = pipeline()
    t, y = data(1)[0][0][0]
    acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="sum")
    acc.flush()
    with pytest.raises(RuntimeError, match="backward_pipeline"):
        acc.backward(token_sum(mod(t), y))


@pytest.mark.parametrize("feed", ["backward", "micro_batch", "backward_cached"])
def test_a_plain_feed_mid_window_is_refused_before_its_backward(group, feed):
    # Before: refused at a window's first micro-batch only; mid-window it was added in.
    schedule, mod, acc = pipeline()
    t, y = data(1)[0][0][0]
    acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="sum")
    held = [p.grad.clone() for p in mod.parameters()]
    with pytest.raises(RuntimeError, match=r"feeds a pipeline schedule: call acc\.backward_pipeline"):
        if feed == "backward":
            acc.backward(token_sum(mod(t), y))
        elif feed == "micro_batch":
            with acc.micro_batch() as mb:
                mb.backward(token_sum(mod(t), y))
        else:
            acc.backward_cached(mod, lambda z: z.sum(), gradaccum.chunks(t, 4))
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(mod.parameters(), held, strict=True))


def test_a_scheduler_stepped_inside_a_pipeline_window_drops_it_at_its_boundary(group):
    schedule, mod, acc = pipeline()
    sched = torch.optim.lr_scheduler.StepLR(acc.optimizer, 1, 0.5)
    acc = gradaccum.Accumulator(acc.optimizer, STEPS, model=mod, scheduler=sched)
    calls = data(1)[0][0]
    before = [p.detach().clone() for p in mod.parameters()]
    acc.backward_pipeline(schedule, calls[0][0], target=calls[0][1], n_items=count, reduction="sum")
    with pytest.warns(UserWarning):  # torch's: "lr_scheduler.step() before optimizer.step()"
        sched.step()
    acc.backward_pipeline(schedule, calls[1][0], target=calls[1][1], n_items=count, reduction="sum")
    with pytest.raises(ValueError, match=r"dropped on every rank.*scheduler\.step\(\) was called outside"):
        acc.backward_pipeline(schedule, calls[2][0], target=calls[2][1], n_items=count, reduction="sum")
    assert acc.optimizer_steps == 0 and acc.micro_step == 0
    assert all(torch.equal(p, b) for p, b in zip(mod.parameters(), before, strict=True))
    for t, y in calls:  # said once: the next window trains
        acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="sum")
    assert acc.optimizer_steps == 1


def test_a_stale_gradient_before_the_first_call_is_refused_before_anything_runs(group):
    schedule, mod, acc = pipeline()
    t, y = data(1)[0][0][0]
    token_sum(mod(t), y).backward()  # the user's own backward before the loop
    before = [p.detach().clone() for p in mod.parameters()]
    with pytest.raises(ValueError, match="already holds a nonzero gradient"):
        acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="sum")
    assert acc.micro_step == 0
    assert all(torch.equal(p, b) for p, b in zip(mod.parameters(), before, strict=True))


def test_a_gradient_edited_mid_window_drops_the_window_at_its_boundary(group):
    # Not the probe (the first parameter): the whole-window check, which counts one backward pass
    # per pipeline micro-batch, finds it before the window's last call.
    schedule, mod, acc = pipeline()
    calls = data(1)[0][0]
    before = [p.detach().clone() for p in mod.parameters()]
    acc.backward_pipeline(schedule, *calls[0][:1], target=calls[0][1], n_items=count, reduction="sum")
    list(mod.parameters())[-1].grad.mul_(2)
    acc.backward_pipeline(schedule, *calls[1][:1], target=calls[1][1], n_items=count, reduction="sum")
    with pytest.raises(ValueError, match="changed in place"):
        acc.backward_pipeline(schedule, *calls[2][:1], target=calls[2][1], n_items=count, reduction="sum")
    assert acc.optimizer_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(mod.parameters(), before, strict=True))


def test_flush_applies_a_partial_pipeline_window_as_its_own_mean(group):
    schedule, mod, acc = pipeline(clip=None)
    window = data(1)[0]
    for t, y in window[0][:2]:
        acc.backward_pipeline(schedule, t, target=y, n_items=count, reduction="sum")
    assert acc.flush() and acc.optimizer_steps == 1
    ref, _ = reference(1, [[window[0][:2]]], sgd, None)
    assert max_diff([mod], stage_params(ref, 0, 1)) < 1e-12


def test_the_provisional_total_is_a_power_of_two_above_the_window_count():
    assert pow2_total(3, 4) == 16.0 and pow2_total(4, 4) == 32.0 and pow2_total(0, 4) == 1.0
    assert pow2_total(float("nan"), 2) == 1.0


def test_an_agreement_names_what_the_ranks_disagree_on_and_each_problem():
    a = agreement_vector([CALL, 3, 0, 4, 2, 0, -1, 0], [1, 1, 1, 5, 0, 0], ["target"], 1)
    b = agreement_vector([CALL, 4, 0, 4, 2, 0, -1, 0], [0, 0, 0, 0, 0, 0], [], 0)
    reduced = [max(x, y) for x, y in zip(a, b, strict=True)]
    with pytest.raises(ValueError) as e:
        read_agreement(reduced, {"target": ""})
    assert "disagree on steps: from 3 to 4" in str(e.value) and "target=None" in str(e.value)
    assert "(rank 1)" in str(e.value)
    agreed = read_agreement([max(x, y) for x, y in zip(b, b, strict=True)], {})
    assert not agreed.use_scale and agreed.first_count == 0


def _diff_lines():
    import difflib

    from tests.integrations.common import recipe

    return [line for line in difflib.unified_diff(recipe("pp-hand", doc=PAGE).splitlines(),
                                                  recipe("pp-gradaccum", doc=PAGE).splitlines(),
                                                  lineterm="", n=1)
            if not line.startswith(("---", "+++"))]


def test_the_pipeline_page_shows_the_recipes_diff_and_it_changes_at_most_eight_lines():
    import re

    shown = re.search(r"<!-- diff: pp-gradaccum -->\n```diff\n(.*?)```", PAGE.read_text(), re.S)
    assert shown, "no diff block in docs/PIPELINE.md"
    assert shown.group(1).splitlines() == _diff_lines()
    changed = [line for line in _diff_lines() if line[:1] in "+-" and line[1:].strip()]
    assert len(changed) <= 8, changed
