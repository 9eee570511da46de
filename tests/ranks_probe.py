"""Rank side of tests/test_ranks.py: a rank that starts a child, then hangs or fails.

Run by ``run_ranks("tests.ranks_probe", OUT)``; ``OUT/mode`` says what to do: ``hang`` (every
rank sleeps) or ``fail`` (rank 1 exits with status 1, the others sleep as if waiting for it in a
collective). Each rank writes its own and its child's process id to ``OUT/pids{rank}``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (out / f"pids{rank}").write_text(f"{os.getpid()} {child.pid}")
    print(f"rank {rank} started child {child.pid}", flush=True)
    if (out / "mode").read_text() == "fail" and rank == 1:
        sys.exit("rank 1 fails on purpose")
    time.sleep(600)


if __name__ == "__main__":
    main()
