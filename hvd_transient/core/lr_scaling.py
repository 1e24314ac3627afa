"""Learning rate as a function of the active worker count (the paper's adaptive LR)."""
from __future__ import annotations

import math

MODES = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, workers: int, mode: str = "linear") -> float:
    """``base_lr`` is the single-worker rate; ``linear`` follows Goyal et al., ``sqrt`` is gentler."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if mode == "linear":
        return base_lr * workers
    if mode == "sqrt":
        return base_lr * math.sqrt(workers)
    if mode == "none":
        return base_lr
    raise ValueError(f"unknown learning-rate scaling {mode!r}; choose one of {', '.join(MODES)}")
