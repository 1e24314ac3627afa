"""The Collectives the protocol needs, on Horovod's PyTorch binding (no TensorFlow): the shared JSON
framing of :mod:`hvd_transient.frontend.collectives` over torch tensors."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hvd_transient.frontend.collectives import JsonCollectives


class _TorchOps:
    def to_tensor(self, array: np.ndarray[Any, Any]) -> torch.Tensor:
        return torch.from_numpy(np.array(array))  # a writable copy: Horovod may write into its inputs' buffers

    def to_numpy(self, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
        array: np.ndarray[Any, Any] = tensor.numpy()
        return array


class TorchCollectives(JsonCollectives):
    def __init__(self, hvd: Any = None) -> None:
        if hvd is None:
            import horovod.torch

            hvd = horovod.torch
        super().__init__(hvd, _TorchOps())
