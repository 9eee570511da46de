"""A mid-window ``save_state`` that cannot resume exactly says so (docs/INTEGRATIONS.md,
"Checkpoints in the middle of a window"), run on the page's recipes: the port's set-up and its
checkpointing loop, saving every 3 micro-batches, a restart from the checkpoint after micro-batch 6
(2 into a window).

* Accelerate's default shuffled dataloader: the restart draws another order. The adapter warns at
  ``save_state`` and at ``load_state``, naming ``use_seedable_sampler=True`` and ``set_epoch``.
* A seedable sampler without ``set_epoch``: the resumed run's next epoch draws the first epoch's
  order again; the adapter warns at that epoch's first micro-batch.
* A plain accumulator that Accelerate does not know of: its partial window is not in the
  checkpoint; it warns in the saving run, naming the adapter and ``register_for_checkpointing``.
* The twins stay silent: the seedable sampler with ``set_epoch`` (bitwise), no shuffling, the plain
  accumulator registered by hand.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.integrations.common import causal_lm_loss_float64, padded_text, recipe, run, tiny_gpt2

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, GradientState

SETTINGS = {"learning_rate": 1e-3, "weight_decay": 0.1, "lr_scheduler_type": "cosine",
            "num_warmup_steps": 1, "num_train_epochs": 2, "gradient_accumulation_steps": 4}
PORT_ACCELERATOR = "accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps)\n"
PORT_ACC = ("acc = gradaccum.integrations.accelerate.Accumulator(accelerator, optimizer, model=model, "
            "scheduler=lr_scheduler)")
SET_EPOCH = ("    train_dataloader.set_epoch(epoch)  # a seedable sampler's order for this epoch "
             "(shuffle=True)\n")
OURS = ("save_state", "load_state", "set_epoch", "saved in the middle of a window")


class Killed(Exception):
    """The process dies right after writing its checkpoint."""


@pytest.fixture(scope="module")
def base():
    model = tiny_gpt2()
    model.loss_function = causal_lm_loss_float64
    return model


def checkpointing(base, out, *, resume=None, kill=False, shuffle=True, seedable=False, set_epoch=True,
                  plain=None):
    """Run the recipes; ``plain``: "unregistered" or "registered" (by hand) plain accumulator.
    Returns the run's namespace and the warnings of ours it gave."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(1234)
    loader = torch.utils.data.DataLoader(padded_text(40), batch_size=4, shuffle=shuffle)
    ns = {"model": copy.deepcopy(base), "train_dataloader": loader, **SETTINGS,
          "resume_from_checkpoint": resume, "checkpointing_steps": 3, "output_dir": str(out)}
    setup = recipe("run-clm").split("\ncompleted_steps = 0\n")[0]
    if seedable:
        setup = setup.replace(PORT_ACCELERATOR, recipe("run-clm-seedable"))
    if plain:
        # The page's by-hand recipe: the optimizer inside the prepared one (or the prepared one).
        inner = ".optimizer" if plain.endswith("inner") else ""
        by_hand = (f"acc = gradaccum.Accumulator(optimizer{inner}, gradient_accumulation_steps, model=model, "
                   "scheduler=lr_scheduler, scaler=accelerator.scaler)")
        if plain.startswith("registered"):
            by_hand += "\naccelerator.register_for_checkpointing(acc)"
        setup = setup.replace(PORT_ACC, "import gradaccum\n" + by_hand)
    loop = [(SET_EPOCH, "")] if not set_epoch else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(setup, "INTEGRATIONS.md[run-clm]", "exec"), ns)
        if kill:
            save_state = ns["accelerator"].save_state

            def save_then_die(path):
                save_state(path)
                if path.endswith("epoch_0_batch_6"):
                    raise Killed

            ns["accelerator"].save_state = save_then_die
        try:
            run("run-clm-checkpoint", ns, *loop)
            if plain:
                ns["acc"].flush()
        except Killed:
            assert ns["acc"].micro_step == 2
    return ns, [str(w.message) for w in caught if any(s in str(w.message) for s in OURS)]


def interrupted_and_resumed(base, tmp_path, **options):
    """The warnings of the run that saves (and dies after micro-batch 6) and of the resumed run."""
    _, at_save = checkpointing(base, tmp_path / "a", kill=True, **options)
    resumed, at_resume = checkpointing(base, tmp_path / "b", resume=str(tmp_path / "a" / "epoch_0_batch_6"),
                                       **options)
    return at_save, at_resume, resumed


def test_a_shuffled_default_dataloader_warns_at_save_state_and_at_load_state(base, tmp_path):
    at_save, at_resume, _ = interrupted_and_resumed(base, tmp_path)
    fix = "DataLoaderConfiguration(use_seedable_sampler=True)"
    # Every save of the epoch (after micro-batches 3 and 6) is mid-epoch: each warns.
    assert len(at_save) == 2 and all(m.startswith("accelerator.save_state in the middle of an epoch of a "
                                                  "shuffled dataloader") for m in at_save)
    assert all(fix in m and "set_epoch(epoch)" in m for m in at_save)
    (loaded, *later) = at_resume
    assert loaded.startswith("accelerator.load_state of a checkpoint saved in the middle of an epoch")
    assert fix in loaded
    assert all(m.startswith("accelerator.save_state") for m in later)  # its own later saves


def test_a_seedable_sampler_with_set_epoch_resumes_bitwise_without_a_warning(base, tmp_path):
    uninterrupted, quiet = checkpointing(base, tmp_path / "u", seedable=True)
    at_save, at_resume, resumed = interrupted_and_resumed(base, tmp_path, seedable=True)
    assert quiet == at_save == at_resume == []
    assert all(torch.equal(p, q) for p, q in zip(uninterrupted["model"].parameters(),
                                                  resumed["model"].parameters(), strict=True))


def test_a_seedable_sampler_without_set_epoch_warns_in_the_resumed_run(base, tmp_path):
    at_save, at_resume, _ = interrupted_and_resumed(base, tmp_path, seedable=True, set_epoch=False)
    assert at_save == []  # the saving run cannot tell: its epochs count themselves
    (message,) = at_resume  # at the first micro-batch of epoch 1, which draws epoch 0's order
    assert message.startswith("this epoch's dataloader is at epoch 0 after a resume, where the interrupted "
                              "run was at epoch 1")
    assert "train_dataloader.set_epoch(epoch)" in message


def test_an_unshuffled_dataloader_resumes_without_a_warning(base, tmp_path):
    at_save, at_resume, _ = interrupted_and_resumed(base, tmp_path, shuffle=False, set_epoch=False)
    assert at_save == at_resume == []


@pytest.mark.parametrize("plain", ["unregistered", "registered", "unregistered inner", "registered inner"])
def test_a_plain_accumulator_unknown_to_save_state_warns_in_the_saving_run(base, tmp_path, plain):
    # Seedable and set_epoch: the data's order is right; only the partial window is at stake.
    # "inner": INTEGRATIONS.md's by-hand recipe, the accumulator given the optimizer inside the
    # prepared one (a torch optimizer): the warning names register_for_checkpointing all the same.
    _, said = checkpointing(base, tmp_path, seedable=True, plain=plain)
    if plain.startswith("registered"):
        assert said == []
        return
    (message,) = said  # once, at the end of the window of the first mid-window save
    assert message.startswith("the optimizer's state was saved in the middle of a window (after micro-batch "
                              "3 of 4) without the accumulator's")
    assert "gradaccum.integrations.accelerate.Accumulator" in message
    assert "accelerator.register_for_checkpointing(acc)" in message
