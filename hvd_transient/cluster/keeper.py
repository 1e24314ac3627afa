"""``hvd-transient cluster keep``: a controller on the driver VM that keeps N Spot workers alive.

Every ``interval`` seconds it looks at the cluster's workers, decides with the pure
:mod:`.keeper_plan`, applies the actions through a :class:`Fleet`, waits for the
operations, classifies failures (stock-out and quota errors back their zone off;
anything else is reported) and records what it did in the run's event log
(``keeper_*`` events, see below) so ``hvd-transient report`` can show the refills,
stock-outs, fallbacks and cost. Training goes on on the survivors meanwhile, and
``horovodrun``'s host discovery adds what comes back.

With a :class:`~.job.Job` (``keep --job 'horovodrun ...'``: a :class:`~.job.CommandJob`) the keeper also
supervises the training job: it launches it once enough workers are RUNNING, ends it when a
wave of preemptions has left it no worker, launches it again (it restores the latest
checkpoint) as soon as capacity is back, and ends with it once it exits 0 (``keeper_job``
events). The pause between passes ends early when the job exits.

Two fleets implement the same protocol: :class:`ComputeFleet` (the Compute REST API)
and :class:`hvd_transient.testing.local_fleet.LocalFleet` (the local simulator).
The clock and the sleep are injectable, so a test drives time itself.

The keeper's own state (per-zone backoff, since when Spot capacity is short, the spend
so far) is saved to ``keeper/<cluster>.json`` in the run store after every pass, so a
restarted keeper - or one run from cron with ``--once`` - carries on where it stopped.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

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
from hvd_transient.cluster.keeper_plan import (
    ERROR,
    GONE,
    Action,
    Create,
    Delete,
    KeeperPolicy,
    KeeperState,
    Observation,
    Outcome,
    Start,
    VMAction,
    Wait,
    WorkerVM,
    accrue,
    hourly_rate,
    on_demand_premium,
    plan,
    provisioning,
    running_after,
    settle,
    state_from_json,
    state_to_json,
    worker_body,
    worker_from_resource,
)
from hvd_transient.cluster.spec import CLUSTER_LABEL, ROLE_LABEL, WORKER, ClusterSpec
from hvd_transient.discovery.ready import ReadyRecord
from hvd_transient.telemetry.schema import (
    EventBody,
    KeeperBudget,
    KeeperCost,
    KeeperError,
    KeeperFallback,
    KeeperJob,
    KeeperRefill,
    KeeperRelease,
    KeeperStart,
    KeeperStockout,
)

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore
    from hvd_transient.gcp.compute_api import ComputeAPI
    from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)

STATE_PREFIX = "keeper/"

# ---- fleets -----------------------------------------------------------------------------------------


class Fleet(Protocol):
    """The workers the keeper manages, wherever they run."""

    def observe(self) -> tuple[WorkerVM, ...]:
        """Every worker of the cluster now, whatever its status."""
        ...

    def apply(self, actions: Sequence[VMAction]) -> list[Outcome]:
        """Do the actions (together where possible), wait for them, one outcome each, in order."""
        ...


class ComputeFleet:
    """The cluster's workers through the Compute REST API: the VMs labelled
    ``hvdt-cluster=<name>`` and ``hvdt-role=worker``, in any zone."""

    def __init__(self, api: "ComputeAPI", spec: ClusterSpec, *, operation_timeout: float = 900.0) -> None:
        self.api, self.spec, self.operation_timeout = api, spec, operation_timeout

    def observe(self) -> tuple[WorkerVM, ...]:
        from hvd_transient.cluster.rest_plan import cluster_filter

        found = self.api.aggregated_instances(self.spec.project, filter=cluster_filter(self.spec.name))
        # the server filtered already; check again so a lenient filter never widens what is managed
        return tuple(sorted(
            (worker_from_resource(i) for i in found
             if (i.get("labels") or {}).get(CLUSTER_LABEL) == self.spec.name
             and (i.get("labels") or {}).get(ROLE_LABEL) == WORKER),
            key=lambda w: (w.zone, w.name)))

    def apply(self, actions: Sequence[VMAction]) -> list[Outcome]:
        from hvd_transient.gcp.compute_api import ComputeAPIError, ComputeConflictError

        outcomes: list[Outcome | None] = [None] * len(actions)
        pending: list[tuple[int, dict[str, Any]]] = []
        for index, action in enumerate(actions):  # send every request first: the operations overlap
            try:
                pending.append((index, self._submit(action)))
            except ComputeConflictError:  # a retried insert was applied, or another keeper made it
                outcomes[index] = Outcome(action)
            except ComputeAPIError as exc:
                _reraise_unless_capacity(exc)
                outcomes[index] = Outcome(action, str(exc), exc.reason or ERROR)
        for index, operation in pending:
            try:
                self.api.wait_operation(operation, timeout=self.operation_timeout)
                outcomes[index] = Outcome(actions[index])
            except ComputeAPIError as exc:
                outcomes[index] = Outcome(actions[index], str(exc), exc.reason or ERROR)
        return [o for o in outcomes if o is not None]

    def _submit(self, action: VMAction) -> dict[str, Any]:
        project = self.spec.project
        if isinstance(action, Create):
            return self.api.insert_instance(project, action.zone,
                                            worker_body(self.spec, action.name, action.zone, action.spot))
        if isinstance(action, Start):
            return self.api.start_instance(project, action.zone, action.name)
        return self.api.delete_instance(project, action.zone, action.name)


def _reraise_unless_capacity(exc: Exception) -> None:
    """Credentials or permissions that fail must stop the keeper (exit 2); a quota 403 must not."""
    from hvd_transient.cluster.keeper_plan import QUOTA, classify_failure
    from hvd_transient.gcp.compute_api import ComputeAuthError

    if isinstance(exc, ComputeAuthError) and classify_failure(exc.reason) != QUOTA:
        raise exc


# ---- state persistence ----------------------------------------------------------------------------


class StateFile:
    """The keeper's state as ``keeper/<cluster>.json`` in the run store; failures only warn."""

    def __init__(self, store: "ObjectStore", cluster: str) -> None:
        self.store, self.key = store, f"{STATE_PREFIX}{cluster}.json"

    def load(self) -> KeeperState:
        try:
            found = self.store.get_versioned(self.key)
        except Exception as exc:  # the keeper must run even when the store is unreachable
            log.warning("could not read %s from %s: %s", self.key, self.store.url, exc)
            return KeeperState()
        if found is None:
            return KeeperState()
        try:
            return state_from_json(json.loads(found[0]))
        except ValueError as exc:
            log.warning("%s is not JSON (%s): starting afresh", self.key, exc)
            return KeeperState()

    def save(self, state: KeeperState) -> None:
        try:
            self.store.put(self.key, json.dumps(state_to_json(state), sort_keys=True).encode())
        except Exception as exc:
            log.warning("could not save the keeper's state to %s: %s", self.store.url, exc)


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
        self._last_cost_at: float | None = None
        self._last_wait = ""
        self._last_job_wait = ""
        self._started = False

    # ---- one pass ----------------------------------------------------------------------------

    def observe(self) -> Observation:
        return Observation(self.clock(), self.fleet.observe())

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

    def _announce(self) -> None:
        if self._started:
            return
        self._started = True
        p = self.policy
        self._emit(KeeperStart(cluster=self.cluster, workers=p.workers, zones=p.zones,
                               instance_type=self.instance_type, spot_per_hour=p.spot_per_hour,
                               on_demand_per_hour=p.on_demand_per_hour, on_demand_after_s=p.on_demand_after_s,
                               max_cost_per_hour=p.max_cost_per_hour, max_total_cost=p.max_total_cost,
                               interval_s=self.interval_s))

    def _report(self, outcome: Outcome, state: KeeperState) -> None:
        action = outcome.action
        kind = "Spot" if action.spot else "on-demand"
        if outcome.ok:
            if isinstance(action, Delete):
                self.out(f"deleted {action.name} ({kind}, {action.zone}): a Spot worker runs in its place")
                self._emit(KeeperRelease(name=action.name, zone=action.zone, reason=action.reason))
            elif isinstance(action, Start):
                self.out(f"started {action.name} ({kind}, {action.zone}, was {action.was})")
                self._emit(KeeperRefill(name=action.name, zone=action.zone, provisioning=provisioning(action.spot),
                                        operation="start", reason=action.reason, was=action.was))
            else:
                avoided = f"; {', '.join(action.avoided)} backed off" if action.avoided else ""
                self.out(f"created {action.name} ({kind}, {action.zone}{avoided})")
                self._emit(KeeperRefill(name=action.name, zone=action.zone, provisioning=provisioning(action.spot),
                                        operation="create", reason=action.reason, avoided_zones=action.avoided))
            return
        failure = outcome.failure
        backoff = state.backoff(action.zone, action.spot)
        retry_in = None if backoff is None else max(0.0, backoff.until - self.clock())
        if failure == GONE:
            self.out(f"gone    {action.name} ({kind}, {action.zone}): it vanished before the {action.operation}")
            return
        if failure == ERROR:
            self.out(f"FAILED  {action.operation} {action.name} ({kind}, {action.zone}): {outcome.error}")
            self._emit(KeeperError(operation=action.operation, error=str(outcome.error), name=action.name,
                                   zone=action.zone, retry_in_s=retry_in))
            return
        self.out(f"{failure:<8} {action.name} ({kind}, {action.zone}): {outcome.code}; {action.zone} backed off "
                 f"for {retry_in or 0:.0f} s")
        self._emit(KeeperStockout(name=action.name, zone=action.zone, provisioning=provisioning(action.spot),
                                  operation=action.operation, code=outcome.code, kind=str(failure),
                                  failures=backoff.failures if backoff else 1, retry_in_s=retry_in or 0.0))

    def _report_fallback_begin(self, before: KeeperState, state: KeeperState, obs: Observation,
                               outcomes: Sequence[Outcome]) -> None:
        if before.fallback_since is not None or state.fallback_since is None:
            return
        created = sum(1 for o in outcomes if o.ok and not o.action.spot and not isinstance(o.action, Delete))
        od_workers = created + sum(1 for w in obs.workers if not w.spot and w.live)
        no_spot = None if before.no_spot_since is None else state.fallback_since - before.no_spot_since
        self.out(f"on-demand fallback: {od_workers} on-demand worker(s) stand in for missing Spot capacity")
        self._emit(KeeperFallback(phase="begin", on_demand_workers=od_workers, no_spot_s=no_spot))

    def _report_fallback_end(self, before: KeeperState, state: KeeperState, obs: Observation) -> None:
        if before.fallback_since is None or state.fallback_since is not None:
            return
        seconds = obs.now - before.fallback_since
        cost = state.spend.on_demand - before.fallback_spend_mark
        self.out(f"back on Spot: the on-demand fallback lasted {seconds:.0f} s and cost ${cost:.4f}")
        self._emit(KeeperFallback(phase="end", on_demand_workers=0, seconds=seconds, on_demand_cost=cost))

    def _report_waits(self, actions: Sequence[Action], state: KeeperState, obs: Observation) -> KeeperState:
        waits = [a for a in actions if isinstance(a, Wait)]
        budget = next((w for w in waits if w.reason == "budget"), None)
        # the message quotes the spend, which grows every pass: a hold is "new" when what holds changes
        note = f"{budget.cap} {budget.limit} {budget.blocked}" if budget is not None else ""
        if budget is not None and note != state.budget_note:
            self._emit(KeeperBudget(cap=budget.cap, limit=budget.limit or 0.0,
                                    rate_per_hour=hourly_rate(obs, self.policy), spent=state.spend.total,
                                    blocked=budget.blocked, message=budget.message))
        text = "; ".join(w.message for w in waits)
        headline = text.split(":", 1)[0]  # without the countdowns, which change every pass
        if text and (headline != self._last_wait or note != state.budget_note):
            self.out(f"waiting: {text}")
        self._last_wait = headline
        return replace(state, budget_note=note)

    def _report_cost(self, obs: Observation) -> None:
        spend = self.state.spend
        self._last_cost_at = obs.now
        self._emit(KeeperCost(
            spent=round(spend.total, 6), spent_spot=round(spend.spot, 6), spent_on_demand=round(spend.on_demand, 6),
            on_demand_premium=round(on_demand_premium(spend, self.policy), 6),
            rate_per_hour=round(hourly_rate(obs, self.policy), 6),
            spot_running=sum(1 for w in obs.workers if w.spot and w.running),
            on_demand_running=sum(1 for w in obs.workers if not w.spot and w.running),
            wanted=self.policy.workers))


def policy_for(spec: ClusterSpec, **settings: Any) -> KeeperPolicy:
    """The policy for a cluster spec: its worker count, zones and ``<name>-worker-<i>`` names
    (``settings``: the other :class:`KeeperPolicy` fields)."""
    return KeeperPolicy(workers=spec.workers, zones=spec.zones, name_prefix=f"{spec.name}-worker-", **settings)


__all__ = ["ComputeFleet", "Fleet", "Keeper", "PassResult", "StateFile", "policy_for"]
