"""`gradaccum train`'s memory does not grow with the number of windows.

Each window's gradients are freed at the boundary (``zero_grad(set_to_none=True)``) and
allocated again by the next window. A small tensor kept per window (the old trainer kept every
window's loss until the epoch's end) often lands in the hole those gradients leave in glibc's
heap, and the next gradients no longer fit there: the heap grew by up to 1.2 GB in one epoch
(benchmarks/heap_growth.py). The trainer now writes the losses into one buffer.
"""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradaccum.demos.config import TrainConfig
from gradaccum.demos.metrics import peak_rss_bytes
from gradaccum.demos.trainer import run_torch


def live_tensors():
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def test_the_trainer_keeps_no_tensor_per_window():
    counts = {}

    def log(line):
        if line.startswith("loss:"):
            counts[int(line.split("[")[1].split("/")[0])] = live_tensors()

    # 640 items, 32 x 2: 20 micro-batches, 10 windows per epoch; counted at micro-batch 4 and 16.
    run_torch(TrainConfig(limit_train=640, limit_test=50, epochs=1, progress=False, log_every=12,
                          micro_batch=32, steps=2), log=log)
    assert sorted(counts) == [0, 12]
    assert counts[12] - counts[0] < 6  # 6 windows in between: not one tensor kept for each


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux: VmHWM")
def test_peak_rss_is_the_process_own_not_its_starters():
    # The kernel carries a starter's peak into a started process's ru_maxrss (through exec):
    # gradaccum compare's runs would report compare's peak. VmHWM is the process's own.
    big = np.ones(400 * 2**20 // 8)  # this process's peak rises by 400 MB...
    del big
    ours = peak_rss_bytes()
    child = subprocess.run([sys.executable, "-c", "import resource; from gradaccum.demos.metrics "
                            "import peak_rss_bytes; print(peak_rss_bytes(), "
                            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                           capture_output=True, text=True, check=True, timeout=300)
    own, maxrss = map(int, child.stdout.split())
    assert maxrss >= ours - 64 * 2**20  # ...which ru_maxrss of the child shows
    assert own < ours - 300 * 2**20  # ...and the child's own peak does not
