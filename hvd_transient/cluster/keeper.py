"""``hvd-transient cluster keep``: a controller on the driver VM that keeps N Spot workers alive.

Every ``interval`` seconds it looks at the cluster's workers, decides with the pure
:mod:`.keeper_plan`, applies the actions through a :class:`~.fleet.Fleet`, waits for the
operations, classifies failures (stock-out and quota errors back their zone off;
anything else is reported) and records what it did in the run's event log
(``keeper_*`` events, worded by :mod:`.keeper_report`) so ``hvd-transient report`` can show
the refills, stock-outs, fallbacks and cost. Training goes on on the survivors meanwhile, and
``horovodrun``'s host discovery adds what comes back.

With a :class:`~.job.Job` (``keep --job 'horovodrun ...'``: a :class:`~.job.CommandJob`) the keeper also
supervises the training job: it launches it once enough workers are RUNNING, ends it when a
wave of preemptions has left it no worker, launches it again (it restores the latest
checkpoint) as soon as capacity is back, and ends with it once it exits 0 (``keeper_job``
events). The pause between passes ends early when the job exits.

Two fleets implement the same protocol: :class:`~.fleet.ComputeFleet` (the Compute REST API)
and :class:`hvd_transient.testing.local_fleet.LocalFleet` (the local simulator).
The clock and the sleep are injectable, so a test drives time itself.

The keeper's own state (per-zone backoff, since when Spot capacity is short, the spend
so far) is saved to ``keeper/<cluster>.json`` in the run store after every pass
(:class:`~.keeper_store.StateFile`), so a restarted keeper - or one run from cron with
``--once`` - carries on where it stopped.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from hvd_transient.cluster.fleet import ComputeFleet, Fleet
from hvd_transient.cluster.job import Job
from hvd_transient.cluster.job_plan import (
    JOB_DONE,
    JOB_FAILED,
    KEEPER_STOPPED,
    JobPolicy,
    JobState,
    LaunchJob,
    describe_job,
    job_ended,
    job_launch,
    job_lost,
    job_started,
    ready_workers,
)
from hvd_transient.cluster.keeper_actions import Action, Outcome, Wait
from hvd_transient.cluster.keeper_cost import accrue
from hvd_transient.cluster.keeper_plan import plan, running_after, settle
from hvd_transient.cluster.keeper_report import (
    cost_event,
    fallback_begin_report,
    fallback_end_report,
    outcome_report,
    start_event,
    wait_report,
)
from hvd_transient.cluster.keeper_state import KeeperPolicy, KeeperState, policy_for
from hvd_transient.cluster.keeper_store import StateFile
from hvd_transient.cluster.vm_failures import ERROR
from hvd_transient.cluster.worker_vms import Observation, WorkerVM
from hvd_transient.core.membership import LeavingRecord, excluded
from hvd_transient.discovery.ready import ReadyRecord
from hvd_transient.telemetry.schema import EventBody, KeeperError, KeeperJob

if TYPE_CHECKING:
    from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)

def under_notice_as_stopping(workers: Sequence[WorkerVM], records: Sequence[LeavingRecord],
                             now: float) -> tuple[WorkerVM, ...]:
    """``workers`` with each RUNNING VM that a current leaving record names (its VM under preemption
    notice, or its standby that saw one) taken as STOPPING (pure): it is on its way down, so it is no
    worker a launch may take and no worker that keeps a job alive, and it is started again, like any
    preempted VM, once it has stopped."""
    going = excluded(records, {w.name: w.incarnation for w in workers}, now)
    return tuple(replace(w, status="STOPPING") if w.running and w.name in going else w for w in workers)


# ---- the loop ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassResult:
    observation: Observation
    actions: tuple[Action, ...]
    outcomes: tuple[Outcome, ...]
    state: KeeperState
    job: JobState | None = None  # after the pass, when a job is supervised

    @property
    def errors(self) -> tuple[Outcome, ...]:
        """Failures other than stock-outs, quota and VMs that vanished meanwhile."""
        return tuple(o for o in self.outcomes if o.failure == ERROR)


class Keeper:
    def __init__(
        self,
        fleet: Fleet,
        policy: KeeperPolicy,
        *,
        cluster: str = "",
        instance_type: str = "",
        events: "EventLog | None" = None,
        state_file: StateFile | None = None,
        interval_s: float = 30.0,
        cost_every_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] | None = None,
        out: Callable[[str], None] | None = None,
        job: Job | None = None,
        job_policy: JobPolicy | None = None,
        job_stop_timeout_s: float = 30.0,
        ready: Callable[[], Sequence[ReadyRecord]] | None = None,
        leaving: Callable[[], Sequence[LeavingRecord]] | None = None,
    ) -> None:
        self.fleet, self.policy = fleet, policy
        self.cluster, self.instance_type = cluster, instance_type
        self.events, self.state_file = events, state_file
        self.interval_s, self.cost_every_s = interval_s, cost_every_s
        self.clock = clock
        self._stopping = threading.Event()
        self._wake = threading.Event()
        # the default sleep ends early when stop() is called (SIGTERM from systemd), on wake(),
        # and when the job exits
        self.sleep: Callable[[float], object] = sleep or self._pause
        self.out = out or (lambda line: print(line, flush=True))
        self.state = state_file.load() if state_file is not None else KeeperState()
        self.job, self.job_policy = job, job_policy or JobPolicy()
        self.job_state = JobState()
        self.job_stop_timeout_s = job_stop_timeout_s
        self.ready = ready  # the standbys' ready records (the run store), for JobPolicy.await_ready_s
        self.leaving = leaving  # the leaving records (the run store): VMs under notice count as going down
        self._last_cost_at: float | None = None
        self._last_wait = ""
        self._last_job_wait = ""
        self._started = False

    # ---- one pass ----------------------------------------------------------------------------

    def observe(self) -> Observation:
        now = self.clock()
        return Observation(now, under_notice_as_stopping(self.fleet.observe(), self._leaving_records(), now))

    def _leaving_records(self) -> Sequence[LeavingRecord]:
        if self.leaving is None:
            return ()
        try:
            return self.leaving()
        except Exception as exc:  # the VMs are taken as the Compute API shows them
            log.warning("could not read the leaving records: %s", exc)
            return ()

    def preview(self) -> PassResult:
        """Look and plan; change nothing, record nothing (``--dry-run``)."""
        obs = self.observe()
        state = accrue(self.state, obs, self.policy)
        return PassResult(obs, plan(obs, state, self.policy), (), state)

    def reconcile(self) -> PassResult:
        """One pass: look, plan, act, wait, record. The state is saved after it."""
        self._announce()
        if self.job is not None:
            self._poll_job()  # before the look, which may fail: an exit is never missed
        obs = self.observe()
        if self.job is not None:
            self._stop_lost_job(obs)
        before = self.state
        state = accrue(before, obs, self.policy)
        actions = plan(obs, state, self.policy)
        vm_actions = [a for a in actions if not isinstance(a, Wait)]
        outcomes = tuple(self.fleet.apply(vm_actions)) if vm_actions else ()
        now = self.clock()
        state = settle(state, outcomes, now, self.policy)
        self._report_fallback_end(before, state, obs)
        for outcome in outcomes:
            self._report(outcome, state)
        self._report_fallback_begin(before, state, obs, outcomes)
        state = self._report_waits(actions, state, obs)
        self.state = state
        if outcomes or self._last_cost_at is None or now - self._last_cost_at >= self.cost_every_s:
            self._report_cost(obs)
        if self.state_file is not None:
            self.state_file.save(state)
        if self.job is not None:
            self._launch_job(obs, outcomes)
        return PassResult(obs, actions, outcomes, state, self.job_state if self.job is not None else None)

    # ---- the job -----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The job has ended for good, and the keeper ends with it."""
        return self.job is not None and self.job_state.finished and not self.job_policy.keep_fleet

    def _poll_job(self) -> None:
        assert self.job is not None
        code = self.job.poll() if self.job_state.running else None
        if code is not None:
            self._job_ended(code, None)

    def _stop_lost_job(self, obs: Observation) -> None:
        assert self.job is not None
        lost = job_lost(self.job_state, obs, self.job_policy)
        if lost is not None:
            self.out(f"job: no worker is left; stopping attempt {self.job_state.attempts} "
                     "(it is launched again when capacity is back)")
            self._job_ended(self.job.stop(self.job_stop_timeout_s), lost.reason)

    def _job_ended(self, code: int, reason: str | None) -> None:
        state = self.job_state
        now = self.clock()
        ran = None if state.started_at is None else max(0.0, now - state.started_at)
        self.job_state = job_ended(state, code, now, self.job_policy)
        self.out(f"job: attempt {state.attempts} exited with status {code}"
                 + (f" after {ran:.0f} s" if ran is not None else "") + (f" ({reason})" if reason else ""))
        self._emit(KeeperJob(phase="exit", attempt=state.attempts, exit_code=code, reason=reason, seconds=ran))
        if self.job_state.phase == JOB_DONE:
            self.out("job: training is complete")
        elif self.job_state.phase == JOB_FAILED:
            self.out(f"job: giving up: {state.relaunches} relaunch(es) of --max-relaunches "
                     f"{self.job_policy.max_relaunches} used")
            self._emit(KeeperJob(phase="give_up", attempt=state.attempts, exit_code=code))

    def _launch_job(self, obs: Observation, outcomes: Sequence[Outcome]) -> None:
        assert self.job is not None
        running = running_after(obs, outcomes)
        now = self.clock()
        awaited = self.job_policy.await_ready_s
        if awaited is not None and not (self.job_state.running or self.job_state.finished):
            running = ready_workers(running, obs.workers, self._ready_records(), now, awaited)
        launch = job_launch(self.job_state, running, now, self.job_policy)
        if launch is None:
            waiting = "" if self.job_state.running or self.job_state.finished else describe_job(
                self.job_state, running, self.job_policy)
            headline = waiting.split(" (", 1)[0]
            if waiting and headline != self._last_job_wait:
                self.out(f"waiting: {waiting}")
            self._last_job_wait = headline
            return
        self._last_job_wait = ""
        self._start_job(launch, now)

    def _ready_records(self) -> Sequence[ReadyRecord]:
        if self.ready is None:
            return ()
        try:
            return self.ready()
        except Exception as exc:  # the launch waits for the timeout instead
            log.warning("could not read the standbys' ready records: %s", exc)
            return ()

    def _start_job(self, launch: LaunchJob, now: float) -> None:
        assert self.job is not None
        try:
            self.job.start(launch.workers)
        except OSError as exc:  # with an argv, a missing program; the shell reports it as 127
            self.out(f"job: FAILED to launch attempt {launch.attempt}: {exc}")
            self.job_state = job_started(self.job_state, launch, now)
            self._job_ended(127, "launch_failed")
            return
        self.job_state = job_started(self.job_state, launch, now)
        workers = ", ".join(launch.workers)
        if launch.relaunch:
            self.out(f"job: relaunched (attempt {launch.attempt}) on {len(launch.workers)} worker(s): {workers}; "
                     f"{launch.waited_s or 0:.0f} s after attempt {launch.attempt - 1} ended")
        else:
            self.out(f"job: launched on {len(launch.workers)} worker(s): {workers}")
        self._emit(KeeperJob(phase="relaunch" if launch.relaunch else "start", attempt=launch.attempt,
                             workers=launch.workers, waited_s=launch.waited_s))

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, *, passes: int | None = None) -> None:
        """Reconcile every ``interval_s`` until :meth:`stop` (or ``passes`` passes)."""
        from hvd_transient.gcp.compute_api import ComputeAPIError, ComputeAuthError, ComputeConfigError

        done = 0
        while not self._stopping.is_set():
            try:
                self.reconcile()
            except (ComputeAuthError, ComputeConfigError):
                raise  # the setup must change: retrying cannot help
            except ComputeAPIError as exc:  # the API is unreachable now: the next pass tries again
                log.warning("keeper pass failed: %s", exc)
                self._emit(KeeperError(operation="observe", error=str(exc)))
            done += 1
            if self.finished or (passes is not None and done >= passes):
                break
            self.sleep(self.interval_s)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def wake(self) -> None:
        """Make the next pass now (the default pause between passes ends)."""
        self._wake.set()

    def _pause(self, seconds: float) -> None:
        """Wait for the next pass; a stop, :meth:`wake` or the end of the job ends the wait early."""
        deadline = time.monotonic() + seconds
        while not self._wake.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self.job is not None and self.job_state.running:
                if self.job.wait(min(left, 0.25)) is not None:
                    break  # the job ended: look now, so that a relaunch need not wait an interval
            else:
                self._wake.wait(left)
        if not self._stopping.is_set():
            self._wake.clear()

    def close(self) -> None:
        """Stop a job still running, record the final cost and write the event log out."""
        if self.job is not None and self.job_state.running:
            self.out(f"job: the keeper is stopping: stopping attempt {self.job_state.attempts}")
            try:
                self._job_ended(self.job.stop(self.job_stop_timeout_s), KEEPER_STOPPED)
            except Exception as exc:  # the events so far must still be written
                log.warning("could not stop the job: %s", exc)
        recent = self._last_cost_at is not None and self.clock() - self._last_cost_at < self.interval_s
        if self._started and not recent:
            try:
                self._report_cost(self.observe())
            except Exception as exc:  # a failing API must not lose the events already made
                log.warning("could not observe the fleet for the final cost: %s", exc)
        if self.events is not None:
            self.events.close()

    # ---- reporting ---------------------------------------------------------------------------

    def _emit(self, body: EventBody) -> None:
        if self.events is not None:
            self.events.emit(body)

    def _say(self, report: tuple[str, EventBody | None] | None) -> None:
        """Print a report's line, then emit its event."""
        if report is None:
            return
        line, event = report
        self.out(line)
        if event is not None:
            self._emit(event)

    def _announce(self) -> None:
        if self._started:
            return
        self._started = True
        self._emit(start_event(self.policy, cluster=self.cluster, instance_type=self.instance_type,
                               interval_s=self.interval_s))

    def _report(self, outcome: Outcome, state: KeeperState) -> None:
        self._say(outcome_report(outcome, state, self.clock()))

    def _report_fallback_begin(self, before: KeeperState, state: KeeperState, obs: Observation,
                               outcomes: Sequence[Outcome]) -> None:
        self._say(fallback_begin_report(before, state, obs, outcomes))

    def _report_fallback_end(self, before: KeeperState, state: KeeperState, obs: Observation) -> None:
        self._say(fallback_end_report(before, state, obs))

    def _report_waits(self, actions: Sequence[Action], state: KeeperState, obs: Observation) -> KeeperState:
        report = wait_report(actions, state, obs, self.policy, self._last_wait)
        if report.event is not None:
            self._emit(report.event)
        if report.line is not None:
            self.out(report.line)
        self._last_wait = report.headline
        return replace(state, budget_note=report.note)

    def _report_cost(self, obs: Observation) -> None:
        self._last_cost_at = obs.now
        self._emit(cost_event(self.state.spend, obs, self.policy))


# ComputeFleet, Fleet, StateFile and policy_for were first defined here: they stay importable.
__all__ = ["ComputeFleet", "Fleet", "Keeper", "PassResult", "StateFile", "policy_for"]
