"""``gradaccum plan``: the report, the recommendation, the check, and clear errors."""

import re

import pytest

from gradaccum.cli import main
from gradaccum.cli.plan import load_model

FAST = ["--model", "cnn", "--probe", "2", "4", "--device", "cpu"]


def test_plan_reports_figures_recommends_and_checks_within_ten_percent(capsys):
    assert main(["plan", *FAST, "--global-batch", "64", "--budget", "12MiB", "--check", "24",
                 "--check-steps", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("parameters+buffers", "gradients", "optimizer state", "per sample", "floor"):
        assert label in out
    micro, steps = map(int, re.search(r"micro-batch (\d+) x (\d+) steps", out).groups())
    assert micro * steps >= 64 and micro * (steps - 1) < 64
    predicted, measured = map(int, re.search(r"predicted .*\((\d+) B\), measured .*\((\d+) B\)",
                                             out).groups())
    assert abs(predicted - measured) <= 0.1 * measured


@pytest.mark.parametrize("batch", [["--global-batch", "64"], []])
def test_budget_below_the_floor_is_a_clear_error(batch, capsys):
    # Without --global-batch too: a table of "no" in every row would be exit 0 for a budget
    # nothing fits.
    assert main(["plan", *FAST, *batch, "--budget", "1KiB"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert re.search(r"error: budget 1\.0 KiB .* is below the floor", err)


def test_budget_above_the_floor_without_a_global_batch_reports_the_table(capsys):
    # The negative twin: a budget that fits exits 0 and marks each row.
    assert main(["plan", *FAST, "--budget", "1GiB"]) == 0
    assert "  yes" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--probe", "0", "4"], "argument --probe: must be an integer >= 1, got '0'"),
    (["--check", "0"], "argument --check: must be an integer >= 1, got '0'"),
    (["--global-batch", "-8"], "argument --global-batch: must be an integer >= 1, got '-8'"),
])
def test_bad_arguments_exit_with_a_message(args, message, capsys):
    assert main(["plan", *args]) == 2  # argparse's own error, returned as main()'s exit code
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--probe", "4", "4"], "two or more different micro-batch sizes"),
    (["--budget", "lots"], "budget must be a size"),
    (["--model", "no_such_module:factory"], "No module named 'no_such_module'"),
    (["--model", "resnet"], "--model must be one of"),
    (["--model", "gradaccum:__version__"], "not a callable factory"),
    (["--input-shape", "3,0,2"], "--input-shape must be integers >= 1"),
    (["--model", "gradaccum.demos.models:cnn"], "--input-shape is required"),
])
def test_bad_values_are_named_before_any_probe(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_model_from_module_factory():
    model, shape = load_model("gradaccum.demos.models:cnn")
    assert shape is None and sum(p.numel() for p in model.parameters()) > 0
    with pytest.raises(TypeError, match=r"returned a dict, not a torch\.nn\.Module"):
        load_model("builtins:dict")


def test_check_without_a_size_measures_the_recommendation(capsys):
    assert main(["plan", *FAST, "--global-batch", "48", "--budget", "6MiB", "--check"]) == 0
    out = capsys.readouterr().out
    micro, steps = re.search(r"recommended .*: micro-batch (\d+) x (\d+) steps", out).groups()
    assert f"check at micro-batch {micro} x {steps} steps" in out


def test_check_of_a_recommendation_needs_a_global_batch(capsys):
    assert main(["plan", *FAST, "--check"]) == 2
    assert "--check without a size" in capsys.readouterr().err


def test_the_cli_default_probes_are_the_library_default():
    import argparse
    import inspect

    from gradaccum.cli.plan import add_parser
    from gradaccum.core.memory import DEFAULT_PROBES
    from gradaccum.torch.memory.probe import estimate_memory

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["plan"]).probe == list(DEFAULT_PROBES)
    assert inspect.signature(estimate_memory).parameters["probes"].default == DEFAULT_PROBES


def test_probes_that_run_out_of_memory_are_named_in_the_report(monkeypatch, capsys):
    import torch

    import gradaccum.cli.plan as plan

    def runs_out_above_8(spec, seed=0):
        model, shape = load_model(spec, seed)
        def hook(module, args):
            if args[0].shape[0] > 8:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        model.register_forward_pre_hook(hook)
        return model, shape

    monkeypatch.setattr(plan, "load_model", runs_out_above_8)
    assert main(["plan", "--model", "cnn", "--device", "cpu", "--probe", "2", "4", "8", "16", "32"]) == 0
    out = capsys.readouterr().out
    assert "probe windows of 2 micro-batches at 2, 4 and 8; 16 and 32 ran out of memory" in out


@pytest.mark.parametrize("probes", [["4"], ["4", "8", "4"]])
def test_fewer_than_two_different_probes_is_a_usage_error(probes, capsys):
    assert main(["plan", "--probe", *probes]) == 2
    assert "--probe needs two or more different micro-batch sizes" in capsys.readouterr().err
