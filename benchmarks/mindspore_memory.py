"""Resident memory of the tutorial's MindSpore Accumulator against gradaccum.mindspore's.

For each case a fresh process builds the seed's MLP (784-W-W-10), runs one plain full-batch step
in a compiled graph (so MindSpore's own allocations are in place), reads its resident set, then
builds the case and runs two windows of 32 x 2 through an ``@ms.jit`` train step and reads the
resident set again. Cases: ``plain`` (a second compiled step with no accumulator: the growth a
new graph costs by itself), ``tutorial`` (two parameter-sized buffers), ``tutorial-written`` (the
same, its zeros copy written once, as device memory would hold it) and ``gradaccum`` (one).
The table shows the bytes of Parameters each accumulator holds and the median growth of the
resident set over the repeats.

    python benchmarks/mindspore_memory.py [--widths 512,4096] [--repeats 3]
        [--json docs/results/mindspore_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("plain", "tutorial", "tutorial-written", "gradaccum")


def resident_bytes() -> int:
    """The process's current resident set (Linux /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def measure(case: str, width: int) -> dict[str, int]:
    """Run one case in this process; returns parameter bytes, owned bytes and RSS growth."""
    sys.path.append(str(ROOT / "tests"))  # after site-packages: tests/mindspore/ would shadow MindSpore
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn
    from mindspore_reference import TutorialAccumulator, owned_bytes

    from gradaccum.mindspore import Accumulator

    ms.set_device("CPU")
    model = nn.SequentialCell(nn.Flatten(), nn.Dense(784, width), nn.ReLU(), nn.Dense(width, width),
                              nn.ReLU(), nn.Dense(width, 10))
    params = model.trainable_params()
    opt = nn.SGD(params, 0.01)
    loss_fn = nn.CrossEntropyLoss()

    def forward(x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(model(x), y)

    grad_fn = ms.value_and_grad(forward, None, params)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((64, 1, 28, 28)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, 64).astype(np.int32))

    def plain_step(xb: Tensor, yb: Tensor) -> Tensor:
        loss, grads = grad_fn(xb, yb)
        opt(grads)
        return loss

    ms.jit(plain_step)(x, y)
    before = resident_bytes()
    if case == "plain":
        def other_step(xb: Tensor, yb: Tensor) -> Tensor:
            loss, grads = grad_fn(xb, yb)
            opt(grads)
            return loss * 1.0

        step, owned = ms.jit(other_step), 0
    else:
        acc = Accumulator(opt, 2) if case == "gradaccum" else TutorialAccumulator(opt, 2)
        if case == "tutorial-written":
            # The same zeros, written (np.full) rather than calloc'ed: on Linux a zero page that
            # is only ever read is never backed, so plain "tutorial" hides its zeros copy, which
            # device memory (GPU, Ascend) would hold in full.
            for buf in acc.zero_copy:
                buf.set_data(Tensor(np.full(buf.shape, 0.0, np.float32)))

        def acc_step(xb: Tensor, yb: Tensor) -> Tensor:
            loss, grads = grad_fn(xb, yb)
            acc(grads)
            return loss

        step, owned = ms.jit(acc_step), owned_bytes(acc)
    for _ in range(2):  # two windows of 32 x 2
        step(x[:32], y[:32]).asnumpy()
        step(x[32:], y[32:]).asnumpy()
    return {"param_bytes": sum(p.nbytes for p in params), "owned_bytes": owned,
            "rss_growth": resident_bytes() - before}


def run_case(case: str, width: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, __file__, "--child", case, "--widths", str(width)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="512,4096", help="hidden widths of the MLP (512: the seed's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the table and the machine here")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        print(json.dumps(measure(args.child, widths[0])))
        return
    import mindspore as ms

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"MindSpore {ms.__version__}, CPU; {args.repeats} fresh processes per case, interleaved")
    print("\n| MLP width | parameters (MiB) | case | Parameters held (MiB) | RSS growth, median (MiB) |")
    print("|---|---|---|---|---|")
    mb = 2**20
    table: dict[str, dict[str, dict[str, float]]] = {}
    for width in widths:
        runs: dict[str, list[dict[str, int]]] = {c: [] for c in CASES}
        for _ in range(args.repeats):
            for case in CASES:
                runs[case].append(run_case(case, width))
        cells = table[str(width)] = {}
        for case in CASES:
            growth = statistics.median(r["rss_growth"] for r in runs[case])
            first = runs[case][0]
            cells[case] = {"param_mib": first["param_bytes"] / mb, "held_mib": first["owned_bytes"] / mb,
                           "rss_growth_mib": growth / mb}
            print(f"| {width} | {first['param_bytes'] / mb:.1f} | {case} | {first['owned_bytes'] / mb:.2f} "
                  f"| {growth / mb:.1f} |")
        grow = {case: cells[case]["rss_growth_mib"] for case in CASES}
        cells["differences"] = {"written_minus_gradaccum": grow["tutorial-written"] - grow["gradaccum"],
                                "gradaccum_minus_tutorial": grow["gradaccum"] - grow["tutorial"]}
    if args.json is not None:
        machine = {"machine": platform.machine(), "cpu_count": os.cpu_count(),
                   "python": platform.python_version(), "mindspore": ms.__version__, "device": "CPU"}
        args.json.write_text(json.dumps({"machine": machine, "settings": {"widths": widths,
                                         "repeats": args.repeats}, "widths": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
