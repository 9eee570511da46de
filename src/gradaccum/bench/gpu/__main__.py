"""``python -m gradaccum.bench.gpu``: see :mod:`gradaccum.bench.gpu.run`."""

import sys

from gradaccum.bench.gpu.run import main

if __name__ == "__main__":  # not when a spawned child imports the parent's main module
    sys.exit(main())
