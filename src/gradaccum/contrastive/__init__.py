"""Contrastive losses at any batch size: tiled, exact, with memory that grows with ``B``, not ``B^2``.

May import: gradaccum.core, gradaccum.torch

* :func:`clip_loss`: CLIP's symmetric cross-entropy (OpenCLIP's ``ClipLoss`` on one process);
* :func:`info_nce`: InfoNCE with in-batch negatives, hard negatives after the positives
  (sentence-transformers' ``MultipleNegativesRankingLoss``);
* :func:`siglip_loss`: SigLIP's pairwise sigmoid loss (OpenCLIP's ``SigLipLoss``);
* :func:`rank_local`: the building block that shares a row-separable loss of your own out among
  the ranks.

Each loss walks ``scale * a @ b.T`` in ``tile x tile`` blocks with an online log-sum-exp (or sum)
and recomputes the blocks in the backward pass: no ``B x B`` matrix exists in either pass, and the
memory is ``O((B + tile) * d + tile^2)``. The result is the dense formula's, loss and every
gradient (the scale's and the bias's included), to rounding. They work on their own, on
representations already in memory, and as ``loss_fn`` of ``Accumulator.backward_cached``, where
under DDP or FSDP2 each rank computes only its share of the rows (docs/CONTRASTIVE.md).

Dtypes: the blocks' products run in the inputs' dtype (bf16 features give bf16 matrix products),
their exponentials and every sum in float32 at least (float64 inputs stay float64); autocast is
off inside. Double backward (``create_graph=True``) is not supported and raises.

Example:
    >>> import torch
    >>> from gradaccum.contrastive import clip_loss
    >>> image, text = torch.randn(8, 4, requires_grad=True), torch.randn(8, 4)
    >>> scale = torch.tensor(2.0, requires_grad=True)
    >>> clip_loss(image, text, scale, tile=3).backward()
    >>> image.grad.shape, scale.grad.shape
    (torch.Size([8, 4]), torch.Size([]))
"""

import gradaccum.torch  # noqa: F401  # first: without torch, its one-line ImportError naming the install
from gradaccum.contrastive._losses import clip_loss, info_nce, siglip_loss
from gradaccum.contrastive._rank_local import rank_local

__all__ = ["clip_loss", "info_nce", "rank_local", "siglip_loss"]
