"""The standby's worker: a training script run up to its elastic training call before the VM joins.

Started by ``python -m hvd_transient.worker --standby`` (:mod:`hvd_transient.join.worker`), forked
off the standby's supervisor (:mod:`hvd_transient.join.supervisor`). Before the script runs, two
points of Horovod are hooked, so the script itself is unchanged:

* ``HorovodBasics`` (behind ``hvd.init``, ``hvd.size`` ... of every framework): until the
  handoff, ``init`` is recorded instead of done, ``shutdown`` does nothing, and ``size``,
  ``local_size``, ``cross_size``, ``rank``, ``cross_rank`` answer 1, 1, 1, 0, 0 and
  ``local_rank`` the standby's slot, which is all a script asks before it trains (the
  example: ``hvd.DistributedOptimizer``, ``hvdt.elastic_state``, the callbacks);
* ``horovod.common.elastic.run_fn`` (behind ``@hvd.elastic.run``): the first call of the
  decorated function is where the standby stops. It warms the train step up
  (:mod:`hvd_transient.join.warmup`), publishes the host as ready in the run's store
  (``hosts/ready/<host>.json``, :mod:`hvd_transient.discovery.ready`), tells its supervisor,
  and blocks until a launcher hands over. Then it takes the launcher's environment, working
  directory and stdio (dup2 onto 0, 1, 2), performs the recorded ``hvd.init()`` for real and runs
  :func:`after_handoff` callbacks (``hvdt.elastic_state`` defers its rank-0 cold start to
  one: only then is the rank known), and goes on into Horovod's elastic wrapper, whose
  notification service and ``state.sync()`` need the real rendezvous.

A VM under preemption notice is not offered to the job: it would join a ring only to leave it within
its window, and the ring would pay a join and a departure for nothing. The standby watches for notices
from its start (the job's own watcher, on the VM's metadata server). One seen before the warm-up ends
means no ready record: the standby publishes the host as leaving instead (``hosts/leaving/<host>.json``,
which discovery and the keeper read) and ends. One seen while it waits for a job publishes the same
record; a job that still reaches it sees the notice in its own watcher and leaves at once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from hvd_transient.join.launcher import run_script
from hvd_transient.join.options import StandbyOptions
from hvd_transient.join.warmup import RealHorovod, warm_up
from hvd_transient.join.wire import recv_message, send_message

if TYPE_CHECKING:
    from hvd_transient.core.interfaces import NoticeSource
    from hvd_transient.watchers.base import Notice

log = logging.getLogger(__name__)

#: what the deferred Horovod answers before the handoff (``local_rank``: the standby's slot)
ANSWERS: dict[str, Any] = {"size": 1, "local_size": 1, "cross_size": 1, "rank": 0, "cross_rank": 0,
                           "is_homogeneous": True}
#: before it offers the host, the standby gives its watcher at least this long from its start to have
#: read the metadata server (a read a second while it fails): a notice already there is seen first
FIRST_LOOK_S = 2.0
_FRAMEWORK_MODULES = ("horovod.tensorflow.mpi_ops", "horovod.torch.mpi_ops", "horovod.tensorflow.elastic",
                      "horovod.torch.elastic")


class _Standby:
    """This process's standby state (one per process)."""

    def __init__(self) -> None:
        self.pending = False  # a standby that has not been handed a job yet
        self.options: StandbyOptions | None = None
        self.ctl: socket.socket | None = None
        self.deferred_init: Callable[[], Any] | None = None
        self.basics: Any = None  # the framework's HorovodBasics, once the script has called init
        self.real_init: Callable[..., Any] | None = None
        self.real_shutdown: Callable[[Any], Any] | None = None
        self.rehearsed = False  # Horovod ran (and was shut down) in a world of one before the job
        self.initialized = False  # the script has called hvd.init (deferred)
        self.callbacks: list[Callable[[], None]] = []
        self.started = time.monotonic()
        self.watcher: NoticeSource | None = None  # this VM's notices, until the handoff
        self.left = threading.Event()  # the host was published as leaving


_STATE = _Standby()
_LEAVING_LOCK = threading.Lock()


def pending() -> bool:
    """Whether this process is a standby still waiting for its job (Horovod not initialised yet)."""
    return _STATE.pending


def after_handoff(callback: Callable[[], None]) -> None:
    """Run ``callback`` once Horovod is initialised for the job: now, or at a standby's handoff."""
    if _STATE.pending:
        _STATE.callbacks.append(callback)
    else:
        callback()


def run(options: StandbyOptions, ctl: socket.socket) -> None:
    """Run the standby's script (in the worker forked by the supervisor)."""
    _STATE.pending, _STATE.options, _STATE.ctl = True, options, ctl
    _STATE.watcher = _watch(options)
    # a notice during the warm-up must take the host out of discovery at once: the join gate lists a VM
    # with no ready record anyway once its timeout has passed, and a warm-up on a busy VM can outlast it
    threading.Thread(target=_watch_until_handoff, args=(options,), name="hvdt-standby-notice", daemon=True).start()
    # graphs are built as under horovodrun's elastic mode, which sets this for its workers
    os.environ.setdefault("HOROVOD_ELASTIC", "1")
    install_hooks(options.local_rank)
    run_script(options.script, options.args)
    if _STATE.pending:
        raise SystemExit(f"{options.script} ended without calling its @hvd.elastic.run function: "
                         "a standby has nothing to hand a job to")


# ---------------------------------------------------------------- hooks


def install_hooks(local_rank: int) -> None:
    """Defer Horovod's initialisation and stop at the elastic function (before any framework import)."""
    early = [name for name in _FRAMEWORK_MODULES if name in sys.modules]
    if early:
        raise RuntimeError(f"{', '.join(early)} imported before the standby's hooks; they bind Horovod's functions")
    from horovod.common import basics, elastic, process_sets

    _defer_basics(basics.HorovodBasics, {**ANSWERS, "local_rank": local_rank})
    # The global process set lists its ranks only once init ran; until then it holds no rank, and
    # horovod.torch's DistributedOptimizer (made before the handoff) would register no gradient hooks,
    # so this worker would step alone while the ring waits for its allreduces. A world of one, as
    # the deferred answers say, until the real init lists the ring's ranks.
    if not process_sets.global_process_set.ranks:
        process_sets.global_process_set.ranks = [ANSWERS["rank"]]
    _stop_at_run_fn(elastic)


def _while_pending(original: Callable[[Any], Any], value: Any) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def method(self: Any) -> Any:
        return value if _STATE.pending else original(self)
    return method


def _defer_basics(cls: type, answers: dict[str, Any]) -> None:
    # Frameworks bind these methods to their HorovodBasics instance when imported
    # (``size = _basics.size``), so the class is patched before they are.
    for name, value in answers.items():
        setattr(cls, name, _while_pending(getattr(cls, name), value))
    init, shutdown, is_initialized = cls.init, cls.shutdown, cls.is_initialized  # type: ignore[attr-defined]
    _STATE.real_init, _STATE.real_shutdown = init, shutdown

    @functools.wraps(init)
    def deferred_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _STATE.pending:
            return init(self, *args, **kwargs)
        _STATE.deferred_init = functools.partial(init, self, *args, **kwargs)
        _STATE.basics, _STATE.initialized = self, True
        return None

    @functools.wraps(shutdown)
    def deferred_shutdown(self: Any) -> Any:
        if not _STATE.pending:
            return shutdown(self)
        _STATE.deferred_init, _STATE.initialized = None, False
        return None

    @functools.wraps(is_initialized)
    def deferred_is_initialized(self: Any) -> bool:
        return _STATE.initialized if _STATE.pending else bool(is_initialized(self))

    cls.init = deferred_init  # type: ignore[attr-defined]
    cls.shutdown = deferred_shutdown  # type: ignore[attr-defined]
    cls.is_initialized = deferred_is_initialized  # type: ignore[attr-defined]


def _stop_at_run_fn(elastic: Any) -> None:
    run_fn = elastic.run_fn

    def standby_run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
        wrapped = run_fn(func, reset)

        @functools.wraps(func)
        def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
            if _STATE.pending:
                _join(func, reset, state, args, kwargs)
            return wrapped(state, *args, **kwargs)
        return wrapper

    elastic.run_fn = standby_run_fn


# ---------------------------------------------------------------- the handoff


def _join(func: Callable[..., Any], reset: Callable[[], None], state: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> None:
    options, ctl = _STATE.options, _STATE.ctl
    assert options is not None and ctl is not None
    if options.warmup:
        warm_up(func, state, args, kwargs, _real_horovod)
    notice = _notice_before_ready()
    if notice is not None:
        _publish_leaving(options, notice)
        _stop_watching()
        raise SystemExit(f"{options.host} is under preemption notice ({notice.reason}): not offered to the job")
    _publish_ready(options)
    seconds = time.monotonic() - _STATE.started
    log.info("ready for a job after %.1fs", seconds)
    send_message(ctl, {"type": "ready", "seconds": seconds})
    msg, fds = recv_message(ctl, maxfds=3)
    if msg is None:
        raise SystemExit("the standby's supervisor went away before a job came")
    ctl.close()
    _STATE.ctl = None
    _stop_watching()  # the job runs its own watcher
    _take_over(msg, fds)
    _STATE.pending = False
    with _as_first_init():
        if _STATE.deferred_init is not None:
            _STATE.deferred_init()
        else:  # the script never called hvd.init: the framework's own shutdown-and-init does it
            reset()
    _STATE.deferred_init = None
    callbacks, _STATE.callbacks = _STATE.callbacks, []
    for callback in callbacks:
        callback()


@contextlib.contextmanager
def _as_first_init() -> Iterator[None]:
    """After a rehearsal, make the job's ``init`` a joining worker's first one.

    Once Horovod has been shut down, an elastic ``init`` is a running worker's reset: Gloo asks
    the driver for its rank in a *new* round (``rank_and_size``, which records the worker as
    ready for one), and a newcomer would wait for a round nobody else starts. Without
    ``HOROVOD_ELASTIC`` during the call it takes its rank from the environment the driver
    started it with, as a fresh worker does; later resets are elastic again. Only Horovod's GPU
    operations read the flag at ``init``, so there is no rehearsal where they exist.
    """
    elastic = os.environ.pop("HOROVOD_ELASTIC", None) if _STATE.rehearsed else None
    try:
        yield
    finally:
        if elastic is not None:
            os.environ["HOROVOD_ELASTIC"] = elastic


def _take_over(msg: dict[str, Any], fds: list[int]) -> None:
    """Become the launcher's process: its stdio, environment and working directory."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, fd in zip(msg["fds"], fds):
        os.dup2(fd, target)
        os.close(fd)
    env = {str(k): str(v) for k, v in msg["env"].items()}
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(msg["cwd"])
    except OSError as exc:
        log.warning("cannot enter the launcher's working directory %s: %s", msg["cwd"], exc)
    if env.get("PYTHONUNBUFFERED"):  # horovodrun sets it: its output goes through a pipe
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)


def _publish_ready(options: StandbyOptions) -> None:
    if not options.store:
        log.warning("no run store (--store / HVDT_STORE): discovery will list %s only after its join timeout",
                    options.host)
        return
    from ckpt_service.stores import open_store
    from hvd_transient.discovery.ready import publish_ready

    try:
        store = open_store(options.store)
        try:
            publish_ready(store, options.host, pid=os.getpid(), instance_id=options.instance_id)
        finally:
            store.close()
    except Exception as exc:  # the join only waits longer (until the timeout): keep the standby
        log.warning("could not publish %s as ready in %s: %s", options.host, options.store, exc)


# ---------------------------------------------------------------- notices before the job


def _watch(options: StandbyOptions) -> "NoticeSource | None":
    """Start this VM's notice watcher, as the job's protocol would configure it (never raises)."""
    try:
        from hvd_transient.core.config import TransientConfig
        from hvd_transient.core.interfaces import configured_watcher

        watcher = configured_watcher(TransientConfig(store=options.store or ""), options.host)
        if watcher is not None:
            watcher.start()
        return watcher
    except Exception as exc:  # without a watcher the standby is offered as before
        log.warning("the standby of %s watches for no notice: %s", options.host, exc)
        return None


def _stop_watching() -> None:
    watcher, _STATE.watcher = _STATE.watcher, None
    if watcher is not None:
        watcher.stop()


def _notice_before_ready() -> "Notice | None":
    """The notice this VM is under, if any, once the watcher had ``FIRST_LOOK_S`` to read."""
    watcher = _STATE.watcher
    if watcher is None:
        return None
    end = _STATE.started + FIRST_LOOK_S
    while watcher.notice is None and time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))  # a watcher only says what it has read
    return watcher.notice


def _watch_until_handoff(options: StandbyOptions) -> None:
    """A notice that comes before the standby has its job (during the warm-up, or while it waits)
    takes the host out of discovery."""
    while _STATE.pending:
        watcher = _STATE.watcher
        notice = watcher.notice if watcher is not None else None
        if notice is not None:
            _publish_leaving(options, notice)
            return
        if _STATE.left.wait(0.2):
            return


def _publish_leaving(options: StandbyOptions, notice: "Notice") -> None:
    """Publish this host as leaving until its notice's deadline (bounded; a failure is logged), once: a
    second caller waits for the first one's write, so the standby never ends while it is under way."""
    with _LEAVING_LOCK:
        if _STATE.left.is_set():
            return
        _STATE.left.set()
        log.warning("%s is under preemption notice (%s, deadline in %.1f s): it is not offered to the job",
                    options.host, notice.reason, notice.deadline - time.time())
        if not options.store:
            log.warning("no run store (--store / HVDT_STORE): %s cannot be published as leaving", options.host)
            return
        from ckpt_service.stores import open_store
        from hvd_transient.core.membership import publish_leaving_until

        watcher = _STATE.watcher
        try:
            store = open_store(options.store)
            try:
                publish_leaving_until(store, options.host, until=notice.deadline, deadline=notice.deadline,
                                      instance_id=options.instance_id or (watcher.instance_id if watcher else None))
            finally:
                store.close()
        except Exception as exc:  # discovery may then list the host; its job's watcher sees the notice
            log.error("could not publish %s as leaving in %s: %s", options.host, options.store, exc)


def _real_horovod() -> RealHorovod | None:
    """What the warm-up's rehearsal needs of Horovod; None if the script has not called ``hvd.init``."""
    if _STATE.basics is None:
        return None
    assert _STATE.real_init is not None and _STATE.real_shutdown is not None
    return RealHorovod(_STATE.basics, _STATE.real_init, _STATE.real_shutdown, on_init=_rehearsed)


def _rehearsed() -> None:
    _STATE.rehearsed = True
