"""The Collectives the protocol needs, on Horovod (TensorFlow binding).

Small objects travel as JSON bytes, never pickles: a record from another
process must not be able to run code here. Each call's ``name`` becomes its Horovod tensor
name (``hvdt.<name>...``): Horovod matches a collective across ranks by that name.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np


class HorovodCollectives:
    def __init__(self, hvd: Any = None) -> None:
        if hvd is None:
            import horovod.tensorflow  # the keras module re-exports the same ops

            hvd = horovod.tensorflow
        self.hvd = hvd

    def rank(self) -> int:
        return int(self.hvd.rank())

    def size(self) -> int:
        return int(self.hvd.size())

    def allreduce_sum(self, values: np.ndarray[Any, Any], *, name: str = "notice") -> np.ndarray[Any, Any]:
        import tensorflow as tf

        out = self.hvd.allreduce(tf.constant(values), op=self.hvd.Sum, name=f"hvdt.{name}")
        return np.asarray(out)

    def allgather_json(self, obj: Any, *, name: str = "gather") -> list[Any]:
        import tensorflow as tf

        payload = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        sizes = np.asarray(self.hvd.allgather(tf.constant([payload.size], dtype=tf.int64), name=f"hvdt.{name}.sizes"))
        data = np.asarray(self.hvd.allgather(tf.constant(payload), name=f"hvdt.{name}")).tobytes()
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(json.loads(data[offset:offset + size]))
            offset += size
        return out

    def broadcast_json(self, obj: Any, root: int, *, name: str = "bcast") -> Any:
        import tensorflow as tf

        payload = json.dumps(obj).encode() if self.rank() == root else b""
        size = int(np.asarray(self.hvd.broadcast(tf.constant([len(payload)], dtype=tf.int64), root,
                                                 name=f"hvdt.{name}.size"))[0])
        buf = np.zeros(size, dtype=np.uint8)
        buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        data = np.asarray(self.hvd.broadcast(tf.constant(buf), root, name=f"hvdt.{name}")).tobytes()
        return json.loads(data)
