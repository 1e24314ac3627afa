"""A checksum over a whole training state, to check that replicas (and a checkpoint) agree."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ckpt_service.manifest import crc32c


def state_crc(tensors: Mapping[str, Any]) -> int:
    """Fold the crc32c of every tensor, in name order; works on arrays and on TF variables."""
    total = 0
    for name in sorted(tensors):
        value = tensors[name]
        array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        total = (total * 1_000_003 + crc32c(np.ascontiguousarray(array))) % (1 << 61)
    return total
