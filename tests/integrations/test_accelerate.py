"""The Accelerate recipes of docs/INTEGRATIONS.md, executed as printed, against the full batch.

transformers' ``run_clm_no_trainer.py`` loop (trimmed to its training part) and its port to
``gradaccum.integrations.accelerate.Accumulator``: the port matches the full batch in float64, the
example's ``accelerator.accumulate`` loop does not; the diff on the page is the blocks' diff; a
mid-window ``save_state`` / ``load_state`` resumes bitwise; fp16's scaler unscales once per window;
two processes (gloo) match one process on the full batch.
"""

from __future__ import annotations

import copy
import difflib
import re

import pytest
import torch

from tests.integrations.common import (
    DOC,
    causal_lm_loss_float64,
    max_diff,
    padded_text,
    recipe,
    run,
    tiny_gpt2,
)

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

SETTINGS = {"learning_rate": 1e-3, "weight_decay": 0.1, "lr_scheduler_type": "cosine",
            "num_warmup_steps": 1, "num_train_epochs": 2}
SEQUENCES = 40  # 10 micro-batches of 4 per epoch: windows of 4, 4 and a short one of 2


def fresh_accelerate() -> None:
    """Forget the previous Accelerator (its state is process-wide), as a new process would."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def gpt2(float64_loss: bool = True) -> torch.nn.Module:
    model = tiny_gpt2()
    if float64_loss:
        model.loss_function = causal_lm_loss_float64
    return model


def namespace(base, micro, steps, sequences=SEQUENCES, shuffle=False):
    fresh_accelerate()
    torch.manual_seed(1234)  # the same global RNG in every run: only the sampler can differ
    loader = torch.utils.data.DataLoader(padded_text(sequences), batch_size=micro, shuffle=shuffle)
    return {"model": copy.deepcopy(base), "train_dataloader": loader,
            "gradient_accumulation_steps": steps, **SETTINGS}


def train(name, base, micro, steps, *replace):
    return run(name, namespace(base, micro, steps), *replace)


def test_the_recipes_are_in_the_doc():
    for name in ("run-clm-original", "run-clm", "run-clm-checkpoint", "run-clm-seedable"):
        assert recipe(name)


def test_port_of_run_clm_matches_the_full_batch_and_the_example_does_not():
    base = gpt2()
    full = train("run-clm-original", base, 16, 1)  # no accumulation: the reference
    port = train("run-clm", base, 4, 4)
    assert max_diff(full["model"], base) > 1e-3  # it trained
    assert port["completed_steps"] == full["completed_steps"] == 6  # 3 windows per epoch
    assert max_diff(port["model"], full["model"]) < 1e-12  # measured: 8.9e-16
    example = train("run-clm-original", base, 4, 4)
    assert example["completed_steps"] == 6
    assert max_diff(example["model"], full["model"]) > 1e-4  # measured: 4.9e-3


def test_port_with_transformers_float32_loss_is_at_float32_level():
    base = gpt2(float64_loss=False)  # transformers upcasts the logits to float32 for the loss
    full, port = train("run-clm-original", base, 16, 1), train("run-clm", base, 4, 4)
    assert max_diff(port["model"], full["model"]) < 1e-7  # measured: 2.5e-9


def diff_lines():
    return [line for line in difflib.unified_diff(recipe("run-clm-original").splitlines(),
                                                  recipe("run-clm").splitlines(), lineterm="", n=1)
            if not line.startswith(("---", "+++"))]


def test_the_diff_on_the_page_is_the_blocks_diff_and_changes_at_most_eight_lines():
    shown = re.search(r"<!-- diff: run-clm -->\n```diff\n(.*?)```", DOC.read_text(), re.S)
    assert shown, "no diff block in the doc"
    assert shown.group(1).splitlines() == diff_lines()
    removed = {line[1:].strip() for line in diff_lines() if line.startswith("-") and line[1:].strip()}
    added = {line[1:].strip() for line in diff_lines() if line.startswith("+") and line[1:].strip()}
    assert len(removed - added) + len(added - removed) <= 8  # blank and re-indented lines aside
    assert len(removed & added) == 2  # outputs = ..., loss = ...: one level less indented


class Killed(Exception):
    """The process dies right after writing a checkpoint."""


PORT_ACCELERATOR = "accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps)\n"


def checkpoint_run(base, out, resume=None, kill_at=None, plain=False, shuffle=False, seedable=False):
    """The port's set-up, then the checkpointing loop; ``kill_at``: stop after that checkpoint.
    ``seedable``: the Accelerator of recipe ``run-clm-seedable`` in place of the port's."""
    ns = namespace(base, 4, 4, shuffle=shuffle)
    setup = recipe("run-clm").split("\ncompleted_steps = 0\n")[0]
    if seedable:
        assert setup.count(PORT_ACCELERATOR) == 1
        setup = setup.replace(PORT_ACCELERATOR, recipe("run-clm-seedable"))
    if plain:  # a plain accumulator, not registered for checkpointing
        setup = setup.replace("gradaccum.integrations.accelerate.Accumulator(accelerator, optimizer,",
                              "gradaccum.Accumulator(optimizer, gradient_accumulation_steps,")
    exec(compile(setup, "INTEGRATIONS.md[run-clm]", "exec"), ns)
    save_state = ns["accelerator"].save_state

    def save_then_die(path):
        save_state(path)
        if kill_at is not None and path.endswith(kill_at):
            raise Killed

    ns["accelerator"].save_state = save_then_die
    ns.update(resume_from_checkpoint=resume, checkpointing_steps=3, output_dir=str(out))
    try:
        run("run-clm-checkpoint", ns)
    except Killed:
        assert ns["acc"].micro_step == 2  # 6 micro-batches into the epoch: mid-window
    return ns


@pytest.mark.parametrize("plain", [False, True], ids=["registered", "plain-accumulator"])
def test_mid_window_save_state_and_load_state_resume_bitwise(tmp_path, plain):
    base = gpt2()
    uninterrupted = checkpoint_run(base, tmp_path / "a", plain=plain)
    checkpoint_run(base, tmp_path / "b", kill_at="epoch_0_batch_6", plain=plain)
    resumed = checkpoint_run(base, tmp_path / "c", resume=str(tmp_path / "b" / "epoch_0_batch_6"),
                             plain=plain)
    assert max_diff(uninterrupted["model"], base) > 1e-3
    same = all(torch.equal(p, q) for p, q in zip(uninterrupted["model"].parameters(),
                                                  resumed["model"].parameters(), strict=True))
    # Not registered, the accumulator's partial window (2 micro-batches) is lost at the restart.
    assert same is not plain


def resumed_against_uninterrupted(tmp_path, **options):
    """The largest parameter difference between a run resumed mid-window and an uninterrupted one,
    and how far the uninterrupted run moved."""
    base = gpt2()
    uninterrupted = checkpoint_run(base, tmp_path / "a", **options)
    checkpoint_run(base, tmp_path / "b", kill_at="epoch_0_batch_6", **options)
    resumed = checkpoint_run(base, tmp_path / "c", resume=str(tmp_path / "b" / "epoch_0_batch_6"), **options)
    same = all(torch.equal(p, q) for p, q in zip(uninterrupted["model"].parameters(),
                                                  resumed["model"].parameters(), strict=True))
    return same, max_diff(uninterrupted["model"], resumed["model"]), max_diff(uninterrupted["model"], base)


@pytest.mark.parametrize("seedable", [True, False], ids=["seedable-sampler", "default-dataloader"])
def test_a_shuffled_epoch_resumes_bitwise_with_a_seedable_sampler_and_set_epoch(tmp_path, seedable):
    # The example's shuffle=True: the loop's set_epoch(epoch) and the seedable sampler of recipe
    # run-clm-seedable make the restarted epoch draw the interrupted one's order; Accelerate's
    # default dataloader does not (the negative twin).
    same, _, moved = resumed_against_uninterrupted(tmp_path, shuffle=True, seedable=seedable)
    assert moved > 1e-3
    assert same is seedable


def fp16_train(base, micro, steps, adapter):
    """fp16 autocast with Accelerate's GradScaler. On CPU Accelerate makes no scaler, so the test
    gives the accelerator the one it makes on a GPU (torch.amp.GradScaler) before prepare()."""
    ns = namespace(base, micro, steps)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=steps)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    model = ns["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, ns["train_dataloader"])
    if adapter:
        import gradaccum.integrations.accelerate

        acc = gradaccum.integrations.accelerate.Accumulator(accelerator, opt, model=model)
    else:  # the prepared optimizer steps the scaler itself: a second unscale and update
        import gradaccum

        acc = gradaccum.Accumulator(opt, steps, model=model, scaler=accelerator.scaler)
    for batch in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        acc.backward(loss, n_items=gradaccum.count_tokens(batch["labels"], shift=True))
    return model


def test_fp16_scaler_unscales_once_per_window():
    base = tiny_gpt2(torch.float32)
    full = fp16_train(base, 16, 1, adapter=True)
    port = fp16_train(base, 4, 4, adapter=True)
    assert max_diff(full, base) > 1e-3
    for p, q in zip(port.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)  # fp16 forwards of other shapes
    with pytest.raises(AssertionError, match="No inf checks"):
        fp16_train(base, 4, 4, adapter=False)


TWO_RANK_SEQUENCES = 64  # per epoch, 2 windows of 4 micro-batches of 4 on each of 2 ranks


def test_two_processes_match_one_process_on_the_full_batch(tmp_path):
    from tests.ranks import run_ranks

    ranks = run_ranks("tests.integrations.accelerate_ranks", tmp_path, world=2, timeout=180)
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["type"].endswith("MULTI_CPU")
    base = gpt2()
    full = run("run-clm-original", namespace(base, 32, 1, TWO_RANK_SEQUENCES))
    assert [r["completed_steps"] for r in ranks] == [full["completed_steps"]] * 2 == [4, 4]
    reference = [p.detach() for p in full["model"].parameters()]
    assert max_diff(full["model"], base) > 1e-3  # it trained
    for rank in ranks:
        assert max(float((p - q).abs().max())
                   for p, q in zip(rank["params"], reference, strict=True)) < 1e-12


def test_by_hand_without_the_adapter_matches_the_full_batch():
    # The page's "Without the adapter" line, on whole windows (no flush needed: 32 = 2 x 16).
    base = gpt2()
    full = run("run-clm-original", namespace(base, 16, 1, 32))
    by_hand = run("run-clm", namespace(base, 4, 4, 32), (
        "gradaccum.integrations.accelerate.Accumulator(accelerator, optimizer, model=model, "
        "scheduler=lr_scheduler)",
        "gradaccum.Accumulator(optimizer.optimizer, gradient_accumulation_steps, model=model, "
        "scheduler=lr_scheduler, scaler=accelerator.scaler)"))
    assert max_diff(full["model"], base) > 1e-3
    assert max_diff(by_hand["model"], full["model"]) < 1e-12


def test_the_adapter_refuses_a_scaler_of_its_own_and_deepspeed():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    import gradaccum.integrations.accelerate as adapter

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = accelerate.Accelerator()
    with pytest.raises(TypeError, match="scaler is the accelerator's"):
        adapter.Accumulator(accelerator, opt, model=model, scaler=torch.amp.GradScaler("cpu"))
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ValueError, match="DEEPSPEED"):
        adapter.Accumulator(deepspeed, opt, model=model)
    assert accelerator._custom_objects == []  # nothing registered by a refused call


def test_sync_gradients_follows_the_windows_and_the_end_of_the_dataloader():
    import gradaccum.integrations.accelerate as adapter

    accelerator = accelerate.Accelerator(gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 1)
    model, opt, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.DataLoader(torch.randn(6, 2), batch_size=1))
    acc = adapter.Accumulator(accelerator, opt, model=model)
    flags, stepped = [], []
    for x in loader:
        stepped.append(acc.backward(model(x).pow(2).mean()))
        flags.append(accelerator.sync_gradients)
    assert flags == stepped == [False, False, False, True, False, True]  # 4, then the last 2
    assert acc.optimizer_steps == 2 and acc.micro_step == 0


BACKWARD = "        acc.backward(loss, n_items=gradaccum.count_tokens(batch[\"labels\"], shift=True))\n"


@pytest.mark.parametrize("kept", [
    "optimizer.step()\n        lr_scheduler.step()\n        optimizer.zero_grad()\n",
    "lr_scheduler.step()\n",
    "if accelerator.sync_gradients:\n            lr_scheduler.step()\n",
])
def test_the_examples_own_step_calls_left_in_the_loop_change_nothing(kept):
    # The example's optimizer.step(), lr_scheduler.step() and optimizer.zero_grad() left after
    # acc.backward: the prepared scheduler stepped a second time at each window's end (after 3
    # windows the LR was 8x too low, the parameters 4.2e-2 off); the accumulator steps it once.
    base = gpt2()
    port = train("run-clm", base, 4, 4)
    left_in = train("run-clm", base, 4, 4, (BACKWARD, BACKWARD + "        " + kept))
    assert left_in["completed_steps"] == port["completed_steps"] == 6
    assert left_in["lr_scheduler"].get_last_lr() == port["lr_scheduler"].get_last_lr()
    assert left_in["lr_scheduler"].scheduler.last_epoch == 6
    assert max_diff(left_in["model"], port["model"]) == 0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_by_hand_the_examples_own_scheduler_step_is_refused():
    # Without the adapter nothing gates the prepared scheduler (sync_gradients stays True: the
    # loop's step moves it after every micro-batch): the accumulator refuses it at its boundary.
    base = gpt2()
    with pytest.raises(RuntimeError, match=r"scheduler\.step\(\) was called outside the accumulator.*"
                                           r"remove your own scheduler\.step\(\)"):
        run("run-clm", namespace(base, 4, 4, 32), (
            "gradaccum.integrations.accelerate.Accumulator(accelerator, optimizer, model=model, "
            "scheduler=lr_scheduler)",
            "gradaccum.Accumulator(optimizer.optimizer, gradient_accumulation_steps, model=model, "
            "scheduler=lr_scheduler, scaler=accelerator.scaler)"),
            (BACKWARD, BACKWARD + "        lr_scheduler.step()\n"))
