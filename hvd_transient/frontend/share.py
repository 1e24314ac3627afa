"""The snapshot of a rank's share of named tensors that can be read into host memory one by one.

A frontend whose tensors convert to numpy cheaply (PyTorch's host tensors alias their memory)
gives their specs and a converter; :func:`share_snapshot` then copies out this rank's pieces of a
save plan, converting only the tensors that hold bytes of them (a device tensor crosses to host
memory only if it does). The copy is taken on the calling thread, so it is consistent with the
step at which it was taken: an asynchronous save stalls training only that long.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ckpt_service.manager import prepare_share
from ckpt_service.plan import SavePlan, TensorSpecs


class _Hosted(Mapping[str, Any]):
    """Names -> host arrays, each converted when first asked for."""

    def __init__(self, names: TensorSpecs, to_host: Callable[[str], np.ndarray[Any, Any]]) -> None:
        self._names, self._to_host = names, to_host

    def __getitem__(self, name: str) -> np.ndarray[Any, Any]:
        return self._to_host(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class NamedShare:
    """A state's tensors by name: their specs (for planning) and how each reaches host memory."""

    specs: TensorSpecs
    to_host: Callable[[str], np.ndarray[Any, Any]]

    def __call__(self, plan: SavePlan, rank: int) -> list[np.ndarray[Any, Any]]:
        """This rank's pieces of ``plan``, copied now (a :data:`~ckpt_service.manager.ShareSnapshot`)."""
        return [array for _, array in prepare_share(plan, rank, _Hosted(self.specs, self.to_host))]
