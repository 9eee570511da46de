"""BatchNorm under accumulation: window statistics, momentum rules, GroupNorm, reversibility."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum import Accumulator, WindowBatchNorm
from gradaccum.demos.models import build_model
from tests.reference import bitwise_equal, snapshot

F64 = torch.float64
STAT_TOL = {"atol": 1e-10, "rtol": 0.0}


def bn_net(momentum: float | None = 0.1, seed: int = 0) -> nn.Module:
    """Conv -> BN2d -> ReLU -> pool -> Linear -> BN1d: both BatchNorm kinds, float64."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=momentum), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4, momentum=momentum),
    ).to(F64)


def micro_batches(sizes: list[int], seed: int = 1) -> list[torch.Tensor]:
    """Micro-batches whose means differ (an offset each), so the spread between them matters."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2, 5, 5, generator=g, dtype=F64) * (1 + i) + 3 * i for i, n in enumerate(sizes)]


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    return [t.clone() for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for t in (m.running_mean, m.running_var, m.num_batches_tracked)]


def assert_stats_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **(STAT_TOL if x.is_floating_point() else {}))


def bn_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def record_inputs(model: nn.Module) -> list[list[torch.Tensor]]:
    """Record every training input of each BatchNorm layer, in order."""
    seen: list[list[torch.Tensor]] = []
    for layer in bn_layers(model):
        inputs: list[torch.Tensor] = []
        seen.append(inputs)
        layer.register_forward_pre_hook(lambda m, args, inputs=inputs: inputs.append(args[0].detach()))
    return seen


def full_batch_stats(layers: list[nn.Module], inputs: list[list[torch.Tensor]], windows: list[int]
                     ) -> list[torch.Tensor]:
    """The reference: for each layer, one plain BatchNorm forward per window of the concatenated
    inputs that the layer saw in that window."""
    for layer, seen in zip(layers, inputs, strict=True):
        layer.train()
        start = 0
        for n in windows:
            layer(torch.cat(seen[start:start + n]))
            start += n
    return [t for layer in layers for t in running_stats(layer)]


def train_windows(model: nn.Module, windows: list[list[torch.Tensor]], window_bn: bool,
                  flush: bool = False) -> tuple[nn.Module, list[list[torch.Tensor]], Accumulator]:
    """Feed each window's micro-batches through an Accumulator (SGD) with N = len(windows[0]);
    returns the model, each BatchNorm's recorded inputs, and the accumulator."""
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.05), steps=len(windows[0]))
    if window_bn:
        model = gradaccum.window_batchnorm(model, acc)
    inputs = record_inputs(model)
    model.train()
    for window in windows:
        for xb in window:
            acc.backward(model(xb).pow(2).mean())
    if flush:
        acc.flush()
    return model, inputs, acc


# ------------------------------------------------------------------ window BatchNorm: exactness
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [3, 5, 2, 6]])
def test_window_running_stats_equal_full_batch_forward(momentum: float | None, sizes: list[int]) -> None:
    windows = [micro_batches(sizes, seed=1), micro_batches(sizes, seed=2)]
    model = bn_net(momentum)
    fresh = copy.deepcopy(bn_layers(model))
    model, inputs, _ = train_windows(model, windows, window_bn=True)
    assert_stats_close(running_stats(model), full_batch_stats(fresh, inputs, [len(sizes)] * 2))
    assert int(model[1].num_batches_tracked) == 2


def test_plain_batchnorm_running_stats_miss_the_full_batch() -> None:
    # The negative twin: the same loop and check with plain BatchNorm layers.
    model = bn_net()
    fresh = copy.deepcopy(bn_layers(model))
    model, inputs, _ = train_windows(model, [micro_batches([4, 4, 4, 4])], window_bn=False)
    got, want = running_stats(model), full_batch_stats(fresh, inputs, [4])
    assert not torch.allclose(got[1], want[1], **STAT_TOL)  # running_var misses the spread
    assert int(got[2]) == 4 != int(want[2])


def test_window_normalizes_each_micro_batch_by_its_own_statistics() -> None:
    plain = bn_net()
    window = gradaccum.to_window_batchnorm(copy.deepcopy(plain))
    for xb in micro_batches([3, 5]):
        torch.testing.assert_close(window(xb), plain(xb), atol=1e-12, rtol=0)


def test_running_stats_are_unchanged_mid_window() -> None:
    model = bn_net()
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.05), steps=3)
    model = gradaccum.window_batchnorm(model, acc)
    before = running_stats(model)
    for xb in micro_batches([4, 4]):
        acc.backward(model(xb).pow(2).mean())
    assert all(torch.equal(a, b) for a, b in zip(running_stats(model), before, strict=True))
    assert model[1].pending_count == 8 * 25


def test_flushed_window_commits_its_micro_batches() -> None:
    model = bn_net()
    fresh = copy.deepcopy(bn_layers(model))
    window = micro_batches([4, 4, 4])
    model, inputs, acc = train_windows(model, [[*window, window[0]], window], window_bn=True, flush=True)
    assert acc.optimizer_steps == 2
    assert_stats_close(running_stats(model), full_batch_stats(fresh, inputs, [4, 3]))


def test_discarded_window_leaves_no_statistics_behind() -> None:
    model = bn_net()
    fresh = copy.deepcopy(bn_layers(model))
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.05), steps=2)
    model = gradaccum.window_batchnorm(model, acc)
    inputs = record_inputs(model)
    acc.backward(model(micro_batches([4], seed=5)[0]).pow(2).mean())
    acc.discard()
    assert model[1].pending_count == 0
    for seen in inputs:
        seen.clear()
    for xb in micro_batches([4, 4], seed=6):
        acc.backward(model(xb).pow(2).mean())
    assert_stats_close(running_stats(model), full_batch_stats(fresh, inputs, [2]))


def test_conversion_mid_window_is_refused() -> None:
    model = bn_net()
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.05), steps=2)
    acc.backward(model(micro_batches([4])[0]).pow(2).mean())
    with pytest.raises(ValueError, match="micro_step 1"):
        gradaccum.window_batchnorm(model, acc)
    assert isinstance(model[1], nn.BatchNorm2d)


def test_eval_mode_is_unaffected() -> None:
    plain = bn_net()
    plain.train()
    plain(micro_batches([6])[0])  # non-trivial running statistics
    x = micro_batches([5], seed=3)[0]
    for convert in (gradaccum.to_window_batchnorm, lambda m: gradaccum.scale_momentum_(m, 4) and m):
        model = convert(copy.deepcopy(plain)).eval()
        before = running_stats(model)
        torch.testing.assert_close(model(x), plain.eval()(x), atol=0, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip(running_stats(model), before, strict=True))
    window = gradaccum.to_window_batchnorm(copy.deepcopy(plain)).eval()
    window(x)
    assert window[1].pending_count == 0


# ------------------------------------------------------------------ momentum rules
def test_compound_momentum_steps_equal_one_full_step_for_constant_inputs() -> None:
    x = micro_batches([8])[0]
    full, micro = bn_net(), bn_net()
    full.train()
    full(x)
    assert gradaccum.scale_momentum_(micro, 4, "compound") == 2
    micro.train()
    for _ in range(4):
        micro(x)
    got, want = running_stats(micro), running_stats(full)
    for i in (0, 1, 3, 4):  # running mean and var of both layers
        torch.testing.assert_close(got[i], want[i], **STAT_TOL)


def test_linear_momentum_decays_less_than_one_full_step() -> None:
    # The negative twin of the compound rule: m / N leaves more of the old statistics.
    x = micro_batches([8])[0]
    full, micro = bn_net(), bn_net()
    full.train()
    full(x)
    gradaccum.scale_momentum_(micro, 4, "linear")
    micro.train()
    for _ in range(4):
        micro(x)
    assert not torch.allclose(running_stats(micro)[0], running_stats(full)[0], **STAT_TOL)
    assert micro[1].momentum == pytest.approx(0.025)


def test_momentum_scaling_rescales_from_the_original_and_restores() -> None:
    model = bn_net()
    gradaccum.scale_momentum_(model, 2)
    gradaccum.scale_momentum_(model, 4)
    assert model[1].momentum == pytest.approx(gradaccum.scaled_momentum(0.1, 4))
    assert gradaccum.restore_momentum_(model) == 2
    assert model[1].momentum == 0.1 and model[6].momentum == 0.1
    assert gradaccum.restore_momentum_(model) == 0


def test_momentum_scaling_leaves_cumulative_and_window_layers_alone() -> None:
    assert gradaccum.scale_momentum_(bn_net(momentum=None), 4) == 0
    assert gradaccum.scale_momentum_(gradaccum.to_window_batchnorm(bn_net()), 4) == 0


def test_bad_momentum_arguments_raise_before_any_change() -> None:
    model = bn_net()
    model[6].momentum = 1.5  # invalid, found after the first layer
    with pytest.raises(ValueError, match="momentum"):
        gradaccum.scale_momentum_(model, 4)
    assert model[1].momentum == 0.1
    with pytest.raises(ValueError, match="rule"):
        gradaccum.scale_momentum_(model, 4, "cubic")
    with pytest.raises(TypeError, match="steps"):
        gradaccum.scale_momentum_(model, 2.0)


def test_scaled_momentum_values() -> None:
    m, n = 0.1, 16
    assert (1 - gradaccum.scaled_momentum(m, n)) ** n == pytest.approx(1 - m, abs=1e-15)
    assert gradaccum.scaled_momentum(m, n, "linear") == m / n
    assert gradaccum.scaled_momentum(m, 1) == m and gradaccum.scaled_momentum(0.0, n) == 0.0


# ------------------------------------------------------------------ conversions
def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("convert", [gradaccum.to_groupnorm, gradaccum.to_window_batchnorm])
def test_conversions_keep_parameters_run_and_revert(convert: object) -> None:
    original = build_model("cnn-bn", seed=0)
    original.train()
    original(torch.randn(4, 1, 28, 28))
    state = copy.deepcopy(original.state_dict())
    params = list(original.parameters())
    model = convert(original)  # type: ignore[operator]
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert n_params(model) == sum(p.numel() for p in params)
    assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    restored = gradaccum.restore_batchnorm(model)
    assert [type(m) for m in restored.modules()] == [type(m) for m in build_model("cnn-bn").modules()]
    restored.eval()
    got = restored.state_dict()
    assert got.keys() == state.keys()
    if convert is gradaccum.to_groupnorm:  # GroupNorm keeps the BatchNorm's statistics aside
        assert all(torch.equal(got[k], v) for k, v in state.items())


def test_groupnorm_output_does_not_depend_on_micro_batching() -> None:
    model = gradaccum.to_groupnorm(bn_net(), groups=1)
    x = torch.cat(micro_batches([3, 5]))
    torch.testing.assert_close(torch.cat([model(xb) for xb in x.split([3, 5])]), model(x),
                               atol=1e-12, rtol=0)


def test_groupnorm_groups_default_and_validation() -> None:
    model = build_model("cnn-bn", seed=0)
    converted = gradaccum.to_groupnorm(model)
    assert [m.num_groups for m in converted.modules() if isinstance(m, nn.GroupNorm)] == [16, 32]
    fresh = build_model("cnn-bn", seed=0)
    with pytest.raises(ValueError, match="groups=3"):
        gradaccum.to_groupnorm(fresh, groups=3)
    assert isinstance(fresh[1], nn.BatchNorm2d)  # nothing converted
    with pytest.raises(TypeError, match="groups"):
        gradaccum.to_groupnorm(fresh, groups=2.0)  # type: ignore[arg-type]


def test_a_batchnorm_root_and_shared_layers_convert() -> None:
    root = gradaccum.to_window_batchnorm(nn.BatchNorm1d(3))
    assert isinstance(root, WindowBatchNorm)
    assert isinstance(gradaccum.restore_batchnorm(root), nn.BatchNorm1d)
    shared = nn.BatchNorm1d(3)
    model = gradaccum.to_groupnorm(nn.Sequential(shared, nn.ReLU(), shared))
    assert model[0] is model[2] and isinstance(model[0], nn.GroupNorm)


def test_lazy_uninitialized_batchnorm_is_refused() -> None:
    with pytest.raises(ValueError, match="lazy"):
        gradaccum.to_window_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))


def test_an_optimizer_built_before_conversion_still_trains_the_layer() -> None:
    model = bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = gradaccum.to_groupnorm(model)
    before = snapshot(model)
    model(micro_batches([4])[0]).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model[1].weight, before[1])
    assert not bitwise_equal(model, before)


def test_float32_window_stats_match_the_full_batch_to_float_tolerance() -> None:
    model = bn_net().float()
    fresh = copy.deepcopy(bn_layers(model))
    windows = [[x.float() for x in micro_batches([8, 8, 8, 8])]]
    model, inputs, _ = train_windows(model, windows, window_bn=True)
    for got, want in zip(running_stats(model), full_batch_stats(fresh, inputs, [4]), strict=True):
        torch.testing.assert_close(got, want)


def test_window_and_momentum_rules_train_the_same_weights_as_plain_batchnorm() -> None:
    # The training forward never reads the running statistics: only evaluation differs.
    windows = [micro_batches([4, 4]), micro_batches([4, 4], seed=2)]
    plain, _, _ = train_windows(bn_net(), windows, window_bn=False)
    window, _, _ = train_windows(bn_net(), windows, window_bn=True)
    scaled = bn_net()
    gradaccum.scale_momentum_(scaled, 2)
    scaled, _, _ = train_windows(scaled, windows, window_bn=False)
    assert bitwise_equal(window, snapshot(plain)) and bitwise_equal(scaled, snapshot(plain))
