"""backward_cached through the integrations: the Lightning mixin's ``accumulate_cached`` (and the
accumulator's ``backward_cached`` called from ``training_step``) and the Accelerate adapter, on one
device and on 2 gloo ranks, against the full batch (float64, 1e-12)."""

from __future__ import annotations

import copy

import pytest
import torch

import gradaccum
from tests.contrastive import Towers, clip_loss, pairs
from tests.integrations.cached_ranks import global_batches
from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's advice (workers, loggers, ...)


def largest(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a, b, strict=True))


def windows(batches, steps=2):
    return [batches[i:i + steps] for i in range(0, len(batches), steps)]


@pytest.mark.parametrize("direct", [False, True], ids=["accumulate_cached", "accumulator.backward_cached"])
def test_lightning_one_device_matches_the_full_batch(direct):
    pytest.importorskip("pytorch_lightning")
    from tests.integrations.lightning_common import ClipPairs, Loader, clip_reference, trainer

    batches = [pairs(12, seed=70 + b) for b in range(5)]  # windows of 2, 2 and a flushed 1
    model = ClipPairs(steps=2, direct=direct)
    run = trainer(max_epochs=1)
    run.fit(model, train_dataloaders=Loader(batches))
    want = clip_reference(windows(batches))
    assert largest(model.towers.parameters(), want.parameters()) < 1e-12
    assert model.accumulator.optimizer_steps == 3 and model.accumulator.micro_step == 0
    assert run.global_step == 3


def test_accelerate_one_process_sets_sync_gradients_and_flushes_at_the_end():
    accelerate = pytest.importorskip("accelerate")
    import gradaccum.integrations.accelerate as adapter
    from tests.integrations.lightning_common import clip_reference

    batches = [pairs(12, seed=80 + b) for b in range(3)]
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2)
    model = Towers()
    base = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             loader)
    acc = adapter.Accumulator(accelerator, opt, model=model)
    flags = []
    for batch in loader:
        acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale),
                            gradaccum.chunks(batch, 5))
        flags.append(accelerator.sync_gradients)
    assert flags == [False, True, True]  # a window of 2, then the last batch flushed
    assert largest(model.parameters(), clip_reference(windows(batches)).parameters()) < 1e-12
    assert largest(base.parameters(), Towers().parameters()) == 0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("accelerate")
    return run_ranks("tests.integrations.cached_ranks", tmp_path_factory.mktemp("cached"), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lightning", "lightning_direct"])
def test_lightning_ddp_matches_one_process_on_the_global_batch(ranks, name):
    from tests.integrations.lightning_common import clip_reference

    want = list(clip_reference(windows(global_batches())).parameters())
    for r in scenario(ranks, name):
        assert largest(r["params"], want) < 1e-12
        assert r["syncs"] == 2 and r["global_step"] == 2  # one all-reduce per window


@pytest.mark.slow
def test_accelerate_two_processes_match_one_process_on_the_global_batch(ranks):
    from tests.integrations.lightning_common import clip_reference

    want = list(clip_reference(windows(global_batches())).parameters())
    for r in scenario(ranks, "accelerate"):
        assert r["world"] == 2 and r["type"].endswith("MULTI_CPU")
        assert largest(r["params"], want) < 1e-12
        assert r["syncs"] == 2 and r["flags"] == [False, True, False, True]
