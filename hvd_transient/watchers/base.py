"""``Notice`` and the ``Watcher`` base: background polling that never raises into its caller.

A watcher runs one daemon thread per *poller* (GCE watches two keys at once).
Each poller's ``poll()`` makes one request (a long-poll may block for a while)
and returns a ``Notice`` or None, or raises. Errors are retried with a jittered
exponential backoff (tenacity) capped at ``MAX_BACKOFF_S`` (1 s) and counted
from the start of the failed request, so while the metadata server errors a
poller still asks it about once a second: the server is on the VM, asking is
cheap, and a notice that appears after a burst of errors must not be seen a
Spot window late. (Each cloud's watcher bounds its requests' timeouts for the
same reason: a hung request must not blind it either.) A stop interrupts the
backoff at once. The first notice from any poller wins, is kept, sets the
event behind ``wait()``, and runs ``on_notice`` on the watcher's thread.
An *early warning* (``Notice.early``: AWS's rebalance recommendation) is kept
apart as ``warning``; it ends only the poller that saw it, and the watcher
goes on watching for the notice itself.
"""
from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import tenacity

from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S

from .deadline import CLOUD_TIME, DETECTED_AT, Deadline

log = logging.getLogger(__name__)

#: Longest wait between the starts of two requests of a poller while they fail (the default
#: ``max_backoff``): a notice is never missed for longer than this plus one request's timeout.
MAX_BACKOFF_S = 1.0
#: First wait after a failure (it doubles, with up to as much jitter, up to ``max_backoff``).
INITIAL_BACKOFF_S = 0.25
#: While requests keep failing, their warning is repeated at most this often (the rest is DEBUG).
FAILURE_LOG_EVERY_S = 30.0

NoticeCallback = Callable[["Notice"], None]


@dataclass(frozen=True)
class Notice:
    """A preemption (or terminating maintenance) notice for this machine.

    ``detected_at`` and ``deadline`` are epoch seconds: when the watcher read the notice, and
    the earliest the machine may be gone (the ``time`` field on AWS, ``NotBefore`` on Azure,
    the window counted from the last read without a notice on GCE; see ``deadline.py``).
    ``deadline_basis`` names the bound the deadline was taken from (``deadline.CLOUD_TIME``,
    ``LAST_CLEAR_READ``, ``FIRST_READ``, ``EVENT_STARTED``, ``DETECTED_AT``). An ``early``
    notice is a warning that the machine is at elevated risk, with no deadline yet (its
    ``deadline`` is only the earliest a real notice could end): checkpoint, keep training, stay.
    """

    source: str
    instance: str
    detected_at: float
    deadline: float
    reason: str
    early: bool = False
    deadline_basis: str = DETECTED_AT

    def seconds_left(self, now: float | None = None) -> float:
        return self.deadline - (time.time() if now is None else now)


class Poller(abc.ABC):
    """One thing a watcher watches, polled on its own thread."""

    name: str = "poll"

    @abc.abstractmethod
    def poll(self) -> Notice | None:
        """One request: a notice, None (nothing yet), or raise on any failure."""

    def pause(self) -> float:
        """Seconds to wait after a poll that found nothing (0 for a long-poll)."""
        return 0.0


class Watcher(abc.ABC):
    """Base of every watcher. ``start()``, then ``wait()`` / ``notice`` / ``on_notice``; ``stop()``."""

    source: ClassVar[str] = "?"

    def __init__(self, *, window: float = GCE_NOTICE_WINDOW_S, instance: str | None = None,
                 on_notice: NoticeCallback | None = None, initial_backoff: float = INITIAL_BACKOFF_S,
                 max_backoff: float = MAX_BACKOFF_S) -> None:
        self.window = float(window)
        self.instance = instance
        #: the cloud's id of this VM where the watcher learns it (leaving records carry it, so a
        #: VM recreated under the same name is told apart from the one that left)
        self.instance_id: str | None = None
        self.on_notice = on_notice
        self._initial_backoff = float(initial_backoff)
        self._max_backoff = float(max_backoff)
        self._lock = threading.Lock()
        self._notice: Notice | None = None
        self._warning: Notice | None = None
        self._found = threading.Event()  # a notice was seen
        self._done = threading.Event()   # a notice was seen or stop() was called
        self._stopped = False
        self._threads: list[threading.Thread] = []

    # ---- subclass API ---------------------------------------------------------------------
    @abc.abstractmethod
    def _pollers(self) -> Sequence[Poller]:
        """The pollers to run, each on its own thread (called by ``start``)."""

    def _on_start(self) -> None:
        """Hook run in ``start()`` on the caller's thread (e.g. to install a signal handler)."""

    def _on_stop(self) -> None:
        """Hook run in ``stop()`` on the caller's thread."""

    def make_notice(self, reason: str, *, detected_at: float | None = None,
                    deadline: float | Deadline | None = None, instance: str | None = None,
                    early: bool = False) -> Notice:
        """A notice seen at ``detected_at`` (now); without a ``deadline``, the window from then."""
        now = time.time() if detected_at is None else detected_at
        if deadline is None:
            deadline = Deadline(now + self.window, DETECTED_AT)
        elif not isinstance(deadline, Deadline):  # a time the notice itself gave
            deadline = Deadline(deadline, CLOUD_TIME)
        return Notice(source=self.source, instance=instance or self.instance or "unknown",
                      detected_at=now, deadline=deadline.at, reason=reason, early=early,
                      deadline_basis=deadline.basis)

    # ---- public API -----------------------------------------------------------------------
    def start(self) -> "Watcher":
        """Start watching in the background (idempotent). Never raises."""
        with self._lock:
            if self._threads or self._stopped:
                return self
            try:
                self._on_start()
                pollers = list(self._pollers())
            except Exception:  # a broken hook must not break the training loop
                log.exception("%s watcher could not start; it will report nothing", self.source)
                return self
            for poller in pollers:
                thread = threading.Thread(target=self._run, args=(poller,), daemon=True,
                                          name=f"watcher-{self.source}-{poller.name}")
                self._threads.append(thread)
            for thread in self._threads:
                thread.start()
        log.info("%s watcher started (%s)", self.source, ", ".join(p.name for p in pollers))
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Stop watching. Returns within about ``timeout`` seconds even if a request is
        in flight: that daemon thread ends when its request does and reports nothing."""
        with self._lock:
            self._stopped = True
            self._done.set()
            threads = list(self._threads)
        try:
            self._on_stop()
        except Exception:
            log.exception("%s watcher: error while stopping", self.source)
        end = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the background threads to end; True if they all have."""
        end = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    @property
    def notice(self) -> Notice | None:
        return self._notice

    @property
    def warning(self) -> Notice | None:
        """The early warning seen so far (AWS rebalance recommendation), if any."""
        return self._warning

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads) and not self._done.is_set()

    def wait(self, timeout: float | None = None) -> Notice | None:
        """Block until a notice is seen (returns it) or ``timeout`` passes (returns None)."""
        self._found.wait(timeout)
        return self._notice

    def __enter__(self) -> "Watcher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the loop -------------------------------------------------------------------------
    def _run(self, poller: Poller) -> None:
        attempt = _TimedAttempt(poller)
        failures = _FailureLog(f"{self.source} watcher ({poller.name})")
        backoff = tenacity.wait_exponential_jitter(initial=self._initial_backoff, max=self._max_backoff,
                                                   jitter=self._initial_backoff)
        retrying = tenacity.Retrying(
            # A request that failed after t seconds (a timeout) has already waited t of the backoff.
            wait=lambda state: max(0.0, backoff(state) - attempt.elapsed()),
            stop=tenacity.stop_when_event_set(self._done),
            sleep=lambda seconds: None if self._done.wait(seconds) else None,  # stop() cuts a backoff short
            before_sleep=failures.failed,
        )
        while not self._done.is_set():
            try:
                notice = retrying(attempt)
            except tenacity.RetryError:  # stopped while failing
                return
            except Exception:  # should not happen; never let the thread die silently
                log.exception("%s watcher (%s): unexpected error", self.source, poller.name)
                self._done.wait(self._max_backoff)
                continue
            failures.recovered()
            if notice is not None:
                self._report(notice)
                return  # a notice ends the watch; a warning ends this poller only
            pause = poller.pause()
            if pause > 0:
                self._done.wait(pause)

    def _report(self, notice: Notice) -> None:
        if notice.early:
            with self._lock:
                if self._warning is not None or self._stopped:
                    return
                self._warning = notice
            log.warning("%s watcher: early warning for %s (%s): checkpointing, training goes on",
                        notice.source, notice.instance, notice.reason)
            return
        with self._lock:
            if self._notice is not None or self._stopped:
                return
            self._notice = notice
            self._found.set()
            self._done.set()
        log.warning("%s watcher: preemption notice for %s (%s), %.1f s to deadline",
                    notice.source, notice.instance, notice.reason, notice.seconds_left())
        if self.on_notice is not None:
            try:
                self.on_notice(notice)
            except Exception:
                log.exception("%s watcher: on_notice callback failed", self.source)


class _TimedAttempt:
    """``poller.poll`` as tenacity's callable, remembering when the latest call started."""

    def __init__(self, poller: Poller) -> None:
        self.poller = poller
        self.started = time.monotonic()

    def __call__(self) -> Notice | None:
        self.started = time.monotonic()
        return self.poller.poll()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class _FailureLog:
    """Logs a run of failed requests without a line a second: the first failure and then one
    every ``FAILURE_LOG_EVERY_S`` as warnings (the rest at DEBUG), and the recovery."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self.first = self.last_warned = 0.0

    def failed(self, state: tenacity.RetryCallState) -> None:
        now = time.monotonic()
        if self.count == 0:
            self.first = now
        self.count += 1
        error = _describe(state.outcome.exception() if state.outcome else None)
        if self.count == 1 or now - self.last_warned >= FAILURE_LOG_EVERY_S:
            self.last_warned = now
            log.warning("%s: %s (%d failed request(s) in %.0f s); next try in %.2f s",
                        self.what, error, self.count, now - self.first, state.upcoming_sleep)
        else:
            log.debug("%s: %s; retry %d in %.2f s", self.what, error, self.count, state.upcoming_sleep)

    def recovered(self) -> None:
        if self.count:
            log.info("%s: the metadata server answers again after %d failed request(s) in %.1f s",
                     self.what, self.count, time.monotonic() - self.first)
        self.count = 0


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "failed"
