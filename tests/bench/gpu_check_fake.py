"""A stand-in GPU check for tests/bench/test_gpu_check.py: what it does is read from FAKE_CHECK.

* ``raise``: records a number, then raises (the row must say CRASH, the command exit 1);
* ``exit``: records a number, then dies without a word (CRASH, and the number survives);
* ``hang``: sleeps past any time box (the row must say TIMEOUT and the process be killed);
* otherwise: returns an outcome that misses its target (a FAIL row, exit 0).
"""

import os
import time

from gradaccum.bench.gpu.check import Outcome


def run(ctx):
    ctx.record(before="recorded")
    what = os.environ.get("FAKE_CHECK", "")
    if what == "raise":
        raise ValueError("boom")
    if what == "exit":
        os._exit(3)
    if what == "hang":
        time.sleep(600)
    return Outcome("3 apples", "4 apples", False)
