"""The GPU check (scripts/gpu_check.sh = python -m gradaccum.bench.gpu): its CPU smoke runs every
check's code, and its runner reports crashes, time-outs and missed targets as documented."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradaccum
from gradaccum.bench.gpu.host_sync import sync_guard
from gradaccum.bench.gpu.report import SMOKE_VERDICT, Row, exit_status, verdict
from gradaccum.bench.gpu.run import CHECKS, CheckSpec, main, run_check
from gradaccum.bench.report import kept_sections

CPU = torch.device("cpu")
SRC = str(Path(gradaccum.__file__).resolve().parents[1])
# Checks whose smoke figures are exact on a CPU, so a missed target there means broken code. Not
# judged: the overhead (a tiny CPU timing).
EXACT_ON_CPU = ("host_sync", "fp16_scaler", "oom", "planner", "accum_dtype", "compiled", "ddp",
                "contrastive", "contrastive_tiled")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, "-m", "gradaccum.bench.gpu", "--smoke", "--out", str(out)],
                          env={**os.environ, "PYTHONPATH": SRC}, capture_output=True,
                          text=True)
    return proc, out, json.loads((out / "report.json").read_text())


@pytest.mark.slow  # the whole smoke, or a check left to hang for its time box
def test_smoke_exits_0_and_prints_one_smoke_row_per_check(smoke):
    proc, out, _ = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(CHECKS) == 10
    for row, spec in zip(rows, CHECKS, strict=True):
        assert spec.title.replace("|", "\\|") in row, row
        assert row.endswith((f"| {SMOKE_VERDICT} |", f"| {SMOKE_VERDICT}, FAIL |")), row
    assert (out / "report.md").read_text().count(SMOKE_VERDICT) == 10


@pytest.mark.slow  # the whole smoke, or a check left to hang for its time box
def test_smoke_checks_with_exact_cpu_figures_meet_their_targets(smoke):
    _, _, report = smoke
    checks = {c["name"]: c for c in report["checks"]}
    assert [c["status"] for c in report["checks"]] == ["done"] * 10
    for name in EXACT_ON_CPU:
        assert checks[name]["met"] is True, (name, checks[name]["measured"])
    assert checks["overhead"]["met"] is None
    skipped = checks["fp16_scaler"]["raw"]["skipped"]  # the scale really had to back off
    assert skipped["gradaccum"] > 0 and skipped["gradaccum, n_items"] <= skipped["gradaccum"]


@pytest.mark.slow  # the whole smoke, or a check left to hang for its time box
def test_smoke_raw_numbers_are_those_of_the_checks(smoke):
    _, _, report = smoke
    raw = {c["name"]: c["raw"] for c in report["checks"]}
    assert raw["oom"]["ooms"] == 2 and raw["oom"]["settled"] == 4 and raw["oom"]["params_equal"]
    assert raw["compiled"]["graphs"] == 1 and raw["compiled"]["backend"] == "aot_eager"
    assert raw["ddp"]["mean"]["grad_all_reduces_per_window"] == [[1, 1, 1], [1, 1, 1]]
    assert raw["accum_dtype"]["buffer_bytes"] == raw["accum_dtype"]["fp32_copy_bytes"]
    peaks, errors = raw["contrastive"]["peak_bytes"], raw["contrastive"]["relative_l2_from_full_batch"]
    assert raw["contrastive"]["chunks"] == 8 and peaks["backward_cached"] < peaks["full batch"] / 2
    assert errors["backward_cached"] < errors["naive"]
    assert raw["host_sync"]["canary_caught"] and not any(raw["host_sync"]["syncs"].values())
    tiled = raw["contrastive_tiled"]
    assert tiled["tiled"]["pairs"] == 2048 == 2 * tiled["dense"]["pairs"]  # the smoke's sizes, both ran
    assert tiled["grad_rel_l2"] < 5e-2


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the child gets this sys.path

    def spec(what, budget_s=120):
        return CheckSpec("fake", "gpu_check_fake", "a fake check", budget_s, env={"FAKE_CHECK": what})

    return spec


@pytest.mark.parametrize("what, status, exit_code", [("raise", "crashed", 1), ("exit", "crashed", 1),
                                                     ("", "done", 0)])
def test_a_crash_exits_1_keeps_its_numbers_and_a_missed_target_is_a_fail_row(tmp_path, fake, what,
                                                                              status, exit_code):
    row = run_check(fake(what), tmp_path, "cpu", 120)
    assert (row.status, exit_status([row]), row.raw) == (status, exit_code, {"before": "recorded"})
    if what == "raise":
        assert row.error == "ValueError: boom" and "Traceback" in Path(row.log).read_text()
    elif what == "exit":
        assert row.error == "exit status 3"
    else:
        assert (row.measured, row.met, verdict(row)) == ("3 apples", False, f"{SMOKE_VERDICT}, FAIL")
        row.smoke = False
        assert verdict(row) == "FAIL"


@pytest.mark.slow  # the whole smoke, or a check left to hang for its time box
def test_a_check_past_its_time_box_is_killed_and_its_row_says_so(tmp_path, fake):
    row = run_check(fake("hang", 5), tmp_path, "cpu", 5)
    assert row.status == "timeout"
    assert verdict(row) == "TIMEOUT after 5 s"
    assert exit_status([row]) == 1  # in the smoke: it hung
    row.smoke = False
    assert exit_status([row]) == 0  # on a GPU: its row says so, and the other checks ran


def test_unknown_check_name_is_bad_usage(capsys):
    assert main(["--only", "overhead,nope"]) == 2
    assert "unknown check(s) ['nope']" in capsys.readouterr().err


class ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()  # a host read inside the backward: the guard must see it
        return grad


def test_smoke_sync_guard_sees_host_reads_in_backward_but_not_of_host_inputs():
    x = torch.ones(3, requires_grad=True)
    count = torch.tensor(3)
    with sync_guard(CPU, [count]) as (syncs, input_reads):
        int(count)
        ReadsInBackward.apply(x).sum().backward()
    assert len(input_reads) == 1 and len(syncs) == 1 and "_local_scalar_dense" in syncs[0]
    with sync_guard(CPU) as (syncs, _):
        (x * 2).sum().backward()  # the negative twin: no read
    assert syncs == []


def test_verdicts():
    row = Row("x", "x", "done", smoke=False, met=True)
    assert verdict(row) == "PASS"
    row.met = None
    assert verdict(row) == "measured (no target)"
    assert verdict(Row("x", "x", "crashed", smoke=True, error="E: m")) == "CRASH (E: m)"


def test_benchmarks_doc_has_the_gpu_section_that_regenerating_it_keeps():
    text = (Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md").read_text()
    kept = kept_sections(text)
    assert kept and kept[0] == "## GPU" and "bash scripts/gpu_check.sh" in "\n".join(kept)
    assert all(f"| {i}. " in "\n".join(kept) for i in range(1, 10))  # a row per check


FLOOR = """
import importlib, pkgutil, sys
import gradaccum.bench

def cli():
    return sorted(m for m in sys.modules if m.startswith("gradaccum.cli"))

for m in pkgutil.walk_packages(gradaccum.bench.__path__, "gradaccum.bench."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
print(cli())
import gradaccum.cli.info  # the negative twin: the check sees an import of cli
print(cli())
"""


def test_the_bench_floor_imports_nothing_from_cli():
    out = subprocess.run([sys.executable, "-c", FLOOR], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": SRC}, check=True)
    before, after = out.stdout.splitlines()
    assert before == "[]" and "'gradaccum.cli.info'" in after
