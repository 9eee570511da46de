"""TRL 1.16's GRPOTrainer loss, transcribed for the RL tests: its per-token losses and its own
reduction (``_compute_loss``), on a tiny policy and fixed rollouts (no trl import)."""

from __future__ import annotations

import math

import torch

from tests.reference import VOCAB, tiny_lm

T = 20  # max_completion_length
EPSILON = 0.2  # epsilon_low = epsilon_high (TRL's default)
CISPO_EPSILON_HIGH = 1.5
SAPO_TEMPERATURES = (1.0, 1.05)  # sapo_temperature_pos, sapo_temperature_neg
VESPO = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg


def rollouts(sequences: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Completions of 1 to T tokens: ids, targets, mask, advantages, and the old policy's
    log-probabilities (the policy at generation time, perturbed so that ratios and clips act)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sequences, T), generator=g)
    targets = torch.randint(0, VOCAB, (sequences, T), generator=g)
    lengths = torch.randint(1, T + 1, (sequences,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).long()
    advantages = torch.randn(sequences, generator=g, dtype=torch.float64)
    with torch.no_grad():
        noise = 0.3 * torch.randn(sequences, T, generator=g, dtype=torch.float64)
        old = logps(tiny_lm(), ids, targets) + noise
    return {"ids": ids, "targets": targets, "mask": mask, "advantages": advantages, "old": old}


def logps(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(ids), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def gamma_weights(advantages, log_ratio, mask):
    """TRL's get_gamma_weights (vespo), without the vLLM correction."""
    lower = math.log(1e-8)
    seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    k_pos, lambda_pos, k_neg, lambda_neg = VESPO
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def per_token_loss(loss_type: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TRL's per-token loss (beta 0; sequence-level importance sampling for luspo, as TRL requires)."""
    lp = logps(model, batch["ids"], batch["targets"])
    mask, advantages = batch["mask"], batch["advantages"].unsqueeze(1)
    log_ratio = lp - batch["old"]
    if loss_type == "luspo":
        log_ratio_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_ratio_w = log_ratio
    coef_1 = torch.exp(log_ratio_w)
    if loss_type == "cispo":
        return -torch.clamp(coef_1, max=CISPO_EPSILON_HIGH).detach() * advantages * lp
    if loss_type == "sapo":
        temperatures = torch.where(advantages > 0, *SAPO_TEMPERATURES)
        return -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    if loss_type == "vespo":
        return -gamma_weights(advantages, log_ratio, mask) * advantages * lp
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def trl_loss(loss_type, ptl, mask, *, accumulation_steps=1, num_items_in_batch=None,
             steps_per_generation=1, num_processes=1):
    """TRL's reduction of one micro-batch, in training mode (``_compute_loss``)."""
    if loss_type in ("grpo", "sapo"):
        return ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        return (ptl * mask).sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        return (ptl * mask).sum() / (ptl.size(0) * T) / accumulation_steps
    if loss_type == "luspo":
        return (ptl * mask).sum(-1).mean() / accumulation_steps
    normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
    normalizer = normalizer * accumulation_steps / steps_per_generation
    return (ptl * mask).sum() / normalizer


def sliced(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}
