"""gradaccum.integrations.lightning against the full batch: one device, DDP, precision, scheduler, validation,
checkpoints, global_step, and the recipes of docs/LIGHTNING.md as printed."""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.plugins import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gradaccum.integrations.lightning import CHECKPOINT_KEY, AccumulatorMixin  # noqa: E402
from tests.integrations.lightning_common import (  # noqa: E402
    Loader,
    TinyLM,
    largest_difference,
    micro_batches,
    reference,
    trainer,
    windows_of,
)
from tests.ranks import environment, run_ranks, scenario  # noqa: E402
from tests.reference import lm_loss, tiny_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "LIGHTNING.md"
RESULTS = ROOT / "docs" / "results" / "lightning_accumulation.json"
STEPS, PER_EPOCH, EPOCHS = 4, 10, 2  # windows of 4 + 4 + 2 per epoch

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's advice (workers, loggers, ...)


def epoch_windows() -> list[list[Any]]:
    return windows_of(micro_batches(PER_EPOCH), STEPS) * EPOCHS


def fit(model: TinyLM, **kwargs: Any) -> Any:
    ckpt = kwargs.pop("ckpt_path", None)
    val = kwargs.pop("val", None)
    run = trainer(max_epochs=EPOCHS, **kwargs)
    run.fit(model, train_dataloaders=Loader(micro_batches(PER_EPOCH)), val_dataloaders=val, ckpt_path=ckpt)
    return run


def test_importing_gradaccum_loads_no_lightning():
    code = ("import sys, gradaccum, gradaccum.lightning, gradaccum.integrations.lightning; "
            "print([m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning')])")
    out = subprocess.run([sys.executable, "-c", code], env=environment(), capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_one_device_matches_the_full_batch_and_counts_windows_in_global_step():
    model = TinyLM(steps=STEPS)
    run = fit(model)
    assert largest_difference(model.net, reference(epoch_windows())) < 1e-12
    assert run.global_step == model.accumulator.optimizer_steps == 6  # 2 x (4 + 4 + 2), last flushed
    assert model.accumulator.micro_step == 0
    assert not model.automatic_optimization


class SkipsLastBatch(TinyLM):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == PER_EPOCH - 1 else super().training_step(batch, batch_idx)


def test_a_window_left_open_at_the_epoch_end_is_flushed_and_counted_there():
    model = SkipsLastBatch(steps=STEPS)
    run = fit(model)  # the last batch feeds nothing: windows 4 + 4 + 1, the 1 flushed at the epoch end
    assert run.global_step == 6
    batches = micro_batches(PER_EPOCH)
    expected = reference([batches[:4], batches[4:8], batches[8:9]] * EPOCHS)
    assert largest_difference(model.net, expected) < 1e-12


def test_a_window_that_spans_the_epoch_end_is_not_what_the_mixin_does():
    """Negative twin of the flush: without it the two epochs' windows would run 4, 4, 4, 4, 4."""
    assert largest_difference(reference(epoch_windows()),
                              reference(windows_of(micro_batches(PER_EPOCH) * EPOCHS, STEPS))) > 1e-4


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_the_scheduler_of_configure_optimizers_steps_per_window_or_per_epoch(interval):
    model = TinyLM(steps=STEPS, scheduler=interval)
    fit(model)
    expected = reference(epoch_windows(), scheduler=interval, windows_per_epoch=3)
    assert largest_difference(model.net, expected) < 1e-12
    assert largest_difference(model.net, reference(epoch_windows())) > 1e-4  # the scheduler mattered


class DefaultZeroGrad(TinyLM):
    """Lightning's own hook put back: validation clears the gradients."""

    def on_validation_model_zero_grad(self) -> None:
        pl.LightningModule.on_validation_model_zero_grad(self)


def test_validation_in_the_middle_of_a_window_keeps_the_partial_window():
    val = DataLoader(micro_batches(2, seed=100), batch_size=None)
    model = TinyLM(steps=STEPS)
    fit(model, val=val, val_check_interval=3)  # after micro-batches 3, 6, 9: mid-window
    assert len(model.val_losses) == 3 * 2 * EPOCHS
    assert largest_difference(model.net, reference(epoch_windows())) < 1e-12
    # The negative twin: Lightning's own hook clears the partial window's gradients, which the
    # accumulator sees at the next micro-batch (1e-4 off and silent before its guard).
    wiped = DefaultZeroGrad(steps=STEPS)
    with pytest.raises(RuntimeError, match="gradients were cleared outside the accumulator"):
        fit(wiped, val=val, val_check_interval=3)


class SaveMidWindow(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == 5:
            trainer.save_checkpoint(self.path)


def test_a_mid_window_checkpoint_resumes_bitwise(tmp_path):
    path = tmp_path / "mid.ckpt"
    whole = TinyLM(steps=STEPS)
    fit(whole, callbacks=[SaveMidWindow(path)])
    saved = torch.load(path, weights_only=False)[CHECKPOINT_KEY]
    assert saved["window"]["micro_step"] == 2 and saved["optimizer_steps"] == 1
    resumed = TinyLM(steps=STEPS)
    run = fit(resumed, ckpt_path=path)
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters(), strict=True))
    assert run.global_step == 6
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, tmp_path / "without.ckpt")
    lost = TinyLM(steps=STEPS)
    fit(lost, ckpt_path=tmp_path / "without.ckpt")
    assert largest_difference(lost, whole) > 1e-6


def test_the_16_mixed_plugin_scaler_drives_the_accumulator():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    model = TinyLM(steps=STEPS)
    run = fit(model, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert model.accumulator.scaler is scaler
    assert scaler.get_scale() == 2.0 ** (10 + 6)  # grown once per window, never per micro-batch
    assert run.global_step == 6
    assert largest_difference(model.net, reference(epoch_windows())) < 1e-12


def test_clip_norm_clips_the_window_gradient():
    model = TinyLM(steps=STEPS, clip_norm=0.05)
    fit(model)
    assert largest_difference(model.net, reference(epoch_windows(), clip_norm=0.05)) < 1e-12
    assert largest_difference(model.net, reference(epoch_windows())) > 1e-4  # the clip bit


class Float32LM(TinyLM):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.net = self.net.float()


def test_16_mixed_on_a_float32_model_runs_in_fp16_and_stays_near_the_full_batch():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    model = Float32LM(steps=STEPS)
    fit(model, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert model.accumulator.skipped_windows == 0 and scaler.get_scale() == 2.0 ** 16
    gap = largest_difference(model.net, reference(epoch_windows()))
    assert 1e-7 < gap < 1e-3  # fp16 matmuls (so autocast did run them), within fp16's precision


def test_an_overflowing_window_is_skipped_whole_and_still_counted_as_a_step():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    model = Float32LM(steps=STEPS)
    before = [p.detach().clone() for p in model.parameters()]
    run = fit(model, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    acc = model.accumulator
    assert acc.skipped_windows == 6 and acc.optimizer_steps == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert run.global_step == 6  # as Lightning counts a step its GradScaler skipped
    assert scaler.get_scale() == 2.0 ** 54  # backed off once per window


class TwoOptimizers(TinyLM):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]


class Plateau(TinyLM):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "loss"}}


@pytest.mark.parametrize(("module", "message"), [(TwoOptimizers, "exactly one optimizer"),
                                                  (Plateau, "ReduceLROnPlateau")])
def test_what_the_mixin_cannot_step_is_refused_when_training_starts(module, message):
    model = module(steps=STEPS)
    with pytest.raises(ValueError, match=message):
        fit(model)


def test_bad_options_fail_at_construction_and_the_accumulator_waits_for_training():
    with pytest.raises(ValueError, match="sync"):
        TinyLM(steps=STEPS, sync="never")
    with pytest.raises((TypeError, ValueError), match="steps"):
        TinyLM(steps=0)
    with pytest.raises(RuntimeError, match="built when training starts"):
        _ = TinyLM(steps=STEPS).accumulator


class ReturnsTheLoss(TinyLM):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return lm_loss(self.net, *batch)  # as under automatic optimization: nothing steps


class CallsManualBackward(TinyLM):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = lm_loss(self.net, *batch)
        self.manual_backward(loss)  # the backward alone: nothing steps
        return loss


def fit_recording(model: TinyLM) -> tuple[Any, list[str]]:
    """``fit(model)`` and the messages of the mixin's forgotten-accumulate warnings."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = fit(model)
    return run, [str(w.message) for w in record if "self.accumulate(loss)" in str(w.message)]


@pytest.mark.parametrize("module", [ReturnsTheLoss, CallsManualBackward])
def test_a_module_that_never_calls_accumulate_warns_once_that_nothing_trained(module):
    model = module(steps=STEPS)
    before = [p.detach().clone() for p in model.parameters()]
    run, warned = fit_recording(model)  # 2 epochs: one warning
    assert warned == [f"{module.__name__}: epoch 0 ran training_step {PER_EPOCH} time(s) without a call to "
                      "self.accumulate(loss), so nothing trained (no optimizer step, global_step "
                      "unchanged): call self.accumulate(loss) in training_step, in place of "
                      "loss.backward() or self.manual_backward(loss)"]
    assert run.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("module", [TinyLM, SkipsLastBatch])
def test_a_module_that_calls_accumulate_does_not_warn(module):
    run, warned = fit_recording(module(steps=STEPS))  # every batch, or all but the last
    assert warned == [] and run.global_step == 6


def test_the_mixin_listed_after_the_lightning_module_is_a_one_line_type_error_naming_the_order():
    with pytest.raises(TypeError) as info:
        class Wrong(pl.LightningModule, AccumulatorMixin):
            def __init__(self) -> None:
                super().__init__(steps=STEPS)
    assert str(info.value) == (
        "class Wrong(LightningModule, AccumulatorMixin) lists LightningModule before AccumulatorMixin: "
        "put the mixin first among the bases, class Wrong(AccumulatorMixin, LightningModule), so that "
        "its __init__ takes steps= and its hooks run")


def test_the_mixin_listed_first_and_subclasses_of_such_modules_are_accepted():
    class Right(AccumulatorMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__(steps=STEPS)

    class Derived(Right):
        pass

    class Helper(AccumulatorMixin):  # a mixin on the mixin, not yet a module
        pass

    class Mixed(Helper, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__(steps=STEPS)

    for module in (Right, Derived, Mixed):
        assert module().automatic_optimization is False


# ------------------------------------------------------------------------------------ DDP
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run_ranks("tests.integrations.lightning_ranks", tmp_path_factory.mktemp("lightning_ddp"))


def test_ddp_matches_the_full_batch_with_one_all_reduce_per_window(ddp):
    ranks = scenario(ddp, "exact")
    for rank in ranks:
        for p, q in zip(rank["params"], rank["reference"], strict=True):
            torch.testing.assert_close(p, q, atol=1e-12, rtol=0)
        assert rank["global_step"] == rank["windows"] == 6
    assert ranks[0]["syncs"] == 4  # DDP's all-reduce for the 4 full windows (flushes reduce once each)
    assert scenario(ddp, "per_micro_batch")[0]["syncs"] == 10
    off = [r["off_boundary"] for r in ranks]
    assert all(not torch.equal(a, b) for a, b in zip(*off, strict=True))  # no sync off-boundary


def test_ddp_resumes_a_mid_window_checkpoint_bitwise_on_every_rank(ddp):
    whole, resumed = scenario(ddp, "exact"), scenario(ddp, "resume")
    for a, b in zip(whole, resumed, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
        assert b["global_step"] == 6


def test_ddp_refuses_to_resume_one_processs_partial_window(ddp):
    for rank in scenario(ddp, "one_process_state"):
        assert "one process's partial window; 2 ranks cannot resume it" in rank["error_message"]
        assert rank["boundary"]


def test_a_checkpoint_of_2_ranks_is_refused_on_one_device():
    from gradaccum.integrations.lightning._checkpoint import this_rank

    with pytest.raises(ValueError, match="states of 2 ranks; resume on as many, not 1"):
        this_rank({"ranks": [{}, {}]})


def test_ddp_without_manual_backward_is_silently_wrong(ddp):
    """The workaround the mixin replaces: ``accumulator.backward`` called directly never syncs."""
    ranks = scenario(ddp, "unrouted")
    assert ranks[0]["syncs"] == 0
    assert max(float((p - q).abs().max()) for p, q in zip(ranks[0]["params"], ranks[1]["params"],
                                                          strict=True)) > 1e-3


# ----------------------------------------------------------------------- docs/LIGHTNING.md
def recipe(name: str) -> str:
    found = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"no recipe {name!r} in {DOC}"
    return found.group(1)


QUIET = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
         "enable_progress_bar": False, "enable_model_summary": False}


def run_recipe(name: str) -> tuple[torch.nn.Module, Any]:
    code = recipe(name)
    assert code.count("pl.Trainer(") == 1
    namespace = {"net": tiny_lm(), "QUIET": QUIET,
                 "train_loader": DataLoader(micro_batches(PER_EPOCH), batch_size=None)}
    exec(compile(code.replace("pl.Trainer(", "pl.Trainer(**QUIET, "), f"LIGHTNING.md[{name}]", "exec"),
         namespace)
    return namespace["net"], namespace["trainer"]


def test_the_lightning_recipe_is_exact_and_lightnings_own_accumulation_is_not():
    net, run = run_recipe("lightning")
    expected = reference(epoch_windows(), scheduler="step")
    assert largest_difference(net, expected) < 1e-12
    assert run.global_step == 6
    original, _ = run_recipe("lightning-original")
    assert largest_difference(original, expected) > 1e-3


def test_the_recipe_changes_at_most_8_lines():
    before = [line.split("#")[0].rstrip() for line in recipe("lightning-original").splitlines()]
    after = [line.split("#")[0].rstrip() for line in recipe("lightning").splitlines()]
    changed = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()]
    removed = sum(line.startswith("-") for line in changed)
    added = sum(line.startswith("+") for line in changed)
    assert max(removed, added) <= 8 and added == 5, changed


def test_the_page_shows_the_benchmarks_results_file():
    # The page's table is bound to the file number by number (tests/test_doc_numbers.py); here,
    # that it cites this file, and what the file says: Lightning off, the mixin at rounding.
    from tests.doc_binding import mismatches, regions

    marked = [r for r in regions(DOC) if r.results == str(RESULTS.relative_to(ROOT))]
    assert marked and all(mismatches(r) == [] for r in marked)
    results = json.loads(RESULTS.read_text())
    lightning, gradaccum = results["diffs"].values()
    assert min(min(s) for s in lightning) > 1e-3 and max(max(s) for s in gradaccum) < 1e-12


def test_the_mixin_is_a_plain_class():
    assert not issubclass(AccumulatorMixin, torch.nn.Module)
