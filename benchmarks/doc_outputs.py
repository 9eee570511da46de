"""The outputs the pages quote (README, docs/CHECK.md, docs/TESTING.md), run again, as a results file.

Each quoted output is produced here the way the page says it was (the same command, or the same
code) and kept line by line: its text, and its numbers as tests/test_doc_numbers.py reads them
in a quote, so that the page binds each printed number to its own key. ``torch_threads`` is kept
with each run: float rounding, and so the last digits of a difference, depends on how the work is
split over threads (the token check is run at 1 and at 2 threads), and on the CPU's vector unit:
torch's kernels sum float64 in another order with AVX-512 than with AVX2 (TESTING.md's example
prints 1.1e-16 with one, 5.6e-17 with the other). Every run here is pinned to AVX2
(``ATEN_CPU_CAPABILITY=avx2``, which x86 CPUs of the last decade have), and the capability is kept
beside the machine, so that tests/test_doc_snippets.py can rerun a quoted output under the same
capability and threads and compare it line for line (a stale file fails there).

    python benchmarks/doc_outputs.py --json docs/results/doc_outputs.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before torch loads (here and in every command run below): the vector unit the outputs are for.
CPU_CAPABILITY = "avx2"
os.environ["ATEN_CPU_CAPABILITY"] = CPU_CAPABILITY

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradaccum.bench.machine import describe_machine  # noqa: E402
from gradaccum.bench.results_file import write_results  # noqa: E402
from tests.doc_binding import cited  # noqa: E402

MYNETS = '''from torch import nn


def classifier():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(64, 5))
'''
MYLM = '''from gradaccum.demos.gpt import GPT, GPTConfig


def build():
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32))
'''
TOKENS = '''import torch

text = torch.tensor(list(open(torch.__file__, "rb").read()[:4096]))  # bytes as token ids
lengths = [5, 32, 12, 3, 32, 20, 9, 27]           # real tokens per sequence
ids = torch.zeros(8, 32, dtype=torch.int64)       # padded with token 0 ...
targets = torch.full((8, 32), -100)               # ... where no loss is taken
for i, n in enumerate(lengths):
    chunk = text[100 * i:100 * i + n + 1]
    ids[i, :n], targets[i, :n] = chunk[:-1], chunk[1:]  # targets: the next token, already shifted
torch.save({"inputs": ids, "targets": targets}, "tokens.pt")
'''
MEAN_AND_TOKEN = '''import torch
from torch.nn import functional as F

import gradaccum
from mylm import build

batch = torch.load("tokens.pt")


def mean_loss(output, targets):  # the model returns (logits, loss=None)
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def token_loss(output, targets):
    return mean_loss(output, targets), gradaccum.count_tokens(targets)


for loss in (mean_loss, token_loss):
    print(gradaccum.check_equivalence(build, batch["inputs"], 4, targets=batch["targets"], loss=loss))
'''


def lines_of(text: str) -> list[dict[str, Any]]:
    """Each line with its numbers, read as a page's quote is read."""
    return [{"text": line, "numbers": [float(t.replace(",", "")) for t, _ in cited(f"```\n{line}\n```")]}
            for line in text.splitlines()]


def run(cmd: list[str], cwd: Path, threads: int | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run([sys.executable, "-m", *cmd] if cmd[0] == "gradaccum" else [sys.executable, *cmd],
                          cwd=cwd, env=env, capture_output=True, text=True)
    threads_used = threads if threads is not None else os.cpu_count()
    return {"command": " ".join(cmd), "exit_code": done.returncode, "torch_threads": threads_used,
            "lines": lines_of(done.stdout)}


def testing_outputs() -> dict[str, Any]:
    """TESTING.md's opening example: a loop that divides by the steps twice, splits 2 and 4."""
    from gradaccum.testing import assert_accumulation_exact
    from tests.torch.test_testing import divided_twice, linear, regression_batch

    try:
        assert_accumulation_exact(divided_twice, linear, regression_batch(), splits=(2, 4))
        message = "exact"
    except AssertionError as err:
        message = f"AssertionError: {err}"
    return {"code": "assert_accumulation_exact(divided_twice, linear, regression_batch(), splits=(2, 4))",
            "lines": lines_of(message)}


def hf_outputs() -> dict[str, Any]:
    """CHECK.md's recipe ``hf-check`` as printed, and the same counting without ``shift=True``."""
    import re

    text = (ROOT / "docs" / "CHECK.md").read_text()
    code = re.search(r"<!-- recipe: hf-check -->\n```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    out = {}
    for name, source in {"shifted": code, "unshifted": code.replace("count_tokens(labels, shift=True)",
                                                                     "count_tokens(labels)")}.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(source, "CHECK.md[hf-check]", "exec"), {"__name__": "hf_check"})
        out[name] = {"lines": lines_of(printed.getvalue())}
    return out


def ranks_unused() -> dict[str, Any]:
    """CHECK.md's two-rank example: a head the loss never uses."""
    from gradaccum import check_equivalence
    from tests.torch.test_checker_ranks import HalfUsed

    report = check_equivalence(HalfUsed, (4,), 1, micro_batch=4, world_size=2)
    return {"code": "check_equivalence(HalfUsed, (4,), 1, micro_batch=4, world_size=2)",
            "rank_spread": report.settings["rank_spread"], "lines": lines_of(str(report))}


def testing_page_example(work: Path) -> dict[str, Any]:
    """TESTING.md's worked example: the page's block, run as printed, and what it prints."""
    import re

    text = (ROOT / "docs" / "TESTING.md").read_text()
    block = re.findall(r"```python\n((?:(?!```).)*)```\n\nprints", text, re.S)[-1]
    (work / "testing_example.py").write_text(block)
    return run(["testing_example.py"], work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "mynets.py").write_text(MYNETS)
        (work / "mylm.py").write_text(MYLM)
        (work / "make_tokens.py").write_text(TOKENS)
        (work / "mean_and_token.py").write_text(MEAN_AND_TOKEN)
        subprocess.run([sys.executable, "make_tokens.py"], cwd=work, check=True)
        token_check = ["gradaccum", "check", "--model", "mylm:build", "--sample", "tokens.pt",
                       "--loss", "token-cross-entropy"]
        outputs = {
            "check_mlp": run(["gradaccum", "check", "--model", "mlp"], work),
            "check_cnn_bn": run(["gradaccum", "check", "--model", "cnn-bn"], work),
            "check_classifier": run(["gradaccum", "check", "--model", "mynets:classifier",
                                     "--input-shape", "20", "--loss", "cross-entropy"], work),
            "check_tokens": run(token_check, work, threads=2),
            "check_tokens_1_thread": run(token_check, work, threads=1),
            "check_tokens_python": run(["mean_and_token.py"], work, threads=2),
            "check_tokens_python_1_thread": run(["mean_and_token.py"], work, threads=1),
        }
        with contextlib.redirect_stdout(io.StringIO()):
            outputs["testing_divided_twice"] = testing_outputs()
        outputs["testing_example"] = testing_page_example(work)
        outputs["check_hf"] = hf_outputs()
        outputs["check_ranks_unused"] = ranks_unused()
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != CPU_CAPABILITY:
        raise SystemExit(f"torch runs with the CPU capability {capability}, not {CPU_CAPABILITY}: "
                         "not written")
    result = {"machine": {**describe_machine(), "cpu_capability": capability.lower()}, "outputs": outputs,
              "benchmark_seconds": time.perf_counter() - start}
    write_results(args.json, result)
    print(f"wrote {args.json} in {result['benchmark_seconds']:.0f} s")


if __name__ == "__main__":
    main()
