"""The memory probes: measured peaks against known allocations, and the plan against a measured peak."""

import pytest
import torch
from torch import nn

from gradaccum.demos.models import build_model
from gradaccum.torch.memory.probe import estimate_memory, measure_peak, tensor_bytes

MiB = 2**20


class Ballast(nn.Module):
    """A linear layer whose graph also holds ``floats`` float32 values per sample until backward."""

    def __init__(self, floats: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(()))
        self.floats = floats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = torch.ones(x.shape[0], self.floats)
        return self.lin(x) + (pad * self.w).sum() * 0  # mul saves pad for w's gradient


def test_measured_peak_grows_by_the_bytes_a_sample_holds():
    model = Ballast(MiB // 4)  # 1 MiB per sample
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    est = estimate_memory(model, opt, (8,), probes=(2, 6))
    # pad (1 MiB) and pad * w (1 MiB) are alive together in the forward.
    assert 2 * MiB <= est.activation_bytes_per_sample <= 2.05 * MiB


def test_static_figures_are_the_tensors_bytes():
    model = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    est = estimate_memory(model, opt, (32,), probes=(2, 4))
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.param_bytes == 4 * n_params + n_buffers
    assert est.grad_bytes == 4 * n_params
    assert est.optimizer_bytes == 2 * 4 * n_params + 4 * len(list(model.parameters()))  # + steps


def test_prediction_is_within_ten_percent_of_the_measured_peak_on_bench_cnn():
    torch.manual_seed(0)
    model = build_model("bench-cnn")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    est = estimate_memory(model, opt, (3, 64, 64), probes=(2, 4))
    assert 3 * MiB < est.activation_bytes_per_sample < 5 * MiB  # "about 4 MB per sample"
    measured = measure_peak(model, opt, (3, 64, 64), 10, steps=2)  # a size the probes did not use
    assert abs(est.peak(10) - measured) <= 0.1 * measured


def test_tensor_bytes_counts_shared_storage_once():
    t = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes([t, t[2:], t.view(2, 5)]) == 80


@pytest.mark.parametrize("probes", [(0, 4), (4, 4)])
def test_bad_probe_sizes_are_rejected_before_any_work(probes):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="probe micro-batch"):
        estimate_memory(model, opt, (2,), probes=probes)
    assert opt.state_dict()["state"] == {}


def test_model_without_parameters_is_a_clear_error():
    with pytest.raises(ValueError, match="no parameters"):
        measure_peak(nn.Identity(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), (2,), 2)


def _runs_out_above(model: nn.Module, size: int, error: Exception | None = None) -> nn.Module:
    """Fault injection: the model's forward raises ``error`` (default: a CUDA OOM) on a batch of
    more than ``size``."""
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if args[0].shape[0] > size:
            raise error or torch.OutOfMemoryError("CUDA out of memory (simulated)")
    model.register_forward_pre_hook(hook)
    return model


def test_several_probes_fit_the_least_squares_line_of_their_peaks():
    model = Ballast(MiB // 4)  # 2 MiB per sample, as above: a line every probe lies on
    est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), (8,), probes=(8, 2, 4))
    assert est.probes == (2, 4, 8)
    assert 2 * MiB <= est.activation_bytes_per_sample <= 2.05 * MiB


def test_a_probe_that_runs_out_of_memory_ends_the_probing_with_the_sizes_that_fit():
    def estimate(probes: tuple[int, ...], fail_above: int | None):
        torch.manual_seed(0)
        model = build_model("cnn")
        if fail_above is not None:
            _runs_out_above(model, fail_above)
        return estimate_memory(model, torch.optim.Adam(model.parameters()), (1, 28, 28), probes)

    fitted = estimate((2, 4, 8, 16), fail_above=8)
    assert fitted.probes == (2, 4, 8)
    clean = estimate((2, 4, 8), fail_above=None)  # the same three sizes, nothing running out
    assert fitted.activation_bytes_per_sample == pytest.approx(clean.activation_bytes_per_sample, rel=1e-9)
    assert fitted.peak(64) == pytest.approx(clean.peak(64), rel=1e-9)


def test_an_oom_before_two_probes_or_another_error_is_raised():
    model = _runs_out_above(build_model("cnn"), 2)
    with pytest.raises(torch.OutOfMemoryError):  # 4 runs out: one size is no line
        estimate_memory(model, torch.optim.Adam(model.parameters()), (1, 28, 28), (2, 4, 8))
    model = _runs_out_above(build_model("cnn"), 4, error=RuntimeError("shape mismatch (simulated)"))
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not an OOM: never swallowed
        estimate_memory(model, torch.optim.Adam(model.parameters()), (1, 28, 28), (2, 4, 8))


@pytest.mark.parametrize(("probes", "match"), [((4,), "at least two"), ((2, 4, 2), "must differ"),
                                               ("24", "sequence of micro-batch sizes")])
def test_bad_probe_sets_are_rejected_before_any_work(probes, match):
    model = nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError), match=match):
        estimate_memory(model, torch.optim.SGD(model.parameters(), lr=1.0), (2,), probes=probes)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
