"""Scaling a PyTorch job's learning rates by a factor, with its scheduler, so the schedule goes on scaled.

A scheduler computes the next rate from its own copies of the rates as well as from the optimizer's:
base rates (``base_lrs``; ``initial_lr`` in each group), a cycle's bounds (``CyclicLR``'s ``max_lrs``,
``OneCycleLR``'s ``max_lr``/``min_lr`` in each group), a floor (``eta_min``, ``min_lrs``). Every one of
them is scaled, in composite schedulers (``SequentialLR``, ``ChainedScheduler``) too, so the rate the
schedule gives is the unscaled schedule's times the factor, at every later step.
"""
from __future__ import annotations

from numbers import Real
from typing import Any

import torch

#: the rates a parameter group may hold (the optimizer's, OneCycleLR's)
GROUP_RATES = ("lr", "initial_lr", "max_lr", "min_lr")
#: a scheduler's attributes that hold rates: one per group (lists), or one for all (a number)
SCHEDULER_RATES = ("base_lrs", "max_lrs", "min_lrs", "_last_lr", "eta_min")


def scale_learning_rates(optimizer: torch.optim.Optimizer, scheduler: Any | None, factor: float) -> None:
    """Multiply every learning rate of ``optimizer`` and of ``scheduler`` (None: none) by ``factor``."""
    for group in optimizer.param_groups:
        for key in GROUP_RATES:
            if isinstance(group.get(key), Real) and not isinstance(group[key], bool):
                group[key] = group[key] * factor
    for sched in _schedulers(scheduler):
        for name in SCHEDULER_RATES:
            value = getattr(sched, name, None)
            if isinstance(value, list) and all(isinstance(v, Real) for v in value):
                setattr(sched, name, [v * factor for v in value])
            elif isinstance(value, Real) and not isinstance(value, bool):
                setattr(sched, name, value * factor)


def _schedulers(scheduler: Any | None) -> list[Any]:
    """``scheduler`` and, for a composite one, the schedulers it holds (each once)."""
    out: list[Any] = []
    todo = [scheduler] if scheduler is not None else []
    while todo:
        sched = todo.pop()
        if any(sched is seen for seen in out):
            continue
        out.append(sched)
        todo.extend(getattr(sched, "_schedulers", None) or [])
    return out


__all__ = ["GROUP_RATES", "SCHEDULER_RATES", "scale_learning_rates"]
