"""Save plans kept per (specs, world size): planning a few hundred tensors costs about a millisecond
of every save's stall, and plans are immutable."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

from ckpt_service.plan import DEFAULT_CHUNK_BYTES, SavePlan, TensorSpec, TensorSpecs, make_save_plan

#: Plans kept per writer: one model's saves alternate between a few world sizes at most.
PLAN_CACHE_SIZE = 8

_SpecsKey = tuple[TensorSpec, ...] | TensorSpecs


class PlanCache:
    """A thread-safe LRU of save plans."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, size: int = PLAN_CACHE_SIZE) -> None:
        self.chunk_bytes = chunk_bytes
        self.size = size
        self._plans: OrderedDict[tuple[_SpecsKey, int], SavePlan] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, specs: Iterable[TensorSpec] | TensorSpecs, world_size: int = 1) -> SavePlan:
        """The save plan of ``specs`` over ``world_size`` writers."""
        # A TensorSpecs is its own key: its hash is computed once and a lookup matches it by identity.
        specs_key: _SpecsKey = specs if isinstance(specs, TensorSpecs) else tuple(specs)
        key = (specs_key, world_size)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = make_save_plan(specs_key.specs if isinstance(specs_key, TensorSpecs) else specs_key, world_size,
                              chunk_bytes=self.chunk_bytes)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan
