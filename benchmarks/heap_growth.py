"""Does keeping one small tensor per window grow glibc's heap? (the `gradaccum compare` spike)

`gradaccum compare`'s runs sometimes peaked at about 1.76 GB of RSS instead of about 550 MB.
The growth was all in the process's brk heap (glibc's main arena). Each window's gradients are
freed at the boundary (``zero_grad(set_to_none=True)``) and allocated again by the next window;
after MNIST's loading freed a 16 MB block, glibc's dynamic mmap threshold serves such buffers
from the heap. The old trainer kept every window's loss (a 0-dim tensor: a few small
allocations) until the end of the epoch; when no small free chunk was at hand, glibc carved
them out of the hole the gradients had left, the next gradients no longer fitted there, and the
heap grew by about a gradient's size per window. Whether it happens depends on the state of
glibc's free lists, hence "intermittently".

This script runs the trainer's pattern (MNIST loaded as the trainer does, the seed's MLP, SGD,
micro-batch 32 x 2) after a seeded perturbation of those free lists (small tensors allocated,
every other one freed), with the window losses kept in a list (the old trainer) or written into
one buffer (the trainer now), in one fresh process per run (the heap is per process).

    python benchmarks/heap_growth.py [--seeds 0-7] [--windows 900] [--json docs/results/heap_growth.json]

Linux with glibc only (it reads ``mallinfo2``).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

from gradaccum.bench.results_file import write_results
from gradaccum.cli.info import describe_machine

CHILD = """
import ctypes, random, sys
import torch
from torch import nn
from gradaccum import Accumulator
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.demos.models import build_model

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
keep, seed, windows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x, y = mnist_tensors("train")
model = build_model("mlp", seed=0)
acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.01), 2)
rng = random.Random(seed)
junk = [torch.empty(rng.randrange(1, 4000)) for _ in range(rng.randrange(0, 400))]
del junk[::2]
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
kept, buffer, k = [], torch.empty(windows + 1, dtype=torch.float64), 0
start = libc.mallinfo2().arena
for i in range(2 * windows):
    idx = order[i * 32:(i + 1) * 32]
    acc.backward(nn.functional.cross_entropy(model(x[idx]), y[idx]))
    if acc.micro_step == 0:
        if keep == "list":
            kept.append(acc.window_loss)
        else:
            buffer[k] = acc.window_loss
        k += 1
print((libc.mallinfo2().arena - start) / 2**20)
"""


def growth(keep: str, seed: int, windows: int) -> float:
    """The heap's growth in MiB over ``windows`` windows, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, keep, str(seed), str(windows)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0-7", help="perturbation seeds, FIRST-LAST")
    parser.add_argument("--windows", type=int, default=900, help="windows per run (an epoch: 938)")
    parser.add_argument("--json", type=Path, default=None, help="also write the table and the machine here")
    args = parser.parse_args()
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        raise SystemExit("needs glibc >= 2.33 (mallinfo2)")
    first, last = map(int, args.seeds.split("-"))
    machine = describe_machine()
    print(f"machine: {machine['cpu']} ({machine['cpu_count']} CPUs); torch {machine['torch']}; "
          f"threads: {machine['torch_threads']}; malloc: {machine['malloc']}")
    print(f"\nheap growth (MiB) over {args.windows} windows of 32 x 2, per perturbation seed\n")
    print("| seed | losses kept in a list (old trainer) | losses in one buffer (trainer now) |")
    print("|---|---|---|")
    rows = {"list": {}, "buffer": {}}
    for seed in range(first, last + 1):
        # Interleaved: A then B for each seed.
        rows["list"][str(seed)] = growth("list", seed, args.windows)
        rows["buffer"][str(seed)] = growth("buffer", seed, args.windows)
        print(f"| {seed} | {rows['list'][str(seed)]:.1f} | {rows['buffer'][str(seed)]:.1f} |", flush=True)
    if args.json is not None:
        summary = {k: {"min": min(v.values()), "max": max(v.values())} for k, v in rows.items()}
        write_results(args.json, {"machine": {**machine, "glibc": _glibc()},
                                  "settings": {"seeds": args.seeds, "windows": args.windows,
                                               "micro_batch": 32, "steps": 2},
                                  "growth_mib": rows, "summary": summary}, indent=2)


def _glibc() -> str:
    import platform
    return " ".join(platform.libc_ver())


if __name__ == "__main__":
    main()
