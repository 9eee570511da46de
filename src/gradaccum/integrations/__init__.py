"""Where users already train: Hugging Face Accelerate (``accelerate``), RL policy losses (``rl``)
and PyTorch Lightning (``lightning``, whose 0.3.0 path ``gradaccum.lightning`` still imports), one
module or package each, on the public API of the adapter (docs/INTEGRATIONS.md, docs/LIGHTNING.md).

May import: gradaccum.core, gradaccum.torch

Each is imported on its own (``import gradaccum.integrations.accelerate``); none is loaded
by ``import gradaccum``, and none needs its framework installed until it is used.

Pipeline parallelism has no module here: ``Accumulator.backward_pipeline`` runs a
``torch.distributed.pipelining`` schedule's ``step()`` as one micro-batch of the window, and its
gradient sync and boundary are the adapter's own, so it is a method of the ``Accumulator``
(``gradaccum.torch``, which may not import this room), and a user needs nothing beyond it and the
schedule they already build (docs/PIPELINE.md).
"""
