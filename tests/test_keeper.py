"""`hvd-transient cluster keep`: the pure plan, the loop against the fake Compute API, the CLI, the local fleet.

Time is a fake clock the tests advance; the fake API's operations finish on their first poll.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace

import pytest
from fake_compute_api import QUOTA_EXCEEDED, STOCKOUT, FakeComputeAPI

from ckpt_service.stores import LocalStore
from hvd_transient.cluster import cli
from hvd_transient.cluster.fleet import ComputeFleet
from hvd_transient.cluster.job import CommandJob, exit_status, note_process, start_ticks
from hvd_transient.cluster.job_plan import (
    JOB_DONE,
    JOB_EXITED,
    JOB_FAILED,
    JOB_RUNNING,
    JOB_WAITING,
    KEEPER_STOPPED,
    NO_WORKERS,
    JobPolicy,
    JobState,
    LaunchJob,
    StopJob,
    job_ended,
    job_launch,
    job_lost,
    job_started,
)
from hvd_transient.cluster.keeper import Keeper, under_notice_as_stopping
from hvd_transient.cluster.keeper_actions import (
    ON_DEMAND_FALLBACK,
    RECREATE,
    REPLACE_ON_DEMAND,
    RESTART,
    SPOT_RUNNING,
    Create,
    Delete,
    Outcome,
    Start,
    Wait,
)
from hvd_transient.cluster.keeper_cost import accrue, on_demand_premium
from hvd_transient.cluster.keeper_plan import plan, running_after, settle
from hvd_transient.cluster.keeper_state import Backoff, KeeperPolicy, KeeperState, Spend, backoff_delay, policy_for
from hvd_transient.cluster.keeper_store import StateFile, state_from_json, state_to_json
from hvd_transient.cluster.rest_plan import instance_body, worker_body
from hvd_transient.cluster.spec import ClusterSpec, plan_instances
from hvd_transient.cluster.vm_failures import ERROR, GONE, QUOTA, classify_failure
from hvd_transient.cluster.worker_vms import Observation, WorkerVM
from hvd_transient.core.membership import LeavingRecord
from hvd_transient.discovery.ready import ReadyRecord
from hvd_transient.gcp.compute_api import ComputeAPI
from hvd_transient.gcp.instances import Incarnation
from hvd_transient.join.user_dirs import try_lock
from hvd_transient.telemetry.events import EventLog, read_events, read_records
from hvd_transient.telemetry.schema import KeeperRefill

PROJECT, ZA, ZB, ZC = "proj-1", "us-central1-a", "us-central1-b", "us-central1-c"
T0 = 1_700_000_000.0


def policy(**overrides) -> KeeperPolicy:
    values = dict(workers=3, zones=(ZA, ZB), name_prefix="exp-worker-", spot_per_hour=0.5, on_demand_per_hour=1.5)
    values.update(overrides)
    return KeeperPolicy(**values)


def vm(index: int, zone: str = ZA, status: str = "RUNNING", spot: bool = True) -> WorkerVM:
    return WorkerVM(f"exp-worker-{index}", zone, status, spot)


def look(*workers: WorkerVM, now: float = T0) -> Observation:
    return Observation(now, tuple(workers))


def spec(**overrides) -> ClusterSpec:
    values = dict(name="exp", project=PROJECT, zones=(ZA, ZB), workers=3, startup_script="#!/bin/bash\necho hi\n")
    values.update(overrides)
    return ClusterSpec(**values)


# ---- the pure plan ----------------------------------------------------------------------------


def test_nothing_to_do_when_every_worker_runs():
    assert plan(look(vm(0), vm(1, ZB), vm(2)), KeeperState(), policy()) == ()
    # nor while one is still coming up, or on its way down (a preemption in progress)
    assert plan(look(vm(0), vm(1, ZB, "PROVISIONING"), vm(2, ZA, "STOPPING")), KeeperState(), policy()) == ()


def test_missing_workers_are_created_round_robin_as_up_spreads_them():
    actions = plan(look(), KeeperState(), policy())
    assert all(isinstance(a, Create) and a.spot and a.reason == RECREATE for a in actions)
    assert [(a.name, a.zone) for a in actions] == [(p.name, p.zone) for p in plan_instances(spec())[1:]]
    # with one worker in A, the next two go where there are fewer
    actions = plan(look(vm(0)), KeeperState(), policy(zones=(ZA, ZB, ZC)))
    assert [(a.name, a.zone) for a in actions] == [("exp-worker-1", ZB), ("exp-worker-2", ZC)]


def test_stopped_workers_are_started_again_and_deleted_ones_recreated():
    actions = plan(look(vm(0, ZA, "TERMINATED"), vm(2, ZA)), KeeperState(), policy())
    assert actions == (Start("exp-worker-0", ZA, True, "TERMINATED", RESTART),
                       Create("exp-worker-1", ZB, True, RECREATE))


def test_stockout_backs_the_zone_off_once_per_pass_and_creation_fails_over():
    p = policy()
    start, create = Start("exp-worker-0", ZA, True, "TERMINATED"), Create("exp-worker-3", ZA, True, RECREATE)
    state = settle(KeeperState(), [Outcome(start, "no capacity", STOCKOUT), Outcome(create, "no capacity", STOCKOUT)],
                   T0, p)
    assert state.backoffs == (Backoff(ZA, True, 1, T0 + 60, STOCKOUT),)  # two failures, one pass: counted once
    assert state.no_spot_since == T0
    assert state.available(ZA, False, T0)  # on-demand capacity is another pool

    workers = (vm(0, ZA, "TERMINATED"), vm(1, ZB), vm(2, ZA))
    actions = plan(look(*workers, now=T0 + 10), state, p)
    assert actions == (Create("exp-worker-3", ZB, True, RECREATE, avoided=(ZA,)),)  # not a restart in A

    state = settle(state, [Outcome(start, "again", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")], T0 + 60, p)
    assert state.backoff(ZA, True) == Backoff(ZA, True, 2, T0 + 60 + 120, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")
    assert state.no_spot_since == T0  # the clock runs from the first refusal
    assert plan(look(*workers, now=T0 + 179), state, p) == (Create("exp-worker-3", ZB, True, RECREATE, (ZA,)),)
    assert plan(look(*workers, now=T0 + 180), state, p)[0] == Start("exp-worker-0", ZA, True, "TERMINATED", RESTART)

    state = settle(state, [Outcome(start)], T0 + 180, p)  # capacity is back
    assert state.backoffs == ()


def test_backoff_is_exponential_and_capped():
    assert [backoff_delay(n, policy()) for n in range(1, 8)] == [60, 120, 240, 480, 960, 1800, 1800]
    assert backoff_delay(3, policy(backoff_initial_s=5, backoff_max_s=15)) == 15


def test_quota_in_every_zone_waits_for_the_first_to_reopen():
    state = KeeperState(backoffs=(Backoff(ZA, True, 1, T0 + 60, QUOTA_EXCEEDED),
                                  Backoff(ZB, True, 2, T0 + 120, QUOTA_EXCEEDED)), no_spot_since=T0)
    (wait,) = plan(look(vm(0), vm(1, ZB), now=T0 + 1), state, policy())
    assert isinstance(wait, Wait) and wait.reason == "backoff" and wait.until == T0 + 60
    assert "1 worker(s) missing" in wait.message and "QUOTA_EXCEEDED" in wait.message
    assert plan(look(vm(0), vm(1, ZB), now=T0 + 60), state, policy()) == (Create("exp-worker-2", ZA, True, RECREATE,
                                                                                 avoided=(ZB,)),)


def test_on_demand_fallback_after_the_configured_time_then_back_to_spot():
    p = policy(on_demand_after_s=600)
    closed = (Backoff(ZA, True, 3, T0 + 900, STOCKOUT), Backoff(ZB, True, 3, T0 + 900, STOCKOUT))
    state = KeeperState(backoffs=closed, no_spot_since=T0)
    (wait,) = plan(look(vm(0), vm(1, ZB), now=T0 + 599), state, p)
    assert isinstance(wait, Wait) and "on-demand fallback in 1 s" in wait.message
    assert plan(look(vm(0), vm(1, ZB), now=T0 + 599), state, policy()) == (wait.__class__(
        "backoff", wait.message.split("; on-demand")[0], wait.until),)  # no fallback configured: no promise either

    fallback = plan(look(vm(0), vm(1, ZB), now=T0 + 600), state, p)
    assert fallback == (Create("exp-worker-2", ZA, False, ON_DEMAND_FALLBACK),)

    # the stand-in runs; Spot is still out: nothing to do
    standing = (vm(0), vm(1, ZB), vm(2, ZA, spot=False))
    assert plan(look(*standing, now=T0 + 700), state, p) == ()
    # Spot capacity is back: a Spot worker is made to replace it, where there are fewer workers ...
    replace_it = plan(look(*standing, now=T0 + 900), state, p)
    assert replace_it == (Create("exp-worker-3", ZB, True, REPLACE_ON_DEMAND),)
    # ... the on-demand one stays while its replacement is not RUNNING ...
    assert plan(look(*standing, vm(3, ZB, "STAGING"), now=T0 + 930), state, p) == ()
    # ... and goes once it is
    assert plan(look(*standing, vm(3, ZB), now=T0 + 960), state, p) == (
        Delete("exp-worker-2", ZA, False, SPOT_RUNNING),)

    # a whole Spot fleet ends the "no Spot capacity" episode
    assert accrue(state, look(vm(0), vm(1, ZB), vm(3, ZB), now=T0 + 990), p).no_spot_since is None


def test_budget_cap_per_hour_refuses_a_worker_and_says_so():
    p = policy(max_cost_per_hour=1.2)  # two Spot workers run at 1.0/h; a third would make 1.5/h
    (wait,) = plan(look(vm(0), vm(1, ZB)), KeeperState(), p)
    assert isinstance(wait, Wait) and wait.reason == "budget" and wait.cap == "per_hour"
    assert wait.limit == 1.2 and wait.blocked == 1 and "--max-cost-per-hour $1.20" in wait.message
    assert plan(look(vm(0), vm(1, ZB)), KeeperState(), policy(max_cost_per_hour=1.5))[0].name == "exp-worker-2"
    # a Spot worker replacing an on-demand one is charged at the rate after the swap (1.0/h, not 2.5/h)
    swap = plan(look(vm(0), vm(1, ZB, spot=False)), KeeperState(), policy(workers=2, max_cost_per_hour=2.1))
    assert swap == (Create("exp-worker-2", ZA, True, REPLACE_ON_DEMAND),)
    # the fallback is refused when it would break the cap
    state = KeeperState(backoffs=(Backoff(ZA, True, 1, T0 + 60, STOCKOUT), Backoff(ZB, True, 1, T0 + 60, STOCKOUT)),
                        no_spot_since=T0 - 60)
    (wait,) = plan(look(vm(0), vm(1, ZB)), state, policy(on_demand_after_s=0, max_cost_per_hour=2.0))
    assert wait.reason == "budget"


def test_budget_total_cap_stops_creation():
    p = policy(max_total_cost=10.0)  # 1.0/h running; a third for the next minute: 1.5/60 = 0.025
    (wait,) = plan(look(vm(0), vm(1, ZB)), KeeperState(spend=Spend(spot=9.99)), p)
    assert wait.reason == "budget" and wait.cap == "total"
    assert "$9.9900 spent of --max-total-cost $10.00" in wait.message
    assert isinstance(plan(look(vm(0), vm(1, ZB)), KeeperState(spend=Spend(spot=9.97)), p)[0], Create)


def test_costs_accrue_by_observed_running_time():
    p = policy(spot_per_hour=0.36, on_demand_per_hour=0.72)
    first = accrue(KeeperState(), look(vm(0), vm(1, spot=False), vm(2, status="PROVISIONING")), p)
    assert first.spend == Spend() and first.running == (("exp-worker-0", True), ("exp-worker-1", False))
    assert first.fallback_since == T0  # on-demand workers stand in
    later = accrue(first, look(vm(0), vm(2), now=T0 + 3600), p)
    assert later.spend.spot == pytest.approx(0.36) and later.spend.on_demand == pytest.approx(0.72)
    assert later.spend.total == pytest.approx(1.08) and later.spend.on_demand_seconds == 3600
    assert on_demand_premium(later.spend, p) == pytest.approx(0.36)  # what the stand-in cost beyond Spot
    assert later.fallback_since is None and later.running == (("exp-worker-0", True), ("exp-worker-2", True))
    # nobody watched for a day: the gap is charged as at most max_accrual_gap_s
    days_later = accrue(later, look(vm(0), vm(2), now=T0 + 3600 + 86400), p)
    assert days_later.spend.spot == pytest.approx(0.36 + 2 * 0.36)


def test_failures_are_classified():
    assert classify_failure("ZONE_RESOURCE_POOL_EXHAUSTED") == "stockout"
    assert classify_failure("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS") == "stockout"
    assert classify_failure("QUOTA_EXCEEDED") == QUOTA == classify_failure("quotaExceeded")
    assert classify_failure("notFound") == GONE
    assert classify_failure("badRequest") == ERROR == classify_failure("")
    # a VM that vanished meanwhile backs nothing off
    gone = Outcome(Start("exp-worker-0", ZA, True, "TERMINATED"), "404", "notFound")
    assert settle(KeeperState(), [gone], T0, policy()) == KeeperState()


def test_state_round_trips_through_json():
    state = KeeperState(backoffs=(Backoff(ZA, True, 2, T0 + 5, STOCKOUT),), no_spot_since=T0, spend=Spend(1.0, 2.0, 30),
                        observed_at=T0, running=(("exp-worker-0", True),), fallback_since=T0, fallback_spend_mark=0.5,
                        budget_note="budget: x")
    assert state_from_json(json.loads(json.dumps(state_to_json(state)))) == state
    assert state_from_json({"backoffs": [{"zone": ZA}]}) == KeeperState()
    assert state_from_json([1, 2]) == KeeperState()


def test_worker_bodies_are_ups_and_on_demand_gpu_workers_do_not_migrate():
    s = spec(termination_action="DELETE")
    spot_plan = plan_instances(s)[2]
    assert worker_body(s, spot_plan.name, spot_plan.zone, True) == instance_body(spot_plan, s)
    body = worker_body(s, "exp-worker-7", ZB, False)
    assert body["scheduling"] == {"provisioningModel": "STANDARD", "onHostMaintenance": "TERMINATE",
                                  "automaticRestart": True}
    assert body["labels"]["hvdt-role"] == "worker" and body["guestAccelerators"][0]["acceleratorCount"] == 1
    cpu = spec(gpu_type=None)
    assert worker_body(cpu, "exp-worker-7", ZB, False)["scheduling"]["onHostMaintenance"] == "MIGRATE"


# ---- the loop against the fake Compute API ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def fake():
    with FakeComputeAPI(operation_polls=1) as api:
        yield api


class Rig:
    """A keeper over the fake API with a fake clock, an event log and a state file in a local store."""

    def __init__(self, fake: FakeComputeAPI, run_dir, cluster: ClusterSpec, **settings) -> None:
        self.fake, self.spec, self.clock = fake, cluster, Clock()
        self.store = LocalStore(str(run_dir))
        self.lines: list[str] = []
        settings.setdefault("spot_per_hour", 0.36)
        settings.setdefault("on_demand_per_hour", 0.72)
        self.policy = policy_for(cluster, **settings)
        self.api = ComputeAPI.connect(api_url=fake.base_url, anonymous=True, attempts=1)
        self.keeper = self.new_keeper()

    def new_keeper(self) -> Keeper:
        """A keeper as a fresh process (or the next ``--once``) would make it."""
        return Keeper(ComputeFleet(self.api, self.spec), self.policy, cluster=self.spec.name,
                      instance_type="n1-standard-8+nvidia-tesla-t4",
                      events=EventLog(self.store, "driver", min_flush_interval_s=0.0),
                      state_file=StateFile(self.store, self.spec.name), clock=self.clock, sleep=self.clock.advance,
                      out=self.lines.append)

    def step(self, seconds: float = 30.0):
        self.clock.advance(seconds)
        return self.keeper.reconcile()

    def vms(self) -> dict[str, dict]:
        return {i["name"]: i for i in self.fake.instances(PROJECT)}

    def events(self, kind: str | None = None) -> list[dict]:
        self.keeper.events.flush()
        return [e for e in read_events(self.store) if kind is None or e["event"] == kind]

    def inserts(self, zone: str | None = None) -> list:
        return [r for r in self.fake.requests_matching("POST", "/instances") if zone is None or f"/{zone}/" in r.path]


def test_loop_restarts_a_worker_preempted_with_stop(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec())
    first = rig.keeper.reconcile()
    assert [a.name for a in first.actions] == ["exp-worker-0", "exp-worker-1", "exp-worker-2"]
    assert {n: (i["status"], i["zone"].rsplit("/", 1)[1]) for n, i in rig.vms().items()} == {
        "exp-worker-0": ("RUNNING", ZA), "exp-worker-1": ("RUNNING", ZB), "exp-worker-2": ("RUNNING", ZA)}
    before = rig.vms()["exp-worker-0"]

    fake.preempt(PROJECT, ZA, "exp-worker-0")
    assert rig.vms()["exp-worker-0"]["status"] == "TERMINATED"
    result = rig.step()
    assert result.actions == (Start("exp-worker-0", ZA, True, "TERMINATED", RESTART),)
    after = rig.vms()["exp-worker-0"]
    assert after["status"] == "RUNNING" and after["id"] == before["id"]  # the same VM, started again
    assert after["lastStartTimestamp"] > before["lastStartTimestamp"]
    assert len(rig.inserts()) == 3 and fake.requests_matching("POST", "exp-worker-0/start")
    assert "started exp-worker-0 (Spot, us-central1-a, was TERMINATED)" in rig.lines
    refills = rig.events("keeper_refill")
    assert refills[-1] | {"t": 0, "pid": 0} == {
        "t": 0, "pid": 0, "event": "keeper_refill", "host": "driver", "name": "exp-worker-0", "zone": ZA,
        "provisioning": "spot", "operation": "start", "reason": "restart", "was": "TERMINATED", "avoided_zones": []}
    assert rig.step().actions == ()  # whole again


def test_loop_recreates_a_worker_preempted_with_delete(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(termination_action="DELETE"))
    rig.keeper.reconcile()
    old_id = rig.vms()["exp-worker-1"]["id"]
    assert rig.vms()["exp-worker-1"]["scheduling"]["instanceTerminationAction"] == "DELETE"
    fake.preempt(PROJECT, ZB, "exp-worker-1")
    assert "exp-worker-1" not in rig.vms()
    assert rig.step().actions == (Create("exp-worker-1", ZB, True, RECREATE),)
    assert rig.vms()["exp-worker-1"]["status"] == "RUNNING" and rig.vms()["exp-worker-1"]["id"] != old_id
    assert rig.vms()["exp-worker-1"]["labels"] == {"hvdt-cluster": "exp", "hvdt-role": "worker"}


def test_loop_fails_over_to_another_zone_when_one_is_exhausted(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(termination_action="DELETE"))
    rig.keeper.reconcile()
    fake.exhaust(ZA)
    fake.preempt(PROJECT, ZA, "exp-worker-0")
    fake.preempt(PROJECT, ZA, "exp-worker-2")
    # both are recreated where they were (A: none left there, B holds one): A answers with stock-outs
    failed = rig.step()
    assert [(o.action.name, o.action.zone, o.code) for o in failed.outcomes] == [
        ("exp-worker-0", ZA, STOCKOUT), ("exp-worker-2", ZA, STOCKOUT)]
    assert failed.state.backoff(ZA, True).failures == 1  # one pass, one step of backoff
    assert set(rig.vms()) == {"exp-worker-1"}
    # the next pass fails over to B, sending nothing to A
    a_inserts = len(rig.inserts(ZA))
    result = rig.step()
    assert result.actions == (Create("exp-worker-0", ZB, True, RECREATE, avoided=(ZA,)),
                              Create("exp-worker-2", ZB, True, RECREATE, avoided=(ZA,)))
    assert len(rig.inserts(ZA)) == a_inserts
    assert {n: i["zone"].rsplit("/", 1)[1] for n, i in rig.vms().items()} == {
        "exp-worker-0": ZB, "exp-worker-1": ZB, "exp-worker-2": ZB}
    stockout, _second = rig.events("keeper_stockout")
    assert {k: stockout[k] for k in ("name", "zone", "provisioning", "operation", "code", "kind", "failures",
                                     "retry_in_s")} == {
        "name": "exp-worker-0", "zone": ZA, "provisioning": "spot", "operation": "create", "code": STOCKOUT,
        "kind": "stockout", "failures": 1, "retry_in_s": 60.0}
    assert rig.events("keeper_refill")[-1]["avoided_zones"] == [ZA]
    assert any(line.startswith("stockout exp-worker-0 (Spot, us-central1-a)") for line in rig.lines)


def test_loop_backs_off_on_quota_everywhere_then_refills_when_capacity_returns(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(workers=2))
    fake.exhaust(ZA, QUOTA_EXCEEDED)
    fake.exhaust(ZB, QUOTA_EXCEEDED)
    first = rig.keeper.reconcile()
    assert [o.failure for o in first.outcomes] == ["quota", "quota"] and rig.vms() == {}
    assert [e["kind"] for e in rig.events("keeper_stockout")] == ["quota", "quota"]

    # the next process (a --once from cron) remembers the backoff from the state file
    rig.keeper.close()
    rig.keeper = rig.new_keeper()
    fake.restore()  # capacity is back, but the keeper does not know yet
    sent = len(fake.requests)
    waiting = rig.step(30)
    assert [a.reason for a in waiting.actions] == ["backoff"] and not waiting.outcomes
    assert [r.method for r in fake.requests[sent:]] == ["GET"]  # it only looked
    assert any(line.startswith("waiting: 2 worker(s) missing; no zone to try now: ") for line in rig.lines)

    refilled = rig.step(30)
    assert [(type(a).__name__, a.zone) for a in refilled.actions] == [("Create", ZA), ("Create", ZB)]
    assert all(i["status"] == "RUNNING" for i in rig.vms().values()) and len(rig.vms()) == 2
    assert refilled.state.backoffs == ()


def test_loop_stops_creating_at_the_budget_cap_and_says_so(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(workers=2, termination_action="DELETE"), max_total_cost=0.05)
    rig.keeper.reconcile()  # two workers: 0.72/h, charged from their creation
    assert rig.step(240).state.spend.total == pytest.approx(0.048)
    fake.preempt(PROJECT, ZB, "exp-worker-1")
    inserts = len(rig.inserts())
    held = rig.step(30)  # 0.054 spent: a worker more for the next minute would pass 0.05
    (wait,) = held.actions
    assert wait.reason == "budget" and wait.cap == "total" and len(rig.inserts()) == inserts
    rig.step(30)
    (budget,) = rig.events("keeper_budget")  # said once, not on every pass
    assert budget["cap"] == "total" and budget["limit"] == 0.05 and budget["blocked"] == 1
    assert budget["spent"] == pytest.approx(0.72 * 270 / 3600)
    assert "creating no more workers" in budget["message"]
    assert any(line.startswith("waiting: budget: ") for line in rig.lines)
    rig.keeper.close()  # the final cost
    cost = rig.events("keeper_cost")[-1]
    assert cost["spent"] == pytest.approx(0.72 * 270 / 3600 + 0.36 * 30 / 3600) and cost["rate_per_hour"] == 0.36


def test_loop_falls_back_to_on_demand_and_returns_to_spot(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(workers=2), on_demand_after_s=120.0)
    rig.keeper.reconcile()
    fake.exhaust(ZA, spot_only=True)
    fake.exhaust(ZB, spot_only=True)
    fake.preempt(PROJECT, ZA, "exp-worker-0")
    first_refusal = rig.step().state.no_spot_since
    while not any(not i["scheduling"]["provisioningModel"] == "SPOT" for i in rig.vms().values()):
        result = rig.step()
        assert rig.clock.now - first_refusal < 180
    assert rig.clock.now - first_refusal >= 120  # not before the configured time
    (stand_in,) = [i for i in rig.vms().values() if i["scheduling"]["provisioningModel"] == "STANDARD"]
    assert stand_in["name"] == "exp-worker-2" and stand_in["status"] == "RUNNING"
    assert stand_in["scheduling"]["onHostMaintenance"] == "TERMINATE"  # a GPU VM cannot live-migrate
    assert stand_in["labels"]["hvdt-role"] == "worker"  # host discovery lists it like any worker
    assert result.actions[-1] == Create("exp-worker-2", ZA, False, ON_DEMAND_FALLBACK)

    fake.restore()  # Spot capacity returns
    for _ in range(12):
        if "exp-worker-2" not in rig.vms():
            break
        rig.step()
    assert set(rig.vms()) == {"exp-worker-0", "exp-worker-1"}
    assert all(i["scheduling"]["provisioningModel"] == "SPOT" for i in rig.vms().values())
    rig.step()
    kinds = [(e["event"], e.get("phase") or e.get("reason")) for e in rig.events()
             if e["event"] in ("keeper_fallback", "keeper_refill", "keeper_release")]
    assert kinds[-5:] == [("keeper_refill", ON_DEMAND_FALLBACK), ("keeper_fallback", "begin"),
                          ("keeper_refill", REPLACE_ON_DEMAND), ("keeper_release", SPOT_RUNNING),
                          ("keeper_fallback", "end")]
    (begin, end) = rig.events("keeper_fallback")
    assert begin["on_demand_workers"] == 1 and begin["no_spot_s"] >= 120
    assert end["seconds"] > 0 and end["on_demand_cost"] == pytest.approx(0.72 * end["seconds"] / 3600, rel=0.3)
    cost = rig.events("keeper_cost")[-1]
    assert cost["spent_on_demand"] > 0 and cost["on_demand_premium"] == pytest.approx(cost["spent_on_demand"] / 2)


def test_event_log_reads_back_as_typed_records(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(workers=1))
    rig.keeper.run(passes=3)
    assert rig.clock.slept == [30.0, 30.0]  # run() sleeps between passes through the injected sleep
    rig.keeper.close()
    records = read_records(LocalStore(str(tmp_path / "run")))
    assert [r.event for r in records if r.event != "keeper_cost"] == ["keeper_start", "keeper_refill"]
    start = records[0].body
    assert (start.cluster, start.workers, start.zones, start.spot_per_hour) == ("exp", 1, (ZA, ZB), 0.36)
    assert isinstance(records[1].body, KeeperRefill) and records[1].body.name == "exp-worker-0"
    assert json.loads((tmp_path / "run" / "keeper" / "exp.json").read_text())["observed_at"] == T0 + 60


def test_loop_survives_an_unreachable_api(fake, tmp_path):
    rig = Rig(fake, tmp_path / "run", spec(workers=1))
    fake.fail_next(1, status=503)
    rig.keeper.run(passes=2)
    assert [e["event"] for e in rig.events() if e["event"] != "keeper_cost"] == [
        "keeper_start", "keeper_error", "keeper_refill"]
    assert rig.events("keeper_error")[0]["operation"] == "observe"
    assert set(rig.vms()) == {"exp-worker-0"}


# ---- the CLI ------------------------------------------------------------------------------------------

KEEP = ["keep", "--name", "exp", "--project", PROJECT, "--zones", f"{ZA},{ZB}", "--workers", "2"]


@pytest.fixture
def compute(monkeypatch, tmp_path):
    monkeypatch.setenv("HVDT_KEEPER_DIR", str(tmp_path / "keeper"))  # each test's keeper owns its own job
    with FakeComputeAPI(operation_polls=2) as api:
        monkeypatch.setenv("HVDT_COMPUTE_API", api.base_url)
        monkeypatch.setenv("HVDT_COMPUTE_ANONYMOUS", "1")
        yield api


def test_keep_once_refills_and_records(compute, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert cli.main([*KEEP, "--once", "--store", str(run)]) == 0
    out = capsys.readouterr().out
    assert "created exp-worker-0 (Spot, us-central1-a)" in out and "created exp-worker-1 (Spot, us-central1-b)" in out
    assert sorted(i["name"] for i in compute.instances(PROJECT)) == ["exp-worker-0", "exp-worker-1"]
    events = read_events(LocalStore(str(run)))
    assert [e["event"] for e in events] == ["keeper_start", "keeper_refill", "keeper_refill", "keeper_cost"]
    start = events[0]
    assert start["instance_type"] == "n1-standard-8+nvidia-tesla-t4"
    assert (start["spot_per_hour"], start["on_demand_per_hour"]) == pytest.approx((0.0963 + 0.14, 0.37999 + 0.35))
    assert (run / "keeper" / "exp.json").is_file()
    # the VMs carry the store like `up` makes them
    meta = {m["key"]: m["value"] for m in compute.instances(PROJECT)[0]["metadata"]["items"]}
    assert meta["hvdt-store"] == str(run) and meta["hvdt-role"] == "worker"

    compute.preempt(PROJECT, ZB, "exp-worker-1")
    assert cli.main([*KEEP, "--once", "--store", str(run)]) == 0
    assert "started exp-worker-1 (Spot, us-central1-b, was TERMINATED)" in capsys.readouterr().out


def test_keep_once_exits_1_when_an_operation_fails_otherwise(compute, capsys):
    compute.rejected_inserts["exp-worker-1"] = ("INVALID_FIELD_VALUE", "bad image")
    assert cli.main([*KEEP, "--once"]) == 1
    assert "FAILED  create exp-worker-1 (Spot, us-central1-b)" in capsys.readouterr().out
    compute.rejected_inserts.clear()
    compute.exhaust(ZA)
    assert cli.main([*KEEP, "--once"]) == 0  # a stock-out is the keeper's business, not a failure


def test_keep_dry_run_prints_the_actions_and_changes_nothing(compute, capsys):
    compute.add_instance(PROJECT, ZA, "exp-worker-0", status="TERMINATED", provisioning_model="SPOT",
                         labels={"hvdt-cluster": "exp", "hvdt-role": "worker"})
    compute.add_instance(PROJECT, ZA, "exp-driver", labels={"hvdt-cluster": "exp", "hvdt-role": "driver"})
    assert cli.main([*KEEP, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "0 of 2 workers live (dry run: nothing was changed)" in out
    assert "start   exp-worker-0 (Spot, us-central1-a, was TERMINATED; restart)" in out
    assert "create  exp-worker-1 (Spot, us-central1-b, recreate)" in out
    assert "exp-driver" not in out  # the driver is not the keeper's
    assert {r.method for r in compute.requests} == {"GET"}

    assert cli.main([*KEEP, "--dry-run", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(a["action"], a["name"]) for a in doc["actions"]] == [("start", "exp-worker-0"), ("create", "exp-worker-1")]
    assert doc["workers"] == [{"name": "exp-worker-0", "zone": ZA, "status": "TERMINATED", "spot": True,
                               "incarnation": {"instance_id": "1000", "started_at": None}}]


@pytest.mark.parametrize("bad, option", [
    (["--interval", "0"], "--interval"),
    (["--on-demand-after", "soon"], "--on-demand-after"),
    (["--max-cost-per-hour", "-1"], "--max-cost-per-hour"),
    (["--max-total-cost", "0"], "--max-total-cost"),
    (["--backoff", "nan"], "--backoff"),
])
def test_keep_bad_arguments_exit_2(bad, option, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*KEEP, *bad, "--dry-run"])
    assert exited.value.code == 2 and option in capsys.readouterr().err


def test_keep_settings_it_cannot_keep_exit_2(capsys):
    assert cli.main([*KEEP, "--backoff", "100", "--backoff-max", "10", "--dry-run"]) == 2
    assert "--backoff-max" in capsys.readouterr().err
    # one pass per process keeps neither the spend nor the "no Spot since" clock without a store
    assert cli.main([*KEEP, "--once", "--max-total-cost", "5", "--on-demand-after", "600"]) == 2
    assert "--max-total-cost and --on-demand-after with --once need --store" in capsys.readouterr().err
    # a cap needs a price: an unknown machine type is refused before anything is sent
    assert cli.main([*KEEP, "--machine-type", "n2-standard-4", "--max-cost-per-hour", "5", "--dry-run"]) == 2
    assert "no price for instance type 'n2-standard-4+nvidia-tesla-t4'" in capsys.readouterr().err


# ---- the local simulator -------------------------------------------------------------------------------


def test_local_fleet_refills_preempted_hosts_through_the_state_file(tmp_path):
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec
    from hvd_transient.testing.local_fleet import LocalFleet

    work = tmp_path / "work"
    work.mkdir()
    cluster = LocalCluster(LocalClusterSpec(store=str(tmp_path / "store"), hosts=("localhost", "127.0.0.1"),
                                            command=("true",), workdir=work))
    for host in cluster.spec.hosts:  # the VMs are up (no horovodrun needed to drive the state file)
        cluster.add_host(host)
    fleet = LocalFleet(cluster)
    clock = Clock()
    keeper = Keeper(fleet, fleet.policy(3), clock=clock, sleep=clock.advance, out=lambda _line: None)

    grown = keeper.reconcile()  # a third host: the first spare alias
    assert grown.actions == (Create("127.0.1", "local", True, RECREATE),)
    assert fleet.listed() == ["localhost", "127.0.0.1", "127.0.1"]

    started = cluster.vm_started["127.0.0.1"]
    cluster._vm_stopped("127.0.0.1")  # the preemption window ended: the simulator stops the VM
    assert "127.0.0.1" not in fleet.listed()
    assert WorkerVM("127.0.0.1", "local", "TERMINATED", True) in fleet.observe()
    refilled = keeper.reconcile()
    assert refilled.actions == (Start("127.0.0.1", "local", True, "TERMINATED", RESTART),)
    doc = json.loads(cluster.state_file.read_text())
    entry = next(h for h in doc["hosts"] if h["host"] == "127.0.0.1")
    assert entry["started_at"] >= started  # a new incarnation: discovery admits it again
    assert keeper.reconcile().actions == ()
    cluster.close()


def test_policy_for_names_workers_like_up():
    p = policy_for(spec(workers=2), spot_per_hour=1.0)
    assert (p.workers, p.zones, p.name_prefix, p.spot_per_hour) == (2, (ZA, ZB), "exp-worker-", 1.0)
    assert replace(p, workers=0).workers == 0


# ---- supervising the training job ---------------------------------------------------------------------


def test_the_job_launches_once_enough_workers_run():
    policy_ = JobPolicy(min_workers=2)
    assert job_launch(JobState(), ("exp-worker-0",), T0, policy_) is None
    launch = job_launch(JobState(), ("exp-worker-0", "exp-worker-1"), T0, policy_)
    assert launch == LaunchJob(1, ("exp-worker-0", "exp-worker-1")) and not launch.relaunch
    running = job_started(JobState(), launch, T0)
    assert (running.phase, running.attempts, running.started_at) == (JOB_RUNNING, 1, T0)
    assert job_launch(running, ("exp-worker-0", "exp-worker-1"), T0 + 1, policy_) is None  # never twice


def test_a_failed_job_is_relaunched_only_once_capacity_is_back_and_exit_0_ends_it():
    policy_ = JobPolicy(min_workers=2, max_relaunches=3)
    running = job_started(JobState(), LaunchJob(1, ("a", "b")), T0)
    failed = job_ended(running, 1, T0 + 100, policy_)
    assert (failed.phase, failed.exit_code, failed.ended_at) == (JOB_EXITED, 1, T0 + 100)
    assert job_launch(failed, (), T0 + 110, policy_) is None  # the wave took every worker
    assert job_launch(failed, ("a",), T0 + 120, policy_) is None
    again = job_launch(failed, ("a", "c"), T0 + 130, policy_)
    assert again == LaunchJob(2, ("a", "c"), waited_s=30.0) and again.relaunch
    second = job_started(failed, again, T0 + 130)
    assert second.attempts == 2 and second.relaunches == 1 and second.exit_code is None
    done = job_ended(second, 0, T0 + 500, policy_)
    assert done.phase == JOB_DONE and done.finished
    assert job_launch(done, ("a", "c"), T0 + 501, policy_) is None


def test_relaunches_stop_at_the_maximum():
    policy_ = JobPolicy(max_relaunches=1)
    state = job_started(JobState(), LaunchJob(1, ("a",)), T0)
    state = job_ended(state, 137, T0 + 1, policy_)
    assert state.phase == JOB_EXITED
    state = job_started(state, job_launch(state, ("a",), T0 + 2, policy_), T0 + 2)
    state = job_ended(state, 137, T0 + 3, policy_)
    assert state.phase == JOB_FAILED and state.finished and job_launch(state, ("a",), T0 + 4, policy_) is None
    assert job_ended(job_started(JobState(), LaunchJob(1, ("a",)), T0), 2, T0, JobPolicy(max_relaunches=0)).phase \
        == JOB_FAILED
    assert job_ended(job_started(JobState(), LaunchJob(1, ("a",)), T0), 2, T0, JobPolicy(max_relaunches=None)).phase \
        == JOB_EXITED
    with pytest.raises(ValueError):
        JobPolicy(min_workers=0)


def test_a_job_without_any_live_worker_is_ended():
    running = job_started(JobState(), LaunchJob(1, ("exp-worker-0",)), T0)
    gone = look(vm(0, status="TERMINATED"), vm(1, status="STOPPING"))
    assert job_lost(running, gone, JobPolicy()) == StopJob(NO_WORKERS)
    assert job_lost(running, look(vm(0, status="TERMINATED"), vm(1, status="PROVISIONING")), JobPolicy()) is None
    assert job_lost(running, gone, JobPolicy(stop_when_lost=False)) is None
    assert job_lost(JobState(), gone, JobPolicy()) is None  # nothing runs


def test_running_after_counts_what_this_pass_started():
    obs = look(vm(0), vm(1, status="TERMINATED"), vm(2, spot=False))
    outcomes = [Outcome(Start("exp-worker-1", ZA, True, "TERMINATED")),
                Outcome(Create("exp-worker-3", ZB, True, RECREATE), "no", STOCKOUT),
                Outcome(Delete("exp-worker-2", ZA, False, SPOT_RUNNING))]
    assert running_after(obs, outcomes) == ("exp-worker-0", "exp-worker-1")


class FakeFleet:
    """Workers in memory: starts and creates succeed (RUNNING at once) but in exhausted zones."""

    def __init__(self) -> None:
        self.vms: dict[str, WorkerVM] = {}
        self.exhausted: set[str] = set()

    def observe(self) -> tuple[WorkerVM, ...]:
        return tuple(sorted(self.vms.values(), key=lambda w: w.name))

    def apply(self, actions):
        outcomes = []
        for action in actions:
            if action.zone in self.exhausted:
                outcomes.append(Outcome(action, "no capacity", STOCKOUT))
            else:
                self.vms[action.name] = WorkerVM(action.name, action.zone, "RUNNING", action.spot)
                outcomes.append(Outcome(action))
        return outcomes

    def preempt_all(self) -> None:
        self.vms = {n: replace(w, status="TERMINATED") for n, w in self.vms.items()}


class FakeJob:
    """A job whose exit the test decides; stop() ends it as SIGTERM would."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, ...]] = []
        self.code: int | None = None
        self.stops = 0

    def start(self, workers):
        assert self.code is not None or not self.launches, "launched while running"
        self.launches.append(tuple(workers))
        self.code = None

    def exit(self, code: int) -> None:
        self.code = code

    def poll(self):
        return self.code

    def wait(self, timeout):
        return self.code

    def stop(self, timeout):
        self.stops += 1
        self.code = 143
        return 143


class JobRig:
    def __init__(self, tmp_path, **job_policy) -> None:
        self.fleet, self.job, self.clock, self.lines = FakeFleet(), FakeJob(), Clock(), []
        self.store = LocalStore(str(tmp_path / "run"))
        self.keeper = Keeper(self.fleet, policy(workers=2),
                             events=EventLog(self.store, "driver", min_flush_interval_s=0), clock=self.clock,
                             sleep=self.clock.advance, out=self.lines.append, job=self.job,
                             job_policy=JobPolicy(**job_policy))

    def step(self, seconds: float = 30.0):
        self.clock.advance(seconds)
        return self.keeper.reconcile()

    def jobs(self) -> list[dict]:
        self.keeper.events.flush()
        return [{k: v for k, v in e.items() if k not in ("t", "host", "pid", "event")}
                for e in read_events(self.store) if e["event"] == "keeper_job"]


def test_keeper_launches_relaunches_when_capacity_returns_and_ends_with_the_job(tmp_path):
    rig = JobRig(tmp_path, min_workers=2)
    rig.fleet.exhausted.add(ZB)
    first = rig.keeper.reconcile()  # one worker in A, B is out of capacity: not enough to launch
    assert first.job == JobState() and first.job.phase == JOB_WAITING and rig.job.launches == []
    assert "waiting: job launch when 2 worker(s) are RUNNING (1 now)" in rig.lines
    second = rig.step()  # B backed off: the second worker goes to A, and the job is launched in the same pass
    assert rig.job.launches == [("exp-worker-0", "exp-worker-1")] and second.job.phase == JOB_RUNNING
    assert rig.step().job.attempts == 1  # running: nothing to do

    rig.job.exit(1)  # the job fails on its own while its workers run: relaunched at once
    rig.step()
    assert rig.job.launches[-1] == ("exp-worker-0", "exp-worker-1") and rig.keeper.job_state.attempts == 2
    rig.job.exit(0)  # training is complete
    done = rig.step()
    assert done.job.phase == JOB_DONE and rig.keeper.finished and len(rig.job.launches) == 2
    assert "job: training is complete" in rig.lines
    assert rig.jobs() == [
        {"phase": "start", "attempt": 1, "workers": ["exp-worker-0", "exp-worker-1"]},
        {"phase": "exit", "attempt": 1, "workers": [], "exit_code": 1, "seconds": 60.0},
        {"phase": "relaunch", "attempt": 2, "workers": ["exp-worker-0", "exp-worker-1"], "waited_s": 0.0},
        {"phase": "exit", "attempt": 2, "workers": [], "exit_code": 0, "seconds": 30.0},
    ]


def test_keeper_ends_a_job_the_wave_left_without_workers_and_relaunches_when_capacity_is_back(tmp_path):
    rig = JobRig(tmp_path, min_workers=2)
    rig.keeper.reconcile()
    assert len(rig.job.launches) == 1
    rig.fleet.preempt_all()
    rig.fleet.exhausted.add(ZA)
    rig.fleet.exhausted.add(ZB)
    lost = rig.step()  # every VM stopped and no capacity anywhere: the job is ended, nothing relaunched
    assert rig.job.stops == 1 and lost.job.phase == JOB_EXITED and lost.job.exit_code == 143
    assert [o.failure for o in lost.outcomes] == ["stockout"] * 2
    assert rig.step(30).job.phase == JOB_EXITED  # both zones backed off: nothing tried
    rig.fleet.exhausted.clear()  # capacity is back
    back = rig.step(60)
    assert back.job.phase == JOB_RUNNING and back.job.attempts == 2 and len(rig.job.launches) == 2
    assert [e["phase"] for e in rig.jobs()] == ["start", "exit", "relaunch"]
    exit_, relaunch = rig.jobs()[1:]
    assert exit_["reason"] == NO_WORKERS and exit_["exit_code"] == 143
    assert relaunch["waited_s"] == 90.0
    assert any(line.startswith("job: no worker is left; stopping attempt 1") for line in rig.lines)


def test_with_standbys_a_launch_waits_for_their_ready_records_or_the_timeout(tmp_path):
    """A RUNNING VM may still be booting: with standbys, a launch takes the workers whose standby of
    their current boot is ready, or that booted await_ready_s ago."""
    records: list[ReadyRecord] = []
    rig = JobRig(tmp_path, min_workers=2, await_ready_s=120.0)
    rig.keeper.ready = lambda: records

    def boot(t: float) -> None:
        rig.fleet.vms = {n: replace(w, incarnation=Incarnation(f"id-{n}", t)) for n, w in rig.fleet.vms.items()}

    rig.keeper.reconcile()  # creates both workers; not observed running yet
    boot(rig.clock())
    booted = rig.clock()
    rig.step(10)
    assert rig.job.launches == []
    assert "waiting: job launch when 2 worker(s) are RUNNING and ready (0 now)" in rig.lines
    records += [ReadyRecord("exp-worker-0", booted + 15, instance_id="id-exp-worker-0"),
                ReadyRecord("exp-worker-1", booted - 50)]  # a standby of an earlier boot
    rig.step(10)
    assert rig.job.launches == []
    records.append(ReadyRecord("exp-worker-1", booted + 25))
    rig.step(10)
    assert rig.job.launches == [("exp-worker-0", "exp-worker-1")]

    rig.job.exit(1)  # the VMs boot again (a wave and restarts) and no standby says it is ready
    boot(rig.clock())
    rig.step(30)
    assert len(rig.job.launches) == 1
    rig.step(100)  # 130 s after the boot: launched without them
    assert len(rig.job.launches) == 2


def test_a_vm_under_notice_counts_as_going_down_from_its_leave_at() -> None:
    """A RUNNING VM whose current incarnation published itself as leaving (its worker, or its standby that saw
    a notice) is on its way down; before its record's leave_at it still trains, and a record of an earlier
    incarnation, or one past its deadline and grace, is no longer about it."""
    now = 1000.0
    booted = Incarnation("id-a", now - 100)
    workers = (WorkerVM("a", ZA, "RUNNING", True, booted), WorkerVM("b", ZA, "RUNNING", True),
               WorkerVM("c", ZA, "TERMINATED", True), WorkerVM("d", ZA, "RUNNING", True, booted))
    records = [LeavingRecord("a", published_at=now - 5, deadline=now + 25, instance_id="id-a"),
               LeavingRecord("b", published_at=now - 5, deadline=now + 25, leave_at=now + 10),
               LeavingRecord("c", published_at=now - 5, deadline=now + 25),
               LeavingRecord("d", published_at=now - 200, deadline=now - 170)]  # before its boot
    seen = under_notice_as_stopping(workers, records, now)
    assert [w.status for w in seen] == ["STOPPING", "RUNNING", "TERMINATED", "RUNNING"]
    assert [w.status for w in under_notice_as_stopping(workers, records, now + 10)][1] == "STOPPING"
    assert under_notice_as_stopping(workers, records, now + 25 + 61) == workers


def test_a_relaunch_does_not_take_a_vm_under_notice(tmp_path):
    """A VM whose worker (or standby) published itself as leaving counts as going down: the job is not
    launched on it, and it keeps no job alive."""
    records: list[LeavingRecord] = []
    rig = JobRig(tmp_path, min_workers=2)
    rig.keeper.leaving = lambda: records
    rig.keeper.reconcile()  # creates both workers and launches the job on them
    assert rig.job.launches == [("exp-worker-0", "exp-worker-1")]
    rig.job.exit(1)
    records.append(LeavingRecord("exp-worker-1", published_at=rig.clock(), deadline=rig.clock() + 30))
    rig.step(10)
    assert len(rig.job.launches) == 1  # one worker is not enough
    rig.step(100)  # its record is over: the VM it named is gone (and here runs again)
    assert rig.job.launches[1:] == [("exp-worker-0", "exp-worker-1")]


def test_keeper_gives_up_after_the_maximum_relaunches_and_its_loop_ends(tmp_path):
    rig = JobRig(tmp_path, max_relaunches=1)
    rig.keeper.reconcile()
    rig.job.exit(2)
    rig.step()
    rig.job.exit(2)
    rig.keeper.run()  # one pass: the job fails for good, and the loop ends without sleeping
    assert rig.keeper.job_state.phase == JOB_FAILED and rig.keeper.finished and len(rig.job.launches) == 2
    assert [e["phase"] for e in rig.jobs()] == ["start", "exit", "relaunch", "exit", "give_up"]
    assert any(line.startswith("job: giving up") for line in rig.lines)


def test_keep_fleet_goes_on_after_the_job_and_close_stops_a_running_job(tmp_path):
    rig = JobRig(tmp_path, keep_fleet=True)
    rig.keeper.reconcile()
    rig.job.exit(0)
    rig.keeper.run(passes=3)
    assert rig.keeper.job_state.phase == JOB_DONE and not rig.keeper.finished and rig.clock.slept[-2:] == [30, 30]

    other = JobRig(tmp_path / "other")
    other.keeper.reconcile()
    other.keeper.close()  # the keeper stops: its job goes with it
    assert other.job.stops == 1 and other.keeper.job_state.exit_code == 143
    assert other.jobs()[-1]["reason"] == KEEPER_STOPPED


def test_the_pause_between_passes_ends_when_the_job_exits_or_on_wake(tmp_path):
    import time

    job = FakeJob()
    keeper = Keeper(FakeFleet(), policy(workers=0), job=job, out=lambda _line: None)
    keeper.job_state = job_started(JobState(), LaunchJob(1, ()), T0)
    job.exit(1)
    began = time.monotonic()
    keeper._pause(60)  # the job has ended: the next pass looks at once
    keeper.job_state = JobState()
    keeper.wake()
    keeper._pause(60)
    keeper.stop()
    keeper._pause(60)
    assert time.monotonic() - began < 10


def test_command_job_runs_a_shell_line_and_stops_its_whole_session():
    job = CommandJob("exit 3")
    assert job.poll() is None and job.wait(0.1) is None  # not started
    job.start(["w0"])
    assert job.wait(30) == 3 and job.poll() == 3
    stubborn = CommandJob("trap '' TERM; sleep 60 & wait")  # ignores SIGTERM, with a child
    stubborn.start([])
    assert stubborn.wait(0.2) is None
    assert stubborn.stop(0.5) == 137  # SIGKILL to the session after the timeout
    polite = CommandJob(["sleep", "60"])
    polite.start([])
    assert polite.stop(10) == 143
    assert exit_status(-9) == 137 and exit_status(4) == 4
    with pytest.raises(ValueError):
        CommandJob("")


def test_command_job_that_gates_joins_tells_discovery_when_each_launch_began_and_how_long_to_wait(tmp_path):
    """Workers that publish themselves ready (their boot, or their standby): VMs that boot after a launch are
    listed once ready, or after the join timeout."""
    out = tmp_path / "gate"
    env = {k: v for k, v in os.environ.items() if k not in ("HVDT_STANDBY_SINCE", "HVDT_JOIN_TIMEOUT_S")}
    line = f'printf "%s %s" "${{HVDT_STANDBY_SINCE-unset}}" "${{HVDT_JOIN_TIMEOUT_S-unset}}" > {out}'
    job = CommandJob(line, env=env, join_timeout_s=1200.0)
    before = time.time()
    job.start(["w0"])
    assert job.wait(30) == 0
    since, timeout = out.read_text().split()
    assert before <= float(since) <= time.time() and float(timeout) == 1200.0
    plain = CommandJob(line, env=env)
    plain.start(["w0"])
    assert plain.wait(30) == 0 and out.read_text() == "unset unset"


def test_a_job_a_dead_keeper_left_running_is_ended_before_the_next_launch(tmp_path):
    """A keeper killed outright (SIGKILL, OOM) cannot stop its job; the keeper started after it ends that job
    before launching its own, so that two jobs never train on the same workers and store."""
    pidfile = tmp_path / "keeper" / "p.exp.job"
    first = CommandJob("sleep 600 & wait", pidfile=pidfile, stop_timeout_s=10)
    first.start(["w0"])
    left = first.process  # its keeper dies here, without stopping it
    assert left is not None and json.loads(pidfile.read_text())["pid"] == left.pid
    out = tmp_path / "second"
    second = CommandJob(f"echo launched > {out}", pidfile=pidfile)
    second.start(["w0"])
    assert left.poll() is not None and exit_status(left.returncode) == 128 + signal.SIGTERM  # ended first
    assert second.wait(30) == 0 and out.read_text() == "launched\n"


def test_a_noted_pid_that_is_no_longer_the_job_is_left_alone(tmp_path):
    pidfile = tmp_path / "p.exp.job"
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:  # the job ended and its pid went to another process: a different start time
        pidfile.write_text(json.dumps({"pid": bystander.pid, "started": (start_ticks(bystander.pid) or 0) + 1}))
        job = CommandJob("true", pidfile=pidfile)
        job.start(["w0"])
        assert job.wait(30) == 0 and bystander.poll() is None
        pidfile.write_text("not json")  # unreadable: nothing proves a job is running
        job.start(["w0"])
        assert job.wait(30) == 0 and bystander.poll() is None
        unwritable = CommandJob("true", pidfile=pidfile / "below-a-file.job")  # the job runs all the same
        unwritable.start(["w0"])
        assert unwritable.wait(30) == 0
        shared = tmp_path / "shared"  # a note others could have written proves nothing
        note_process(shared / "p.exp.job", bystander.pid)
        shared.chmod(0o777)
        job = CommandJob("true", pidfile=shared / "p.exp.job")
        job.start(["w0"])
        assert job.wait(30) == 0 and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# ---- the CLI with --job ---------------------------------------------------------------------------------


def test_keep_with_job_launches_it_and_ends_when_training_completes(compute, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "ran"
    assert cli.main([*KEEP, "--store", str(run), "--interval", "0.1", "--min-workers", "2", "--join-timeout", "0",
                     "--job", f"touch {marker}; exit 0"]) == 0
    out = capsys.readouterr().out
    assert marker.exists()
    assert "job: launched on 2 worker(s): exp-worker-0, exp-worker-1" in out and "job: training is complete" in out
    phases = [(e["phase"], e.get("exit_code")) for e in read_events(LocalStore(str(run))) if e["event"] == "keeper_job"]
    assert phases == [("start", None), ("exit", 0)]


def test_keep_with_job_and_a_store_launches_it_once_the_booted_workers_said_they_are_ready(compute, capsys, tmp_path):
    """A worker's startup script publishes it ready (`hvd-transient ready`) at the end of its boot: the job is
    launched on the workers only then, not as soon as they are RUNNING (a worker started on a VM still
    installing fails, and Horovod blacklists its host)."""
    from hvd_transient.cli import main as hvdt_main

    run, launched = tmp_path / "run", tmp_path / "launched"
    run.mkdir()
    published: list[float] = []

    def boot() -> None:  # the VMs' startup scripts, done a few keeper passes after the VMs came up
        deadline, seen_at = time.time() + 60, None
        while time.time() < deadline and not published:
            running = [i for i in compute.instances(PROJECT) if i["status"] == "RUNNING"]
            passes = len([r for r in compute.requests if r.method == "GET" and r.path.endswith("/instances")])
            if len(running) == 2 and seen_at is None:
                seen_at = passes
            if seen_at is not None and passes >= seen_at + 6:  # the keeper looked again and again: not ready yet
                published.append(time.time())
                for vm in running:
                    assert hvdt_main(["ready", "--store", str(run), "--host", vm["name"],
                                      "--instance-id", str(vm["id"])]) == 0
            time.sleep(0.02)

    booting = threading.Thread(target=boot, daemon=True)
    booting.start()
    assert cli.main([*KEEP, "--store", str(run), "--interval", "0.1", "--min-workers", "2", "--join-timeout", "60",
                     "--job", f"date +%s.%N > {launched}"]) == 0
    booting.join(timeout=30)
    assert published and float(launched.read_text()) >= published[0]
    assert "launched once 2 worker(s) are RUNNING and ready" in capsys.readouterr().out


def test_a_second_keeper_of_the_cluster_with_a_job_is_refused_on_the_same_machine(compute, capsys, tmp_path):
    (tmp_path / "keeper").mkdir()
    held = try_lock(tmp_path / "keeper" / f"{PROJECT}.exp.lock")  # a first keeper of exp runs here
    try:
        assert held is not None
        assert cli.main([*KEEP, "--interval", "0.1", "--job", "true"]) == 2
        assert "another 'cluster keep --job' of exp runs on this machine" in capsys.readouterr().err
    finally:
        os.close(held)
    assert cli.main([*KEEP, "--interval", "0.1", "--join-timeout", "0", "--job", "true"]) == 0  # once it is gone


def test_keep_with_a_failing_job_relaunches_then_exits_1(compute, capsys):
    assert cli.main([*KEEP, "--interval", "0.1", "--max-relaunches", "1", "--job", "exit 3"]) == 1
    out = capsys.readouterr().out
    assert "job: relaunched (attempt 2) on 2 worker(s)" in out and "job: giving up" in out


@pytest.mark.parametrize("bad, message", [
    (["--job", "true", "--once"], "--job needs the keeper to run on"),
    (["--job", "true", "--min-workers", "3"], "--min-workers (3) cannot exceed --workers (2)"),
    (["--job", "  "], "--job: the command is empty"),
])
def test_keep_job_settings_it_cannot_keep_exit_2(bad, message, capsys):
    assert cli.main([*KEEP, *bad]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad, option", [(["--max-relaunches", "-1"], "--max-relaunches"),
                                         (["--min-workers", "0"], "--min-workers")])
def test_keep_job_bad_numbers_exit_2(bad, option, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*KEEP, "--job", "true", *bad])
    assert exited.value.code == 2 and option in capsys.readouterr().err


def test_keep_dry_run_says_what_the_job_would_do(compute, capsys):
    assert cli.main([*KEEP, "--dry-run", "--job", "horovodrun -np 2 python train.py", "--min-workers", "2"]) == 0
    assert "launch  job on exp-worker-0, exp-worker-1: horovodrun -np 2 python train.py" in capsys.readouterr().out
    compute.exhaust(ZA)  # a dry run does not know; it plans as if every operation succeeded
    assert cli.main([*KEEP, "--dry-run", "--format", "json", "--job", "true", "--min-workers", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["job"] == {
        "command": "true", "launch": True, "workers": ["exp-worker-0", "exp-worker-1"], "min_workers": 2}


# ---- the local simulator's zones ------------------------------------------------------------------------


@pytest.fixture
def two_zone_fleet(tmp_path):
    """A LocalFleet over two running VMs in zone local-a (of local-a and local-b), and a keeper of two on a fake
    clock."""
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec
    from hvd_transient.testing.local_fleet import LocalFleet

    work = tmp_path / "work"
    work.mkdir()
    cluster = LocalCluster(LocalClusterSpec(store=str(tmp_path / "store"), hosts=("localhost", "127.0.0.1"),
                                            command=("true",), workdir=work))
    for host in cluster.spec.hosts:
        cluster.add_host(host)
    fleet = LocalFleet(cluster, zones=("local-a", "local-b"))
    clock = Clock()
    keeper = Keeper(fleet, fleet.policy(2), clock=clock, sleep=clock.advance, out=lambda _line: None)
    yield cluster, fleet, keeper, clock
    cluster.close()


def test_local_fleet_fails_over_to_another_zone_when_one_is_exhausted(two_zone_fleet):
    cluster, fleet, keeper, clock = two_zone_fleet
    assert keeper.reconcile().actions == ()
    fleet.exhaust("local-a")
    for host in cluster.spec.hosts:
        cluster._vm_stopped(host)  # a wave: both VMs stopped
    failed = keeper.reconcile()
    assert [(o.action.name, o.failure) for o in failed.outcomes] == [("127.0.0.1", "stockout"),
                                                                     ("localhost", "stockout")]
    clock.advance(1)
    moved = keeper.reconcile()
    assert moved.actions == (Create("127.0.1", "local-b", True, RECREATE, ("local-a",)),
                             Create("127.1", "local-b", True, RECREATE, ("local-a",)))
    assert fleet.listed() == ["127.0.1", "127.1"] and fleet.zone_of("127.1") == "local-b"
    fleet.restore("local-a")
    clock.advance(1)
    assert keeper.reconcile().actions == ()  # whole again: the stopped VMs in local-a stay stopped


def test_local_fleet_zone_with_room_for_one_vm_restarts_one_and_fails_the_other_over(two_zone_fleet):
    cluster, fleet, keeper, clock = two_zone_fleet
    with pytest.raises(ValueError, match="after must be >= 0"):
        fleet.exhaust("local-a", after=-1)
    fleet.exhaust("local-a", after=1)
    for host in cluster.spec.hosts:
        cluster._vm_stopped(host)  # a wave: both VMs stopped
    first = keeper.reconcile()
    assert [(o.action.name, o.failure) for o in first.outcomes] == [("127.0.0.1", None), ("localhost", "stockout")]
    clock.advance(1)
    moved = keeper.reconcile()
    assert moved.actions == (Create("127.0.1", "local-b", True, RECREATE, ("local-a",)),)
    assert sorted(fleet.listed()) == ["127.0.0.1", "127.0.1"] and fleet.zone_of("127.0.1") == "local-b"
    clock.advance(1)
    assert keeper.reconcile().actions == ()
