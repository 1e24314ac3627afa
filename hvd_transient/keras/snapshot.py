"""This rank's checkpoint share of TensorFlow variables, read from the device in one call.

An asynchronous save stalls training only while it takes this rank's share. Converting
each variable with ``numpy.asarray`` costs one eager dispatch per variable (10-25 ms per
rank for ResNet-32's 269 variables on a CPU). :class:`FusedSnapshot` instead traces, once
per save plan and rank, a function that reads every variable holding bytes of the rank's
share in one graph, so the share is consistent and one call takes it.

What the function returns depends on where the variables live:

* in host memory (CPU): the larger variables as they are read, which alias their buffers
  (no copy), and the small ones flattened into one tensor per dtype. The call returns a
  :class:`~ckpt_service.manager.DeferredShare`: the pieces are cut out and copied on the
  save's background thread. The aliases keep the values of the call: TensorFlow copies a
  variable's buffer before updating it in place while a read of it is alive, and the
  assembly drops them within milliseconds, long before the next step's update;
* on an accelerator: the rank's bytes cut out and concatenated into one tensor per piece
  of the plan on the device, so only the share crosses to host memory, in one copy per piece.

It is a :data:`ckpt_service.manager.ShareSnapshot`::

    fused = FusedSnapshot(state_variables(model))
    manager.save_async(step, fused.specs, meta, rank=r, world_size=w, snapshot=fused, attempt=attempt)

In host memory the call runs its kernels on the calling thread (the single-threaded executor,
chosen with ``tf.experimental.function_executor_type``) instead of handing each read to
TensorFlow's inter-op thread pool, a core training also wants. The call goes through the
public ``ConcreteFunction.__call__`` by default. ``HVDT_TF_FAST_SNAPSHOT=1`` (or
``FusedSnapshot(..., fast_call=True)``) calls TensorFlow's eager runtime directly instead
(:func:`direct_call`): about 2 ms less per save for ResNet-32, since the ~150 captured variable
handles are collected once rather than on every call, but through TensorFlow internals that a
TensorFlow upgrade may change (it falls back to the public call when they are missing).

Tracing and first running the function costs a few hundred milliseconds for ResNet-32,
paid by the first save of each (plan, rank), i.e. once per ring size; the function is
cached. Anything the graph cannot do (a dtype TensorFlow cannot concatenate, a variable
read that changes the dtype) falls back, with a warning, to reading the variables one by one.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from ckpt_service.manager import DeferredShare, prepare_share
from ckpt_service.plan import SavePlan, TensorPlacement, TensorSpec, TensorSpecs, WriteItem, spec_of

log = logging.getLogger(__name__)

#: Traced functions kept per snapshot: one per (plan, rank), i.e. per ring size seen recently.
FUNCTION_CACHE_SIZE = 4
#: Host path: the executor of the call. It runs every kernel on the calling thread, which suits
#: reads, reshapes and concatenations on one CPU device (no control flow, no asynchronous kernels).
HOST_EXECUTOR = "SINGLE_THREADED_EXECUTOR"
#: Host path: variables of at most this many elements are concatenated into one output per dtype
#: (each output of a call costs more than copying a small tensor); larger ones are returned as read.
SMALL_TENSOR_ELEMENTS = 1 << 14
#: Opt-in switch for :func:`direct_call` (a private TensorFlow API) in place of :func:`public_call`.
FAST_CALL_ENV = "HVDT_TF_FAST_SNAPSHOT"


def fast_call_requested() -> bool:
    """Whether ``HVDT_TF_FAST_SNAPSHOT`` asks for the direct runtime call (1, true, yes or on)."""
    return os.environ.get(FAST_CALL_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class TensorSlice:
    """Elements [lo, hi) of a tensor's flattened view, part of one piece."""

    name: str
    lo: int
    hi: int
    whole: bool  # the slice is the entire tensor


Layout = tuple[tuple[TensorSlice, ...], ...]  # per piece, its slices in buffer order


class SnapshotPlanError(ValueError):
    """The save plan was not made from the snapshot's variables."""


def share_layout(placements: Sequence[TensorPlacement], items: Sequence[WriteItem]) -> Layout:
    """Per piece of ``items``, the tensor slices that make it up, in buffer order (pure)."""
    by_group: dict[str, list[TensorPlacement]] = {}
    for p in placements:
        if p.spec.size:  # an empty tensor holds no element of any piece
            by_group.setdefault(p.spec.dtype, []).append(p)
    layout = []
    for item in items:
        slices = []
        for p in sorted(by_group.get(item.group, ()), key=lambda p: p.offset):
            if p.offset < item.stop and item.start < p.stop:
                lo, hi = max(p.offset, item.start), min(p.stop, item.stop)
                slices.append(TensorSlice(p.spec.name, lo - p.offset, hi - p.offset,
                                          (lo, hi) == (p.offset, p.stop)))
        if sum(s.hi - s.lo for s in slices) != item.stop - item.start:
            raise SnapshotPlanError(
                f"the plan's placements do not cover piece {item.index} of group {item.group}")
        layout.append(tuple(slices))
    return tuple(layout)


@dataclass(frozen=True)
class HostOutputs:
    """The host path's function outputs: one variable as read, or small variables concatenated.

    ``outputs[i]`` names the variables of output ``i`` in order; ``concatenated[i]`` says
    whether they are flattened and concatenated (else it is one variable as read, an alias of
    its buffer). ``where[name]`` is (output, element offset of the variable in it).
    """

    outputs: tuple[tuple[str, ...], ...]
    concatenated: tuple[bool, ...]
    where: Mapping[str, tuple[int, int]]


def host_outputs(layout: Layout, specs: Mapping[str, TensorSpec],
                 small_elements: int = SMALL_TENSOR_ELEMENTS) -> HostOutputs:
    """Outputs that hold every variable ``layout`` cuts pieces from, each once (pure)."""
    names = list(dict.fromkeys(s.name for slices in layout for s in slices))
    small: dict[str, list[str]] = {}  # dtype -> names, in first-use order
    large: list[str] = []
    for name in names:
        if specs[name].size <= small_elements:
            small.setdefault(specs[name].dtype, []).append(name)
        else:
            large.append(name)
    outputs = [tuple(group) for group in small.values()] + [(name,) for name in large]
    concatenated = [True] * len(small) + [False] * len(large)
    where: dict[str, tuple[int, int]] = {}
    for index, group in enumerate(outputs):
        offset = 0
        for name in group:
            where[name] = (index, offset)
            offset += specs[name].size
    return HostOutputs(tuple(outputs), tuple(concatenated), where)


def assemble_pieces(flats: Sequence[np.ndarray[Any, Any]], outputs: HostOutputs,
                    layout: Layout) -> list[np.ndarray[Any, Any]]:
    """Each piece of ``layout`` copied out of the flattened outputs into an array of its own (pure)."""
    pieces = []
    for slices in layout:
        parts = []
        for s in slices:
            index, offset = outputs.where[s.name]
            parts.append(flats[index][offset + s.lo:offset + s.hi])
        pieces.append(np.concatenate(parts) if len(parts) > 1 else parts[0].copy())
    return pieces


class AliasedShare(DeferredShare):
    """A host-path call's outputs, assembled into the rank's pieces on the save's background thread."""

    def __init__(self, tensors: Sequence[tf.Tensor], outputs: HostOutputs, layout: Layout) -> None:
        self._tensors: Sequence[tf.Tensor] | None = tensors
        self._outputs, self._layout = outputs, layout

    def assemble(self) -> list[np.ndarray[Any, Any]]:
        tensors, self._tensors = self._tensors, None  # released on return: a later update need not copy
        if tensors is None:
            raise RuntimeError("this share was already assembled")
        return assemble_pieces([_to_host(t).reshape(-1) for t in tensors], self._outputs, self._layout)


def _to_host(tensor: tf.Tensor) -> np.ndarray[Any, Any]:
    """A host array of a function output, copying only if it lives on an accelerator."""
    if _device_type(tensor.backing_device) == "CPU":
        # No copy. The array keeps the tensor alive; where that is a variable's own buffer (a
        # piece that is one whole variable), TensorFlow updates a variable whose buffer is still
        # referenced by copying it first, so the array keeps this call's values.
        return np.asarray(memoryview(tensor))
    # One device-to-host copy that does not hold on to the device buffer (a memoryview would,
    # for as long as the background write keeps the array).
    host: np.ndarray[Any, Any] = tensor.numpy()
    return host


@dataclass
class _Entry:
    plan: SavePlan  # pinned, so the identity fast path cannot see a recycled id
    rank: int
    function: Callable[[], Sequence[tf.Tensor]] | None  # None: read one by one
    layout: Layout
    host: HostOutputs | None  # the host path's outputs; None: one concatenated output per piece


class FusedSnapshot:
    """A share snapshotter for a fixed set of variables (call it on the training thread).

    ``specs`` maps each name to its :class:`TensorSpec`: pass it as the save's ``tensors``,
    so that planning neither looks at the variables nor checks their specs again.
    ``deferred`` chooses the host-memory path (aliases, assembled later) over the device path
    (pieces concatenated in the call); by default, the host path when every variable is in
    host memory. Both give the same pieces wherever the variables are. ``fast_call`` calls the
    traced function through :func:`direct_call` rather than :func:`public_call`; by default, as
    ``HVDT_TF_FAST_SNAPSHOT`` says (off when unset).
    """

    def __init__(self, variables: Mapping[str, tf.Variable], *, deferred: bool | None = None,
                 fast_call: bool | None = None) -> None:
        for name, var in variables.items():
            if not var.shape.is_fully_defined():
                raise ValueError(f"variable {name!r} has shape {var.shape}; a checkpointed variable needs a "
                                 "static shape")
        self._variables = dict(variables)
        # A variable's shape and dtype never change, so its spec is computed once.
        self.specs = TensorSpecs({name: spec_of(name, var) for name, var in variables.items()})
        self._spec_set = frozenset(self.specs.values())
        self._in_host_memory = all(_device_type(var.device) == "CPU" for var in variables.values())
        self.deferred = self._in_host_memory if deferred is None else deferred
        self.fast_call = fast_call_requested() if fast_call is None else fast_call
        self._entries: OrderedDict[tuple[WriteItem, ...], _Entry] = OrderedDict()
        self._last: _Entry | None = None

    def holds(self, variables: Mapping[str, Any]) -> bool:
        """Whether ``variables`` are exactly this snapshot's variables (same names, same objects)."""
        return (variables.keys() == self._variables.keys()
                and all(variables[name] is var for name, var in self._variables.items()))

    def __call__(self, plan: SavePlan, rank: int) -> list[np.ndarray[Any, Any]] | AliasedShare:
        """This rank's ``plan.for_rank(rank)`` pieces as of this call.

        One host array per piece, in order, or (variables in host memory) an
        :class:`AliasedShare` that builds them later.
        """
        entry = self._entry(plan, rank)
        if entry.function is not None:
            try:
                outputs = entry.function()
            except (tf.errors.OpError, TypeError, ValueError) as exc:  # e.g. no kernel for a dtype
                log.warning("fused checkpoint snapshot failed (%s); reading the variables one by one", exc)
                entry.function = None
            else:
                if entry.host is not None:
                    return AliasedShare(outputs, entry.host, entry.layout)
                return [_to_host(t) for t in outputs]
        # one by one: each variable this rank's pieces touch to host memory, then its bytes copied out
        return [array for _, array in prepare_share(plan, rank, self._variables)]

    def _entry(self, plan: SavePlan, rank: int) -> _Entry:
        last = self._last
        if last is not None and last.plan is plan and last.rank == rank:
            return last  # the manager caches its plans, so a periodic save usually ends here
        # Placements are a pure function of the specs, so once the specs match, this rank's
        # pieces alone determine the function.
        if {p.spec for p in plan.placements} != self._spec_set:
            raise SnapshotPlanError("the save plan was not made from this snapshot's variables (pass its "
                                    "specs as the save's tensors)")
        items = plan.for_rank(rank)
        entry = self._entries.pop(items, None)
        if entry is None:
            layout = share_layout(plan.placements, items)
            host = host_outputs(layout, self.specs) if self.deferred else None
            entry = _Entry(plan, rank, self._build(layout, host, items, plan.world_size, rank), layout, host)
        entry.plan, entry.rank = plan, rank
        self._entries[items] = entry  # most recently used last
        while len(self._entries) > FUNCTION_CACHE_SIZE:
            self._entries.popitem(last=False)
        self._last = entry
        return entry

    def _build(self, layout: Layout, host: HostOutputs | None, items: Sequence[WriteItem], world_size: int,
               rank: int) -> Callable[[], Sequence[tf.Tensor]] | None:
        if not items:
            return None  # nothing to read: this rank writes no piece
        variables, specs = self._variables, self.specs

        def read(name: str) -> tf.Tensor:
            var = variables[name]
            # The raw read: no cast (mixed-precision variables), and quicker to trace.
            value = tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype)
            want = tf.as_dtype(np.dtype(specs[name].dtype))
            if value.dtype != want:
                raise TypeError(f"variable {name!r} reads as {value.dtype}, its checkpoint group is {want}")
            return value

        def read_flat(name: str, minus_one: tf.Tensor) -> tf.Tensor:
            # one [-1] constant per trace, shared by every reshape, keeps tracing short
            value = read(name)
            return value if value.shape.rank == 1 else tf.reshape(value, minus_one)

        def host_fused() -> list[tf.Tensor]:
            assert host is not None
            minus_one = tf.constant([-1])
            outputs = []
            for names, concatenated in zip(host.outputs, host.concatenated):
                if not concatenated:
                    outputs.append(read(names[0]))  # an alias of the variable's buffer
                    continue
                parts = [read_flat(name, minus_one) for name in names]
                outputs.append(parts[0] if len(parts) == 1 else tf.concat(parts, 0))
            return outputs

        def device_fused() -> list[tf.Tensor]:
            flat: dict[str, tf.Tensor] = {}
            minus_one = tf.constant([-1])

            def flat_of(name: str) -> tf.Tensor:
                if name not in flat:
                    flat[name] = read_flat(name, minus_one)
                return flat[name]

            outputs = []
            for slices in layout:
                parts = [flat_of(s.name) if s.whole else flat_of(s.name)[s.lo:s.hi] for s in slices]
                outputs.append(parts[0] if len(parts) == 1 else tf.concat(parts, 0))
            return outputs

        fused = device_fused if host is None else host_fused

        t0 = time.perf_counter()
        try:
            function = tf.function(fused, autograph=False).get_concrete_function()
        except (TypeError, ValueError, AttributeError, tf.errors.OpError) as exc:
            log.warning("cannot trace a fused checkpoint snapshot (%s); reading the variables one by one", exc)
            return None
        make_call = direct_call if self.fast_call else public_call
        call = make_call(function, HOST_EXECUTOR if self._in_host_memory else "")
        if self._in_host_memory:
            try:
                call()  # the first call instantiates the function: now, so a refusal falls back here
            except tf.errors.OpError as exc:
                log.warning("the single-threaded executor cannot run the fused checkpoint snapshot (%s); "
                            "using TensorFlow's default executor", exc)
                call = make_call(function)
        log.info("traced the fused checkpoint snapshot of rank %d of %d (%d piece(s), %s) in %.2f s", rank,
                 world_size, len(items), "host memory" if host is not None else "device",
                 time.perf_counter() - t0)
        return call


def public_call(function: Any, executor_type: str = "") -> Callable[[], Sequence[tf.Tensor]]:
    """A call of ``function`` (a ConcreteFunction of no arguments) through TensorFlow's public API.

    ``executor_type`` names TensorFlow's executor ("" is its default).
    """
    def call() -> Sequence[tf.Tensor]:
        with tf.experimental.function_executor_type(executor_type or None):
            outputs: Sequence[tf.Tensor] = function()
            return outputs

    return call


def direct_call(function: Any, executor_type: str = "") -> Callable[[], Sequence[tf.Tensor]]:
    """Like :func:`public_call`, but straight to TensorFlow's eager runtime (a private API).

    The inputs (the captured variable handles; a variable's handle never changes) and the call's
    attributes are collected once. Where TensorFlow's internals differ from the pinned version's,
    this returns :func:`public_call`'s call.
    """
    try:
        from tensorflow.python.eager import context, execute  # no public equivalent

        ctx = context.context()
        options = ctx.function_call_options.as_attrs()
        attrs = ("executor_type", executor_type, "config_proto", options["config_proto"])
        name = function.name.decode() if isinstance(function.name, bytes) else str(function.name)
        inputs = list(function.captured_inputs)
        count = len(function.outputs)
        run = execute.execute
    except (ImportError, AttributeError, KeyError, TypeError) as exc:
        log.info("no direct call of the fused snapshot (%s); using the public one", exc)
        return public_call(function, executor_type)

    def call() -> Sequence[tf.Tensor]:
        outputs: Sequence[tf.Tensor] = run(name, num_outputs=count, inputs=inputs, attrs=attrs, ctx=ctx)
        return outputs

    # The runtime drops a traced function once its Python object is gone: the call keeps it.
    call.function = function  # type: ignore[attr-defined]
    return call


def _device_type(device: str) -> str | None:
    return tf.DeviceSpec.from_string(device).device_type if device else None
