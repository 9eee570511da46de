"""Where a model's routers are, and what they give: Hugging Face MoE models found from their own
output recorder, or the modules the user names; the router logits read from a router's output;
the model's own auxiliary loss switched off (kept on, it would count the balancing loss twice).

Hugging Face's MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, and the others built the same
way) declare ``_can_record_outputs["router_logits"]``: an ``OutputRecorder`` naming the router's
class and the index of the logits in its output. That is what ``output_router_logits=True``
records, so it is what this module hooks: every module of that class, in model order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.core.balance import check_coef
from gradaccum.core.validate import check_positive_int

__all__ = ["Routers", "check_aux_off", "find_routers", "logits_of", "switch_aux_off"]

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Routers:
    """A model's routers and the balancing loss's constants.

    Attributes:
        modules: the router modules, one per routed layer, in model order.
        index: where the logits are in a router's tuple output (0 for a tensor output).
        experts: experts per layer (None: read from the first logits).
        top_k: routes per token.
        coef: the balancing loss's coefficient.
        config: the Hugging Face config whose ``output_router_logits`` must stay off, or None.
    """

    modules: tuple[nn.Module, ...]
    index: int
    experts: int | None
    top_k: int
    coef: float
    config: Any


def _unwrap(model: nn.Module) -> nn.Module:
    inner = model
    while type(inner).__name__ in ("DistributedDataParallel", "DataParallel"):
        wrapped = getattr(inner, "module", None)
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return inner


def _recorder(model: nn.Module) -> Any:
    """The ``OutputRecorder`` of ``router_logits`` declared by a module of ``model``, or None."""
    for module in model.modules():
        record = getattr(type(module), "_can_record_outputs", None)
        if isinstance(record, dict) and record.get("router_logits") is not None:
            return record["router_logits"]
    return None


def _config_value(config: Any, keys: Sequence[str]) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return None


def find_routers(model: nn.Module, routers: Any, num_experts: Any, top_k: Any, coef: Any) -> Routers:
    """The routers of ``model`` (or those given) with their experts, top-k and coefficient.

    Raises:
        TypeError: ``model`` is not a module, or ``routers`` holds something else than modules.
        ValueError: no router found and none given, a config without what is not given (top-k,
            coef), a bad number.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    index = 0
    if routers is None:
        recorder = _recorder(inner)
        target = getattr(recorder, "target_class", None)
        found = [m for m in inner.modules() if target is not None and isinstance(m, target)]
        if not found:
            raise ValueError(
                f"LoadBalance found no router in {type(inner).__name__}: give routers=[modules] whose "
                "output is the router logits (or a tuple holding them first), with top_k= and coef=")
        index = int(getattr(recorder, "index", 0) or 0)
        modules: tuple[nn.Module, ...] = tuple(found)
    else:
        if isinstance(routers, nn.Module) or not isinstance(routers, Sequence) or not routers:
            raise TypeError(f"routers must be a non-empty list of modules, got {type(routers).__name__}")
        bad = [type(r).__name__ for r in routers if not isinstance(r, nn.Module)]
        if bad:
            raise TypeError(f"routers must hold torch.nn.Module routers, got {bad[0]}")
        modules = tuple(routers)
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("routers holds the same module twice: each router once, in model order")
    if top_k is None:
        top_k = _config_value(config, ("num_experts_per_tok", "moe_topk", "top_k"))
        if top_k is None:
            raise ValueError("LoadBalance needs top_k= (routes per token): the model has no config "
                             "with num_experts_per_tok")
    k = check_positive_int("top_k", top_k)
    if num_experts is None:
        num_experts = _config_value(config, _EXPERT_KEYS)
    experts = None if num_experts is None else check_positive_int("num_experts", num_experts)
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", None)
        if coef is None:
            raise ValueError("LoadBalance needs coef= (the balancing loss's coefficient): the model has "
                             "no config with router_aux_loss_coef")
    return Routers(modules, index, experts, k, check_coef(coef), config)


def switch_aux_off(config: Any) -> None:
    """Turn the model's own auxiliary loss off (its ``output_router_logits``)."""
    if config is not None and getattr(config, "output_router_logits", False):
        config.output_router_logits = False


def check_aux_off(config: Any, batch: Any) -> None:
    """Refuse the model's own auxiliary loss turned back on (config or batch).

    Raises:
        ValueError: ``output_router_logits`` is True: its loss would count the balance twice.
    """
    on = getattr(config, "output_router_logits", False) is True
    if isinstance(batch, dict) and batch.get("output_router_logits") is True:
        on = True
    if on:
        raise ValueError(
            "output_router_logits=True turns the model's own load-balancing loss back on, counted "
            "twice with LoadBalance's (which switched it off): leave it False")


def logits_of(output: Any, index: int, router: nn.Module) -> torch.Tensor:
    """The router logits in ``output``: the output itself, or its item ``index`` (a tuple).

    Raises:
        TypeError: the output holds no floating tensor of shape ``(..., experts)`` there.
    """
    logits = output[index] if isinstance(output, (tuple, list)) and len(output) > index else output
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        what = type(logits).__name__ if not isinstance(logits, torch.Tensor) else f"a {logits.dtype} tensor"
        raise TypeError(
            f"the router {type(router).__name__}'s output holds no logits (found {what} at index "
            f"{index}): a router must return its logits, shape (tokens, experts), or a tuple "
            "holding them first")
    return logits
