"""The training job ``hvd-transient cluster keep --job`` supervises, as pure functions over frozen
dataclasses: when to launch it, when to end it, what its exit means (:mod:`.keeper` applies them)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from hvd_transient.cluster.worker_vms import Observation, WorkerVM
from hvd_transient.discovery.hosts import Host
from hvd_transient.discovery.ready import JoinGate, ReadyRecord

JOB_WAITING = "waiting"  # not launched yet: fewer than min_workers RUNNING
JOB_RUNNING = "running"
JOB_EXITED = "exited"    # failed; launched again once min_workers are RUNNING
JOB_DONE = "done"        # exited 0: training is complete
JOB_FAILED = "failed"    # failed, and no relaunch is left

# Why the keeper ended a job itself (the ``reason`` of its exit)
NO_WORKERS = "no_workers"
KEEPER_STOPPED = "keeper_stopped"


@dataclass(frozen=True)
class JobPolicy:
    #: launch (and relaunch) once this many workers are RUNNING
    min_workers: int = 1
    #: launches after the first; None: no limit
    max_relaunches: int | None = 10
    #: go on keeping the workers once the job has ended (else the keeper ends with it)
    keep_fleet: bool = False
    #: the workers publish themselves ready (at the end of their boot, or once their ``--standby`` is
    #: warm): a launch counts only the workers ready in their current boot, or that booted this many
    #: seconds ago; None: every RUNNING worker
    await_ready_s: float | None = None
    #: end a job none of whose workers is left (see :func:`job_lost`)
    stop_when_lost: bool = True

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be at least 1, not {self.min_workers}")
        if self.max_relaunches is not None and self.max_relaunches < 0:
            raise ValueError(f"max_relaunches must be >= 0, not {self.max_relaunches}")


@dataclass(frozen=True)
class JobState:
    phase: str = JOB_WAITING
    attempts: int = 0  # launches so far
    started_at: float | None = None  # of the latest attempt
    ended_at: float | None = None
    exit_code: int | None = None

    @property
    def relaunches(self) -> int:
        return max(0, self.attempts - 1)

    @property
    def running(self) -> bool:
        return self.phase == JOB_RUNNING

    @property
    def finished(self) -> bool:
        """Done or failed for good: nothing more will be launched."""
        return self.phase in (JOB_DONE, JOB_FAILED)


@dataclass(frozen=True)
class LaunchJob:
    attempt: int  # from 1
    workers: tuple[str, ...]  # RUNNING now
    waited_s: float | None = None  # a relaunch: since the previous attempt ended

    @property
    def relaunch(self) -> bool:
        return self.attempt > 1


@dataclass(frozen=True)
class StopJob:
    reason: str


def job_lost(state: JobState, obs: Observation, policy: JobPolicy) -> StopJob | None:
    """A running job none of whose workers is live any more (a wave took them all) is ended.

    Nothing of it is left but its checkpoints, and horovodrun would only end by itself after
    ``--elastic-timeout`` (default 600 s) without slots; and when VMs come back under the same
    names before that, its elastic driver counts them as the hosts it had and launches no
    worker there. A relaunch on what is RUNNING again restores the emergency checkpoint."""
    if policy.stop_when_lost and state.running and not any(w.live for w in obs.workers):
        return StopJob(NO_WORKERS)
    return None


def ready_workers(running: Sequence[str], workers: Sequence[WorkerVM], records: Sequence[ReadyRecord],
                  now: float, timeout_s: float) -> tuple[str, ...]:
    """Of the ``running`` workers, those a launch may use when the workers publish themselves ready:
    discovery's join gate, applied to every boot (a VM that published itself ready in this boot, at
    its end or once its standby was warm, or that booted ``timeout_s`` ago or more). A VM that is
    RUNNING may still be booting (a worker horovodrun starts there would fail); a standby is also
    the fastest start a relaunch can get."""
    seen = {w.name: w.incarnation for w in workers}
    observed = [Host(name, incarnation=seen[name]) for name in running if name in seen]  # not those started now
    gate = JoinGate(standby_since=-math.inf, join_timeout_s=timeout_s)
    return tuple(h.name for h in gate.admit(observed, records, now))


def job_launch(state: JobState, running: Sequence[str], now: float, policy: JobPolicy) -> LaunchJob | None:
    """Launch the job the first time, or again after a failure, once ``min_workers`` are RUNNING."""
    if state.phase not in (JOB_WAITING, JOB_EXITED) or len(running) < policy.min_workers:
        return None
    waited = None if state.ended_at is None else max(0.0, now - state.ended_at)
    return LaunchJob(state.attempts + 1, tuple(running), waited if state.attempts else None)


def job_started(state: JobState, launch: LaunchJob, now: float) -> JobState:
    return replace(state, phase=JOB_RUNNING, attempts=launch.attempt, started_at=now, ended_at=None,
                   exit_code=None)


def job_ended(state: JobState, exit_code: int, now: float, policy: JobPolicy) -> JobState:
    """Exit 0 is the end of training; any other status is a failure to relaunch, while relaunches are left."""
    if exit_code == 0:
        phase = JOB_DONE
    elif policy.max_relaunches is not None and state.relaunches >= policy.max_relaunches:
        phase = JOB_FAILED
    else:
        phase = JOB_EXITED
    return replace(state, phase=phase, ended_at=now, exit_code=exit_code)


def describe_job(state: JobState, running: Sequence[str], policy: JobPolicy) -> str:
    """One line for people: what the job does now, and what it waits for."""
    if state.phase == JOB_RUNNING:
        return f"job attempt {state.attempts} running"
    if state.phase == JOB_DONE:
        return f"job done (attempt {state.attempts} exited 0)"
    if state.phase == JOB_FAILED:
        return f"job failed (exit {state.exit_code}; {state.relaunches} relaunch(es) used)"
    what = "relaunch" if state.phase == JOB_EXITED else "launch"
    if policy.await_ready_s:
        return f"job {what} when {policy.min_workers} worker(s) are RUNNING and ready ({len(running)} now)"
    return f"job {what} when {policy.min_workers} worker(s) are RUNNING ({len(running)} now)"


__all__ = ["JOB_DONE", "JOB_EXITED", "JOB_FAILED", "JOB_RUNNING", "JOB_WAITING", "KEEPER_STOPPED", "NO_WORKERS",
           "JobPolicy", "JobState", "LaunchJob", "StopJob", "describe_job", "job_ended", "job_launch", "job_lost",
           "job_started", "ready_workers"]
