"""The seed experiment: the MNIST reader and where it finds the data, the demo models, the
trainers (PyTorch and MindSpore) and their epochs, the metrics they write, and the nanoGPT-style
GPT of the language-model pages. The run's folder (lock, checkpoint, outputs, interrupts) is
``gradaccum.run_folder``, a floor below.

May import: gradaccum.core, gradaccum.torch, gradaccum.mindspore, gradaccum.run_folder

The names below load on first use (PEP 562): importing a submodule such as
``gradaccum.demos.config`` (as the command line does at start-up) must not import torch, so that
``gradaccum`` without torch can say in one line what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the submodule that defines it
_LAZY = {"MNIST_MEAN": "mnist", "MNIST_STD": "mnist", "load_mnist": "mnist", "mnist_tensors": "mnist",
         "MODELS": "models", "build_model": "models"}

if TYPE_CHECKING:
    from gradaccum.demos.mnist import MNIST_MEAN, MNIST_STD, load_mnist, mnist_tensors
    from gradaccum.demos.models import MODELS, build_model
else:
    def __getattr__(name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(f"module 'gradaccum.demos' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"gradaccum.demos.{_LAZY[name]}"), name)
        globals()[name] = value
        return value

__all__ = ["MNIST_MEAN", "MNIST_STD", "MODELS", "build_model", "load_mnist", "mnist_tensors"]
