"""The standby's warm-up: the elastic function's train step run (or traced) before the VM is offered to Horovod.

The warm-up runs the train step once before the host is offered, so that the join does not
trace and instantiate it while the survivors wait (about 2.5 s for the small CNN on 2 cores).
The elastic function is called once with ``Model.fit`` replaced by a stand-in that records its
model and data and aborts the call; then, in a one-process Horovod world (Gloo, no rendezvous),
``state.sync()`` and one train step on fit's first batch run for real (the step's allreduce is
skipped, as in any world of one, by Horovod's size condition), Horovod is shut down, and
``state.restore()`` puts back the weights and counters the state held. The real ``fit`` finds
the function in Keras's cache, already instantiated. The graph does not depend on the ring's
size: Horovod builds it from ``size_op`` in elastic mode (``HOROVOD_ELASTIC=1``, set here as
``horovodrun`` sets it for its workers), and its tensor names are those every other worker's
trace gives. Where Horovod has GPU operations the step is only traced (``get_concrete_function``:
nothing runs), see :func:`hvd_transient.join.standby._as_first_init`. A warm-up that fails leaves
the work to the first step, as without a standby.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealHorovod:
    """What a rehearsal needs of the standby's deferred Horovod (:mod:`hvd_transient.join.standby`).

    The framework's ``HorovodBasics`` the script initialised, its real (not deferred) ``init`` and
    ``shutdown``, and what to call once the real ``init`` ran: the job's ``init`` must then be made
    a joining worker's first one.
    """

    basics: Any
    init: Callable[[Any], Any]
    shutdown: Callable[[Any], Any]
    on_init: Callable[[], None]


#: Horovod variables that would make an ``init`` join a job (or pick a GPU controller); a
#: one-process world is made without them
_JOB_VARIABLES = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_RANK", "HOROVOD_SIZE",
                  "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
                  "HOROVOD_ELASTIC", "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS")


@dataclass(frozen=True)
class FitCall:
    """The model and data of the ``fit`` the elastic function makes."""

    model: Any
    data: dict[str, Any]


class _Captured(Exception):
    """Ends the warm-up call of the elastic function at its ``fit``."""


def warm_up(func: Callable[..., Any], state: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            real_horovod: Callable[[], RealHorovod | None]) -> str:
    """Run the train step of ``func``'s ``fit`` once, or at least trace it; what was done.

    ``rehearsed``: ``state.sync()`` and one train step ran in a one-process Horovod world, then
    the state was restored; ``traced``: the step was traced only; ``none``: no Keras ``fit``.
    ``real_horovod`` is asked once ``func`` has run up to its ``fit``: None if the script has not
    called ``hvd.init`` by then (nothing is rehearsed).
    """
    started = time.monotonic()
    call = capture_fit(func, state, args, kwargs)
    if call is None:
        return "none"
    done = "none"
    horovod = real_horovod()
    if horovod is not None and can_rehearse(horovod):
        try:
            rehearse(call, state, horovod)
            done = "rehearsed"
        except Exception as exc:  # the state is restored; tracing alone still helps
            log.warning("could not rehearse a train step (%s: %s); tracing it only", type(exc).__name__, exc)
    if done == "none":
        try:
            done = "traced" if trace_train_step(call) else "none"
        except Exception as exc:  # the first step traces instead, as it would without a standby
            log.warning("could not trace the train step (%s: %s)", type(exc).__name__, exc)
    log.info("warm-up (%s) took %.1fs", done, time.monotonic() - started)
    return done


def capture_fit(func: Callable[..., Any], state: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> FitCall | None:
    """Call the elastic function with ``Model.fit`` replaced by a stand-in that records its model
    and data and aborts the call; what it recorded (None: no Keras fit, or the call failed)."""
    if "tensorflow" not in sys.modules:
        return None
    import tensorflow as tf

    model_class = tf.keras.Model
    fit = model_class.fit
    calls: list[FitCall] = []

    def capturing_fit(model: Any, x: Any = None, y: Any = None, batch_size: Any = None, epochs: int = 1,
                      verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0,
                      validation_data: Any = None, shuffle: bool = True, class_weight: Any = None,
                      sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: Any = None,
                      *rest: Any, **options: Any) -> Any:
        calls.append(FitCall(model, {"x": x, "y": y, "batch_size": batch_size, "shuffle": shuffle,
                                     "class_weight": class_weight, "sample_weight": sample_weight,
                                     "steps_per_epoch": steps_per_epoch}))
        raise _Captured

    model_class.fit = capturing_fit
    try:
        func(state, *args, **kwargs)
    except _Captured:
        pass
    except Exception as exc:
        log.warning("warm-up: the elastic function failed before its fit (%s: %s)", type(exc).__name__, exc)
        return None
    finally:
        model_class.fit = fit
    if not calls:
        log.warning("warm-up: the elastic function did not call Model.fit; the first step will trace")
        return None
    return calls[0]


@contextlib.contextmanager
def _data_iterator(call: FitCall) -> Iterator[Any]:
    """The first iterator ``fit`` would make for this data (Keras 2's data handler), in fit's scopes."""
    from keras.src.engine import data_adapter, training_utils

    model = call.model
    with model.distribute_strategy.scope(), training_utils.RespectCompiledTrainableState(model):
        handler = data_adapter.get_data_handler(initial_epoch=0, epochs=1, max_queue_size=10, workers=1,
                                                use_multiprocessing=False, model=model,
                                                steps_per_execution=model._steps_per_execution,  # noqa: SLF001
                                                **call.data)
        for _, iterator in handler.enumerate_epochs():
            yield iterator
            return
        raise ValueError("fit's data gave no epoch")


def trace_train_step(call: FitCall) -> bool:
    """Trace the model's train function for ``fit``'s iterator; nothing runs. Whether it could."""
    with _data_iterator(call) as iterator:
        concrete = getattr(call.model.make_train_function(), "get_concrete_function", None)
        if concrete is None:  # run eagerly: nothing to trace
            return False
        concrete(iterator)
    return True


def can_rehearse(horovod: RealHorovod) -> bool:
    """Whether a one-process rehearsal is possible and harmless: Horovod has no GPU operations,
    which are the only ones that read ``HOROVOD_ELASTIC`` at init (see
    :func:`hvd_transient.join.standby._as_first_init`)."""
    basics = horovod.basics
    return not any(bool(getattr(basics, probe)()) for probe in ("nccl_built", "cuda_built", "rocm_built", "ddl_built"))


def rehearse(call: FitCall, state: Any, horovod: RealHorovod) -> None:
    """The state sync and one train step in a one-process Horovod world, then the state as it was.

    Every tf.function the join runs first (the sync's broadcasts, the train step) is traced and
    instantiated here; in a world of one the step's allreduce is skipped (Horovod's size
    condition), and the weights it changed are restored from the state's snapshot.
    """
    with _one_process_world(horovod):
        try:
            state.sync()  # its snapshot is taken before the step
            with _data_iterator(call) as iterator:
                call.model.make_train_function()(iterator)
        finally:
            state.restore()
            call.model.reset_metrics()


@contextlib.contextmanager
def _one_process_world(horovod: RealHorovod) -> Iterator[None]:
    saved = dict(os.environ)
    for name in _JOB_VARIABLES:
        os.environ.pop(name, None)
    for name in [n for n in os.environ if n.startswith("HOROVOD_GPU_")]:
        os.environ.pop(name)
    os.environ.update(HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo")
    horovod.init(horovod.basics)
    horovod.on_init()
    # graphs traced now are built as in the job (Horovod reads this when building them)
    os.environ["HOROVOD_ELASTIC"] = saved.get("HOROVOD_ELASTIC", "1")
    try:
        yield
    finally:
        horovod.shutdown(horovod.basics)
        os.environ.clear()
        os.environ.update(saved)
