"""Mixture of experts under accumulation: the load-balancing loss of the whole window, exact
across micro-batches and ranks (docs/MOE.md).

May import: gradaccum.core, gradaccum.torch

* :class:`LoadBalance`: finds a Hugging Face MoE model's routers (Qwen2-MoE, Qwen3-MoE, Mixtral,
  OLMoE) or takes ``routers=[modules]``, switches the model's own auxiliary loss off, and adds the
  gradient of the window's balancing loss inside each micro-batch's own ``acc.backward``:
  ``"global"`` (a no-grad pre-pass counts the window's routes: exact), ``"rolling"`` or
  ``"micro_batch"`` (one pass). ``balance.windows(loader, acc)`` gives the windows;
  ``balance.load`` and ``balance.on_window(fn)`` the window's expert load (an aux-free bias).
  Under ``acc.backward_pipeline``: ``"rolling"`` and ``"micro_batch"`` per pipeline micro-batch
  (``per_layer=True``; ``"global"`` refused, naming ``"rolling"``).

The arithmetic from counts is the core's (:mod:`gradaccum.core.balance`); ``_routers.py`` finds
the routers, ``_inject.py`` counts routes and enters the gradient (an identity on each router's
output), ``_window.py`` holds one window's masks, totals and weights, ``_pipeline.py`` the
pipeline micro-batches of a ``backward_pipeline`` call, ``balance.py`` the class.

Example:
    >>> import torch, gradaccum
    >>> router = torch.nn.Linear(4, 3)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), router)
    >>> balance = gradaccum.moe.LoadBalance(model, routers=[router], top_k=1, coef=0.01)
    >>> balance.mode
    'global'
"""

import gradaccum.torch  # noqa: F401  # first: without torch, its one-line ImportError naming the install
from gradaccum.moe.balance import LoadBalance

__all__ = ["LoadBalance"]
