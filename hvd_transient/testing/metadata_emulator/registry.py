"""Thread-safe registry of emulated instances, and the scheduler that moves time forward.

One ``threading.Condition`` guards every instance. Whatever changes state
calls ``notify_all``, which wakes long-polls (``wait_for_change``), hung
requests waiting for their fault to clear, the scheduler (which re-plans its
next wake-up: scheduled notices, deadlines and the end of a fault set for a
given time), and ``wait_for`` callers in tests. Nothing here sleeps.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from .gce_tree import Reply, UnknownPathError, render, under_root
from .model import (
    AWS_TOKEN_TTL_MAX_S,
    DEFAULT_WINDOW_S,
    Fault,
    InstanceExistsError,
    InstanceSnapshot,
    InstanceState,
    InvalidRequestError,
    UnknownInstanceError,
    etag_of,
    parse_signal,
)

log = logging.getLogger(__name__)


class UnknownKeyError(KeyError):
    """A metadata key the emulator does not serve (a 404)."""


def _vm_name(vm_name: str) -> str:
    if not isinstance(vm_name, str) or not vm_name or vm_name != vm_name.strip():
        raise InvalidRequestError(f"bad VM name {vm_name!r}: use a non-empty name")
    return vm_name


class Registry:
    def __init__(self, names: Iterable[str], default: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._instances: dict[str, InstanceState] = {}
        self._stopping = False
        for name in names:
            self.add(name)
        if not self._instances:
            raise InvalidRequestError("the emulator needs at least one instance name")
        self._default = default or next(iter(self._instances))
        if self._default not in self._instances:
            raise UnknownInstanceError(f"default instance {self._default!r} is not among the instances")

    # ---- control ------------------------------------------------------------------
    def add(self, name: str, *, hostname: str | None = None, zone: str | None = None,
            project_id: str | None = None, vm_name: str | None = None) -> InstanceSnapshot:
        if not name or "/" in name or name != name.strip():
            raise InvalidRequestError(f"bad instance name {name!r}: use a non-empty name without '/'")
        with self._cond:
            if name in self._instances:
                raise InstanceExistsError(f"instance {name!r} already exists")
            inst = InstanceState(name=name, hostname=hostname or name)
            if vm_name:
                inst.vm_name = _vm_name(vm_name)
            if zone:
                inst.zone = zone
            if project_id:
                inst.project_id = project_id
            self._instances[name] = inst
            self._cond.notify_all()
            return inst.snapshot()

    def set_vm_name(self, name: str, vm_name: str) -> InstanceSnapshot:
        """Name the VM apart from the host: GCE ``instance/name``, Azure ``compute/name`` and the
        ``Resources`` of its events (the host name stays ``osProfile.computerName``)."""
        with self._cond:
            inst = self._get(name)
            inst.vm_name = _vm_name(vm_name)
            self._cond.notify_all()
            return inst.snapshot()

    def set_attribute(self, name: str, key: str, value: str) -> InstanceSnapshot:
        """Set a custom metadata attribute (``instance/attributes/<key>``), as instance creation does."""
        if not key or "/" in key:
            raise InvalidRequestError(f"bad attribute key {key!r}: use a non-empty key without '/'")
        with self._cond:
            inst = self._get(name)
            inst.attributes[key] = str(value)
            self._cond.notify_all()
            return inst.snapshot()

    def preempt(self, name: str, *, at: float | None = None, delay: float | None = None,
                ago: float | None = None, window: float = DEFAULT_WINDOW_S, kill_pid: int | None = None,
                kill_signal: int | str | None = None, aws_time_format: str = "iso8601") -> InstanceSnapshot:
        """Schedule a preemption notice at ``at`` (epoch), after ``delay`` seconds, or now; or
        give one that came ``ago`` seconds before now (its window counts from then).

        ``window`` seconds after the notice the deadline passes and, if given,
        ``kill_pid`` receives ``kill_signal`` (SIGTERM by default). ``aws_time_format``: how
        ``instance-action`` writes its ``time`` (``model.AWS_TIME_FORMATS``).
        """
        if sum(v is not None for v in (at, delay, ago)) > 1:
            raise InvalidRequestError("give at most one of 'at' (epoch seconds), 'delay' or 'ago' (seconds)")
        if ago is not None and not (math.isfinite(ago) and ago >= 0):
            raise InvalidRequestError(f"'ago' must be a number of seconds >= 0, got {ago}")
        sig = parse_signal(kill_signal)
        try:
            pid = int(kill_pid) if kill_pid is not None else None
            window = float(window)
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"kill_pid must be an integer and window a number of seconds, "
                f"got kill_pid={kill_pid!r}, window={window!r}") from None
        with self._cond:
            inst = self._get(name)
            now = self._clock()
            when = at if at is not None else now - ago if ago is not None else now + (delay or 0.0)
            inst.schedule_preemption(float(when), window, pid, sig, aws_time_format)
            if ago is not None:
                inst.backdate_notice(float(when), now)
                log.info("instance %s: preemption notice %.1f s ago, deadline %.3f", name, ago, inst.deadline)
            elif inst.activate_if_due(now):
                log.info("instance %s: preemption notice now, deadline %.3f", name, inst.deadline)
            else:
                log.info("instance %s: preemption scheduled at %.3f", name, when)
            self._cond.notify_all()
            return inst.snapshot()

    def start_azure_event(self, name: str) -> InstanceSnapshot:
        """Azure: start the instance's eviction event now (``EventStatus: Started``, no ``NotBefore``)."""
        with self._cond:
            inst = self._get(name)
            inst.start_azure_event(self._clock())
            self._cond.notify_all()
            return inst.snapshot()

    def recommend_rebalance(self, name: str) -> InstanceSnapshot:
        """AWS: issue a rebalance recommendation (elevated interruption risk; no deadline) now."""
        with self._cond:
            inst = self._get(name)
            if inst.rebalance_at is None:
                inst.rebalance_at = self._clock()
            self._cond.notify_all()
            return inst.snapshot()

    def set_maintenance(self, name: str, event: str) -> InstanceSnapshot:
        with self._cond:
            inst = self._get(name)
            inst.set_maintenance(event)
            self._cond.notify_all()
            return inst.snapshot()

    def set_fault(self, name: str, mode: str | Fault, *, duration: float | None = None,
                  trickle_s: float | None = None) -> InstanceSnapshot:
        """Apply fault ``mode`` to every metadata reply of ``name``, until cleared (``ok``) or, with
        ``duration``, for that many seconds; the scheduler then ends it and releases hung requests.
        ``trickle_s``: the seconds between two bytes of a ``trickle`` reply."""
        fault = mode if isinstance(mode, Fault) else Fault.parse(mode)
        with self._cond:
            inst = self._get(name)
            inst.set_fault(fault, now=self._clock(), duration=duration, trickle_s=trickle_s)
            self._cond.notify_all()
            return inst.snapshot()

    def reset(self, name: str) -> InstanceSnapshot:
        with self._cond:
            inst = self._get(name)
            inst.reset()
            self._cond.notify_all()
            return inst.snapshot()

    def snapshot(self, name: str) -> InstanceSnapshot:
        with self._cond:
            return self._get(name).snapshot()

    def snapshots(self) -> dict[str, InstanceSnapshot]:
        with self._cond:
            return {n: i.snapshot() for n, i in self._instances.items()}

    @property
    def default(self) -> str:
        return self._default

    def wait_for(self, predicate: Callable[[Mapping[str, InstanceSnapshot]], bool],
                 timeout: float | None) -> bool:
        """Block until ``predicate(snapshots)`` holds; False on timeout or stop."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._stopping or predicate({n: i.snapshot() for n, i in self._instances.items()}),
                timeout)
            return bool(ok) and not self._stopping

    # ---- serving ------------------------------------------------------------------
    def resolve(self, path_instance: str | None) -> str:
        """Which instance a request is for: the ``/i/<name>`` prefix, else the default instance
        (the first one given; ``default`` in ``GET /control/instances``), whatever the Host header."""
        with self._cond:
            if path_instance is not None:
                self._get(path_instance)
                return path_instance
            return self._default

    def begin_request(self, name: str, path: str) -> Fault | None:
        """Count a request and return the fault to apply; blocks while the fault is ``hang``.

        Returns None when the server is stopping (the caller drops the connection).
        """
        with self._cond:
            inst = self._get(name)
            # what is due is due now, even if the scheduler has not woken yet: a request right
            # after a fault's end must see the notice that was scheduled for that moment
            now = self._clock()
            ended = inst.end_fault_if_due(now)
            if inst.activate_if_due(now) or ended:
                self._cond.notify_all()
            inst.requests += 1
            inst.path_hits[path] = inst.path_hits.get(path, 0) + 1
            if inst.fault is not Fault.OK:
                inst.fault_hits[inst.fault.value] = inst.fault_hits.get(inst.fault.value, 0) + 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stopping or inst.fault is not Fault.HANG)
            return None if self._stopping else inst.fault

    def trickle_interval(self, name: str) -> float | None:
        """Seconds between two bytes of a reply to ``name`` now, None unless it trickles."""
        with self._cond:
            inst = self._get(name)
            return inst.trickle_s if inst.fault is Fault.TRICKLE else None

    def gce_read(self, name: str, path: str, *, recursive: bool = False,
                 alt: str | None = None) -> tuple[Reply, str]:
        """The reply and ETag for ``GET /<path>`` (``computeMetadata/v1/...``, or a directory above it)."""
        with self._cond:
            return self._gce_value(self._get(name), path, recursive, alt)

    def gce_wait_for_change(self, name: str, path: str, last_etag: str | None, timeout: float | None, *,
                            recursive: bool = False,
                            alt: str | None = None) -> tuple[Reply, str] | Fault | None:
        """GCE ``wait_for_change``: return when the reply's ETag differs from ``last_etag``
        (at once if it already does) or, without one, from the ETag at call time; return the
        unchanged reply after ``timeout``. For a directory, a change anywhere under it counts.
        None when the server is stopping.

        A fault that begins while the long-poll waits hits it too, as a restarting server fails
        the requests it holds: the fault is returned at once (to answer with, or to lose the
        request); a ``hang`` holds the reply, changed or not, until the hang ends."""
        with self._cond:
            inst = self._get(name)
            _, start_etag = self._gce_value(inst, path, recursive, alt)
            baseline = last_etag if last_etag else start_etag

            def failing() -> bool:
                return not inst.fault.answers and inst.fault is not Fault.HANG

            self._cond.wait_for(
                lambda: self._stopping or failing() or (
                    inst.fault.answers and self._gce_value(inst, path, recursive, alt)[1] != baseline),
                timeout)
            self._cond.wait_for(lambda: self._stopping or inst.fault is not Fault.HANG)
            if self._stopping:
                return None
            if failing():
                inst.fault_hits[inst.fault.value] = inst.fault_hits.get(inst.fault.value, 0) + 1
                self._cond.notify_all()
                return inst.fault
            return self._gce_value(inst, path, recursive, alt)

    def aws_issue_token(self, name: str, ttl_s: int) -> str:
        if not 1 <= ttl_s <= AWS_TOKEN_TTL_MAX_S:
            raise InvalidRequestError(f"token TTL must be 1..{AWS_TOKEN_TTL_MAX_S} seconds, got {ttl_s}")
        with self._cond:
            inst = self._get(name)
            now = self._clock()
            inst.aws_tokens = {t: e for t, e in inst.aws_tokens.items() if e > now}
            token = secrets.token_urlsafe(32)
            inst.aws_tokens[token] = now + ttl_s
            return token

    def aws_read(self, name: str, key: str, token: str | None) -> str | None:
        """The IMDS value, None for a missing key; PermissionError for a bad token."""
        with self._cond:
            inst = self._get(name)
            if not inst.aws_token_valid(token, self._clock()):
                raise PermissionError("missing, invalid or expired IMDSv2 token")
            return inst.aws_values().get(key)

    def azure_document(self, name: str) -> dict[str, Any]:
        """Scheduled Events as ``name`` sees them: every instance's, as in one availability set
        (a VM must pick out the events that name it); the incarnation changes with any of them."""
        with self._cond:
            self._get(name)
            now = self._clock()
            return {"DocumentIncarnation": sum(i.azure_incarnation for i in self._instances.values()),
                    "Events": [e for i in self._instances.values() for e in i.azure_events(now)]}

    def azure_compute(self, name: str) -> dict[str, Any]:
        with self._cond:
            return self._get(name).azure_compute()

    # ---- scheduler and life cycle --------------------------------------------------------
    def run_scheduler(self) -> None:
        """Activate scheduled notices and deliver signals at deadlines, until ``stop``."""
        while True:
            kills: list[tuple[InstanceState, int, signal.Signals]] = []
            with self._cond:
                if self._stopping:
                    return
                now = self._clock()
                changed = False
                for inst in self._instances.values():
                    if inst.end_fault_if_due(now):
                        log.info("instance %s: fault over", inst.name)
                        changed = True
                    if inst.activate_if_due(now):
                        log.info("instance %s: preemption notice, deadline %.3f", inst.name, inst.deadline)
                        changed = True
                    if inst.kill_due(now) and inst.kill_pid is not None:  # (kill_due implies a pid)
                        inst.killed_at = now  # claimed: never signalled twice
                        kills.append((inst, inst.kill_pid, inst.kill_signal or signal.SIGTERM))
                if changed:
                    self._cond.notify_all()
                if not kills:
                    dues = [d for i in self._instances.values() if (d := i.next_due()) is not None]
                    self._cond.wait(max(0.0, min(dues) - now) if dues else None)
                    continue
            for inst, pid, sig in kills:
                self._deliver(inst, pid, sig)

    def _deliver(self, inst: InstanceState, pid: int, sig: signal.Signals) -> None:
        what = _command_of(pid)  # said with the signal: a test's log then shows which process it reached
        try:
            os.kill(pid, sig)
            log.info("instance %s: deadline passed, sent %s to pid %d (%s)", inst.name, sig.name, pid, what)
            error = None
        except OSError as exc:
            log.warning("instance %s: could not send %s to pid %d: %s", inst.name, sig.name, pid, exc)
            error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            if error is not None:
                inst.killed_at, inst.kill_error = None, error
            self._cond.notify_all()

    def reopen(self) -> None:
        """Serve again after ``stop`` (a restarted server keeps its instances' state)."""
        with self._cond:
            self._stopping = False

    def wait_stopping(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for ``stop``; True once stopping."""
        with self._cond:
            return self._cond.wait_for(lambda: self._stopping, timeout)

    def stop(self) -> None:
        """Release every waiter (long-polls, hung requests, the scheduler)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- helpers (call with the lock held) ---------------------------------------------
    def _get(self, name: str) -> InstanceState:
        try:
            return self._instances[name]
        except KeyError:
            known = ", ".join(sorted(self._instances))
            raise UnknownInstanceError(f"unknown instance {name!r}; known instances: {known}") from None

    @staticmethod
    def _gce_value(inst: InstanceState, path: str, recursive: bool, alt: str | None) -> tuple[Reply, str]:
        try:
            reply = render(under_root(inst.gce_values()), path, recursive=recursive, alt=alt)
        except UnknownPathError:
            raise UnknownKeyError(path) from None
        # the ETag follows the content, so a change anywhere under a directory gives it a new one
        return reply, etag_of(f"{path}?recursive={recursive}&alt={alt}", reply.body)


def _command_of(pid: int) -> str:
    """``pid``'s command line, as far as /proc tells it (best effort: for the log only)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200] or "?"
    except OSError:
        return "?"
