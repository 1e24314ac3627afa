"""The Collectives the protocol needs, over any Horovod binding: JSON framing on top of its tensor ops.

Small objects travel as JSON bytes, never pickles: a record from another process must not be able to
run code here. Each call's ``name`` becomes its Horovod tensor name (``hvdt.<name>...``), by which
Horovod matches a collective across ranks. A frontend says how a numpy array becomes its framework's
tensor and back (:class:`TensorOps`); the framing is the same for all.
"""
from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np


class TensorOps(Protocol):
    """A Horovod binding's collectives on its own tensors (``horovod.torch``, ``horovod.tensorflow``)."""

    def to_tensor(self, array: np.ndarray[Any, Any]) -> Any: ...

    def to_numpy(self, tensor: Any) -> np.ndarray[Any, Any]: ...


class JsonCollectives:
    """:class:`~hvd_transient.core.interfaces.Collectives` over ``hvd`` (a Horovod binding's module)."""

    def __init__(self, hvd: Any, ops: TensorOps) -> None:
        self.hvd, self.ops = hvd, ops

    def rank(self) -> int:
        return int(self.hvd.rank())

    def size(self) -> int:
        return int(self.hvd.size())

    def allreduce_sum(self, values: np.ndarray[Any, Any], *, name: str = "notice") -> np.ndarray[Any, Any]:
        out = self.hvd.allreduce(self.ops.to_tensor(values), op=self.hvd.Sum, name=f"hvdt.{name}")
        return self.ops.to_numpy(out)

    def allgather_json(self, obj: Any, *, name: str = "gather") -> list[Any]:
        payload = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        sizes = self.hvd.allgather(self.ops.to_tensor(np.array([payload.size], dtype=np.int64)),
                                   name=f"hvdt.{name}.sizes")
        data = self.ops.to_numpy(self.hvd.allgather(self.ops.to_tensor(payload), name=f"hvdt.{name}")).tobytes()
        out, offset = [], 0
        for size in self.ops.to_numpy(sizes).tolist():
            out.append(json.loads(data[offset:offset + size]))
            offset += size
        return out

    def broadcast_json(self, obj: Any, root: int, *, name: str = "bcast") -> Any:
        payload = json.dumps(obj).encode() if self.rank() == root else b""
        size = int(self.ops.to_numpy(self.hvd.broadcast(self.ops.to_tensor(np.array([len(payload)], dtype=np.int64)),
                                                        root, name=f"hvdt.{name}.size"))[0])
        buf = np.zeros(size, dtype=np.uint8)
        buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        data = self.ops.to_numpy(self.hvd.broadcast(self.ops.to_tensor(buf), root, name=f"hvdt.{name}")).tobytes()
        return json.loads(data)
