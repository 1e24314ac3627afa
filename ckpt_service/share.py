"""A rank's share of a save: its pieces of the plan as host arrays, built and checked (pure).

The data comes either from the state's tensors (:func:`prepare_share`) or from a
*share snapshot*, a callable a framework supplies to read a device-resident state in
one call instead of one host copy per tensor (:data:`ShareSnapshot`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, TypeGuard, Union, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ckpt_service.errors import BadSnapshotError
from ckpt_service.plan import BadTensorSpecError, SavePlan, TensorSpec, TensorSpecs, WriteItem, checked_spec, spec_of


@runtime_checkable
class DeferredShare(Protocol):
    """A share snapshot taken by reference, whose piece arrays are built later.

    An asynchronous save calls ``assemble()`` on its background thread, so the caller pays
    only for taking the references. What it holds must keep the values it had when it was
    taken, e.g. TensorFlow tensors that alias variable buffers (TensorFlow copies a buffer
    before updating it in place while a read of it is alive). ``assemble`` returns what a
    :data:`ShareSnapshot` would have returned, and should drop those references as it goes.
    """

    def assemble(self) -> Sequence[NDArray[Any]]:
        ...


def is_deferred(taken: object) -> TypeGuard[DeferredShare]:
    """``isinstance(taken, DeferredShare)`` by the runtime protocol's own rule (an ``assemble`` that is
    not None), without typing's walk of the protocol's members on every call: an asynchronous save
    asks on the training thread, during its stall."""
    return getattr(taken, "assemble", None) is not None


#: Supplies this rank's share of a save: ``snapshot(plan, rank)`` returns one host array per
#: ``plan.for_rank(rank)`` item, in order, holding elements ``[item.start, item.stop)`` of the
#: ``item.group`` buffer (1-D, dtype ``item.group``), or a :class:`DeferredShare` that builds them
#: later. The arrays must not change afterwards: an asynchronous save writes them from a background
#: thread. It lets a framework read a device-resident state in one call instead of one host copy per
#: tensor.
ShareSnapshot = Callable[[SavePlan, int], Union[Sequence[NDArray[Any]], DeferredShare]]

#: One piece of this rank's share: the plan's item and its contiguous little-endian data.
Piece = tuple[WriteItem, NDArray[Any]]

#: This rank's checked pieces, or a call that assembles and checks them (a deferred share).
Share = Union[list[Piece], Callable[[], list[Piece]]]


def prepare_share(plan: SavePlan, rank: int, tensors: Mapping[str, Any]) -> list[Piece]:
    """This rank's pieces, each one contiguous little-endian host array (one copy of its bytes).

    Device tensors are converted to host arrays only if they hold bytes of this rank's share.
    """
    hosted: dict[str, NDArray[Any]] = {}

    def flat_of(name: str) -> NDArray[Any]:
        if name not in hosted:
            hosted[name] = np.asarray(tensors[name]).reshape(-1)  # a view for numpy arrays
        return hosted[name]

    share: list[Piece] = []
    for item in plan.for_rank(rank):
        out = np.empty(item.stop - item.start, dtype=np.dtype(item.group).newbyteorder("<"))
        for p in plan.placements:
            if p.spec.dtype != item.group or not (p.offset < item.stop and item.start < p.stop):
                continue
            lo, hi = max(p.offset, item.start), min(p.stop, item.stop)
            out[lo - item.start:hi - item.start] = flat_of(p.spec.name)[lo - p.offset:hi - p.offset]
        share.append((item, out))
    return share


def checked_share(plan: SavePlan, rank: int, arrays: Sequence[Any]) -> list[Piece]:
    """Pair a share snapshot's arrays with this rank's pieces, checked, as little-endian contiguous arrays."""
    items = plan.for_rank(rank)
    arrays = list(arrays)
    if len(arrays) != len(items):
        raise BadSnapshotError(
            f"the share snapshot returned {len(arrays)} arrays, but rank {rank} writes {len(items)} pieces")
    share: list[Piece] = []
    for item, array in zip(items, arrays):
        flat = np.asarray(array)
        want = np.dtype(item.group).newbyteorder("<")
        size = item.stop - item.start
        if flat.ndim != 1 or flat.size != size or flat.dtype.newbyteorder("<") != want:
            raise BadSnapshotError(
                f"piece {item.index} of group {item.group} (elements {item.start}-{item.stop}, rank {rank}): "
                f"the share snapshot returned {flat.dtype} {flat.shape}, expected {item.group} ({size},)")
        share.append((item, np.ascontiguousarray(flat, dtype=want)))  # no copy in the normal case
    return share


def specs_to_save(tensors: Mapping[str, Any], *, data_needed: bool) -> TensorSpecs | list[TensorSpec]:
    """Specs of ``tensors``; a TensorSpec value stands for a tensor whose data a share snapshot supplies."""
    if isinstance(tensors, TensorSpecs):
        if data_needed and tensors:
            raise _no_data_error(next(iter(tensors)))
        return tensors  # checked when it was made
    specs = []
    for name, value in tensors.items():
        if not isinstance(value, TensorSpec):
            specs.append(spec_of(name, value))
            continue
        if data_needed:
            raise _no_data_error(name)
        try:
            specs.append(checked_spec(name, value))
        except BadTensorSpecError as exc:
            raise BadSnapshotError(str(exc)) from exc
    return specs


def _no_data_error(name: str) -> BadSnapshotError:
    return BadSnapshotError(f"tensor {name!r} is given as a TensorSpec, which holds no data: pass its array, "
                            "or a share snapshot that supplies the data")
