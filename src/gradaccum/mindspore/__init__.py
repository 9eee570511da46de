"""The MindSpore adapter: the same exact accumulation as the PyTorch one, inside a compiled graph.

May import: gradaccum.core

Needs MindSpore 2.10 and NumPy 1.x, kept out of the default install: ``pip install
'gradaccum[mindspore]'``. ``import gradaccum`` never imports this package.
"""

try:
    import mindspore  # noqa: F401
except ImportError as err:
    raise ImportError(
        "gradaccum.mindspore needs MindSpore: install the extra with "
        f"pip install 'gradaccum[mindspore]' (importing mindspore failed: {err})"
    ) from err

from gradaccum.mindspore.accumulator import Accumulator

__all__ = ["Accumulator"]
