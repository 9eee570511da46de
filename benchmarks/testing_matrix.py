"""The detection matrix of gradaccum.testing, as run: every loop of the independent matrix
(tests/torch/independent_matrix.py: an MLP classifier, the same with BatchNorm, a token tagger,
uneven splits, 1 process and 2 gloo ranks) through ``assert_accumulation_exact``, one row each:
caught or not, what the report names, and whether that is the loop's bug.

    python benchmarks/testing_matrix.py [--no-ranks] [--json docs/results/testing_matrix.json]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gradaccum.bench.machine import describe_machine  # noqa: E402
from gradaccum.bench.results_file import write_results  # noqa: E402
from tests.torch import independent_matrix as m  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-ranks", action="store_true", help="skip the 2-rank cells")
    parser.add_argument("--json", type=Path, help="write the rows to this results file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cells = {**m.CORRECT, **m.BUGS}
    if not args.no_ranks:
        cells |= {**m.CORRECT_RANKS, **m.BUGS_RANKS}
    rows = []
    for name, cell in cells.items():
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caught, message = m.run_cell(cell)
        verdict = m.verdict(cell, caught, message)
        rows.append({"loop": name, "bug": cell.named is not None, "caught": caught, "verdict": verdict,
                     "says": m.cause(message) if caught else "exact",
                     "seconds": round(time.perf_counter() - start, 2)})
    print("| loop | caught | verdict | what the report says (first split that differs) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['loop']} | {'yes' if r['caught'] else 'no'} | {r['verdict']} | {r['says']} |")
    bugs = [r for r in rows if r["bug"]]
    correct = [r for r in rows if not r["bug"]]
    summary = {"correct": len(correct), "false_alarms": sum(r["caught"] for r in correct),
               "buggy": len(bugs), "caught": sum(r["caught"] for r in bugs),
               "named": sum(r["verdict"] == "named" for r in bugs),
               "misnamed": sum(r["verdict"] == "misnamed" for r in bugs),
               "seconds": round(sum(r["seconds"] for r in rows), 1)}
    print(summary)
    if args.json:
        write_results(args.json, {"machine": describe_machine(), "ranks": not args.no_ranks,
                                  "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
