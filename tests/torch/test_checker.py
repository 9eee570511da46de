"""The equivalence checker: full batch against N micro-batches, per tensor, with the culprits named."""

import pytest
import torch
from torch import nn

from gradaccum.torch.check.checker import check_equivalence


class Center(nn.Module):
    """Subtracts the batch mean: each sample's output depends on the others."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Counter(nn.Module):
    """Counts its forwards in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x


class Noise(nn.Module):
    """Adds Gaussian noise drawn in the forward."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, x, z):
        return torch.tanh(self.a(x) + self.b(z))


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def with_layer(layer):
    return lambda: nn.Sequential(nn.Linear(4, 8), layer, nn.Tanh(), nn.Linear(8, 3))


def check(factory, steps=2, **kw):
    return check_equivalence(factory, (4,), steps, micro_batch=4, **kw)


def names(report):
    return [(h.module, h.kind) for h in report.hazards]


def test_mlp_is_equivalent_to_float64_rounding():
    report = check(mlp, steps=4)
    assert report.equivalent and report.hazards == []
    assert [d.name for d in report.diffs] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(d.ok and d.updated and d.rel < 1e-12 for d in report.diffs)
    assert "EQUIVALENT: all 4 tensors agree" in str(report)


def test_batchnorm_in_training_is_flagged_and_named():
    report = check(with_layer(nn.BatchNorm1d(8)))
    assert not report.equivalent
    assert names(report) == [("1", "BatchNorm1d")]
    assert "docs/BATCHNORM.md" in report.hazards[0].fix
    assert "running_mean" in report.hazards[0].problem
    rows = {d.name: d for d in report.diffs}
    assert not rows["0.weight"].ok and rows["0.weight"].rel > 1e-3  # the gradient differs
    assert rows["1.num_batches_tracked"].max_abs == 1.0  # two updates instead of one
    text = str(report)
    assert "NOT EQUIVALENT" in text and "1 (BatchNorm1d)" in text


def test_batchnorm_without_running_stats_is_still_flagged():
    report = check(with_layer(nn.BatchNorm1d(8, track_running_stats=False)))
    assert not report.equivalent and names(report) == [("1", "BatchNorm1d")]


def test_dropout_layers_are_flagged_and_named():
    def factory():
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3),
                             nn.Linear(8, 3))

    report = check(factory)
    assert not report.equivalent
    assert names(report) == [("1", "Dropout"), ("3", "Dropout")]
    assert any(not d.ok for d in report.diffs)
    assert "none exact" in report.hazards[0].fix


def test_a_single_dropout_matching_by_chance_is_not_called_equivalent():
    # One layer on the CPU generator draws the full batch's mask in micro-batch order: the numbers
    # agree, but only by accident of the random stream.
    report = check(with_layer(nn.Dropout(0.5)))
    assert names(report) == [("1", "Dropout")] and not report.equivalent
    assert "agree here" in str(report)


def test_dropout_with_p_0_is_equivalent():
    # The negative twin of the dropout check: no mask, nothing to flag.
    report = check(with_layer(nn.Dropout(0.0)))
    assert report.equivalent and report.hazards == []


def test_a_module_mixing_the_samples_of_its_batch_is_named():
    report = check(with_layer(Center()))
    assert not report.equivalent and names(report) == [("1", "Center")]
    assert "other samples" in report.hazards[0].problem


def test_a_buffer_changed_in_forward_is_named():
    report = check(with_layer(Counter()))
    assert names(report) == [("1", "Counter")]
    assert "calls" in report.hazards[0].problem and "register_boundary_hook" in report.hazards[0].fix
    assert not {d.name: d for d in report.diffs}["1.calls"].ok


def test_a_module_drawing_random_numbers_is_named():
    report = check(with_layer(Noise()))
    assert names(report) == [("1", "Noise")] and not report.equivalent


def test_only_the_innermost_culprit_is_named():
    report = check(lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
                                         nn.Linear(8, 3)))
    assert names(report) == [("0.1", "BatchNorm1d")]


def test_zero_tolerance_sees_rounding():
    # The tolerance is what decides: with none, float rounding of another summation order shows.
    report = check(mlp, steps=4, atol=0.0, rtol=0.0, dtype=torch.float32)
    assert not report.equivalent and report.hazards == []


def test_float32_defaults_accept_rounding():
    report = check(mlp, steps=4, dtype=torch.float32)
    assert report.equivalent and (report.settings["atol"], report.settings["rtol"]) == (1e-6, 1e-4)


def test_sample_batch_with_class_targets():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 4, generator=g), torch.randint(0, 3, (12,), generator=g)
    report = check_equivalence(mlp, x, 3, targets=y, loss="cross-entropy")
    assert report.equivalent and report.settings["batch"] == 12


def test_a_model_with_two_inputs():
    report = check_equivalence(TwoInputs, (torch.randn(8, 4), torch.randn(8, 2)), 4)
    assert report.equivalent


class HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_are_reported_as_not_updated():
    report = check_equivalence(HalfUsed, (4,), 2)
    assert {d.name for d in report.diffs if not d.updated} == {"unused.weight", "unused.bias"}
    assert "no gradient reached unused.weight" in str(report)


def test_the_callers_model_and_rng_are_left_alone():
    model = with_layer(nn.BatchNorm1d(8))()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    check_equivalence(model, (4,), 2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_same_seed_same_report():
    a, b = check(with_layer(nn.Dropout(0.5))), check(with_layer(nn.Dropout(0.5)))
    assert a.diffs == b.diffs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sample": torch.randn(9, 4), "steps": 2}, ValueError, "steps=2"),
        ({"sample": (4,), "steps": 0}, ValueError, "steps"),
        ({"sample": "4", "steps": 2}, TypeError, "sample"),
        ({"sample": (4,), "steps": 2, "loss": "l1"}, ValueError, "loss"),
        ({"sample": (torch.randn(8, 4), torch.randn(6, 2)), "steps": 2}, ValueError, "batch"),
        ({"sample": (4,), "steps": 2, "atol": -1.0}, ValueError, "atol"),
        ({"sample": (4,), "steps": 2, "rtol": float("nan")}, ValueError, "rtol"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        check_equivalence(mlp, **kwargs)
