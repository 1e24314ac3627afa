"""End to end: a wave of preemptions takes the whole cluster at once, and the keeper brings the run back.

Real ``horovodrun`` over local host aliases (LocalCluster), with ``hvd-transient cluster keep``'s
loop (Keeper) driving the simulator's VMs (LocalFleet, two zones) and supervising the training
job (LocalClusterJob), on the real clock; the keeper's pause between passes ends when the job
exits. Every worker gets a notice at once: one emergency checkpoint at the agreed step, then
the VMs stop. The keeper ends the job that has no worker left and refills the VMs. Their zone
has Spot capacity for one VM only: the keeper starts one stopped VM again under its name, and,
for the other, whose start is refused with a stock-out, creates a new VM in the other zone. It
relaunches the job on those two, and the job restores the emergency checkpoint and completes at
exactly epochs x steps_per_epoch.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from test_elastic_e2e import elastic_cmd, expected_samples

from ckpt_service.stores import open_store
from hvd_transient.cluster.job_plan import JOB_DONE, NO_WORKERS, JobPolicy
from hvd_transient.cluster.keeper import Keeper
from hvd_transient.report.analysis import analyze
from hvd_transient.report.render import render_text, to_json
from hvd_transient.telemetry.events import EventLog, read_records
from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec, of
from hvd_transient.testing.local_fleet import LocalClusterJob, LocalFleet

pytestmark = pytest.mark.horovod

ZONE_A, ZONE_B = "local-a", "local-b"
HOSTS = ("localhost", "127.0.0.1")
NEW = "127.0.1"  # the first free name of the fleet's pool: the VM created in the other zone


def test_wave_takes_every_worker_and_the_keeper_relaunches_the_run_at_the_exact_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    epochs, per_epoch, batch, window = 4, 30, 32, 10.0
    nominal = epochs * per_epoch
    cluster = LocalCluster(LocalClusterSpec(
        store=store, hosts=HOSTS, workdir=tmp_path / "run",
        command=elastic_cmd(store, epochs=epochs, steps=per_epoch, notice_window=window),
        extra_env=(("HVDT_LEAVING_GRACE_S", "1"),)))
    fleet = LocalFleet(cluster, zones=(ZONE_A, ZONE_B))
    cluster.spec.workdir.mkdir()
    for host in HOSTS:  # the Spot VMs are up, in the first zone
        cluster.add_host(host)
    job = LocalClusterJob(cluster)
    lines: list[str] = []
    keeper = Keeper(fleet, fleet.policy(len(HOSTS), spot_per_hour=0.35, on_demand_per_hour=1.20),
                    cluster="local", instance_type="n1-standard-8+nvidia-tesla-t4",
                    events=EventLog(open_store(store), "driver", min_flush_interval_s=0.0),
                    interval_s=1.0, out=lines.append, job=job,
                    job_policy=JobPolicy(min_workers=len(HOSTS), max_relaunches=1), job_stop_timeout_s=10.0)
    runner = threading.Thread(target=keeper.run, name="keeper", daemon=True)
    try:
        runner.start()  # its first pass launches the job: both workers run
        cluster.wait_for_step(12, 240, size=2)
        fleet.exhaust(ZONE_A, after=1)  # the wave's zone has Spot capacity left for one VM
        wave_at = time.time()
        for host in HOSTS:  # a wave: every VM gets its notice at once; each stops when its window ends
            cluster.preempt(host, window_s=window)
        runner.join(timeout=540)  # the keeper ends with the job (exit 0)
        assert not runner.is_alive(), "\n".join(lines) + "\n" + cluster.log_tail()
    finally:
        keeper.stop()
        runner.join(timeout=30)
        keeper.close()
        cluster.close()
    events = [dict(e) for e in cluster.events()]

    # the keeper: launched once, ended the job the wave had left without workers, refilled, relaunched
    assert keeper.job_state.phase == JOB_DONE and keeper.job_state.attempts == 2, lines
    assert len(job.launched_at) == 2 and job.exit_codes[1] == 0, job.exit_codes
    first_run, relaunched_at = job.launched_at
    refills = {e["operation"]: e for e in of(events, "keeper_refill")}
    assert len(of(events, "keeper_refill")) == 2 and set(refills) == {"start", "create"}, lines
    restarted, created = refills["start"], refills["create"]
    # which VM gets the zone's last room depends on which stop a pass saw first
    assert restarted["name"] in HOSTS and restarted["zone"] == ZONE_A and restarted["was"] == "TERMINATED"
    (refused,) = set(HOSTS) - {restarted["name"]}
    assert (created["name"], created["zone"], created["avoided_zones"]) == (NEW, ZONE_B, [ZONE_A]), lines
    new_hosts = sorted([restarted["name"], NEW])
    stockouts = {(e["name"], e["zone"], e["kind"]) for e in of(events, "keeper_stockout")}
    assert stockouts == {(refused, ZONE_A, "stockout")}, stockouts  # the start the zone had no room for
    exit_, = of(events, "keeper_job", phase="exit", attempt=1)
    # the keeper ends the job when the VMs stop (horovodrun itself would wait --elastic-timeout for slots)
    assert exit_["exit_code"] != 0 and exit_.get("reason") in (NO_WORKERS, None), exit_
    relaunch, = of(events, "keeper_job", phase="relaunch")
    assert relaunch["attempt"] == 2 and sorted(relaunch["workers"]) == new_hosts

    # the first run: every VM's notice agreed, in one round or, when the wave's notices reach the watchers
    # a round apart (each is seen within about a second), in two; an emergency checkpoint at each step agreed
    first = [e for e in events if first_run <= e["t"] < relaunched_at and not e["event"].startswith("keeper_")]
    agreed = sorted({e["step"] for e in of(first, "notice_agreed")})
    assert {h for e in of(first, "notice_agreed") for h in e["leaving"]} == set(HOSTS), agreed
    assert sorted({e["step"] for e in of(first, "commit", kind="emergency")}) == agreed
    cut = agreed[-1]
    assert 0 < cut < nominal

    # the relaunch: every worker starts from that checkpoint, on the refilled VMs; nothing is lost
    second = [e for e in events if e["t"] >= relaunched_at and not e["event"].startswith("keeper_")]
    starts = of(second, "start")
    assert sorted(e["host"] for e in starts) == new_hosts
    assert [e["restored_step"] for e in starts if e.get("restored_step") is not None] == [cut]
    assert {e["step"] for e in starts} == {cut}  # 0 steps lost
    final = of(second, "weights")
    assert {e["step"] for e in final} == {nominal} and len(final) == 2 and len({e["crc"] for e in final}) == 1
    # every step took the next size x batch samples, across the wave
    first_rings: dict[str, dict] = {}  # one ring event per ring, whichever member logged it
    for e in of(first, "ring"):
        first_rings.setdefault(e["ring"], e)
    rings = (sorted((e for e in first_rings.values() if e["step"] < cut), key=lambda e: e["t"])
             + of(second, "ring", host=new_hosts[0]))
    for e in of(first, "progress") + of(first, "first_step"):
        if e["step"] <= cut:
            assert e["samples"] == expected_samples(rings, e["step"], batch), e
    for e in of(second, "progress") + of(second, "first_step"):
        assert e["samples"] == expected_samples(rings, e["step"], batch), e
    assert f"done at step {nominal} on 2 workers, {expected_samples(rings, nominal, batch)} samples" \
        in cluster.log_tail(200)
    training_again = min(e["t"] for e in of(second, "first_step"))

    # the report: the keeper's section shows the refills and the relaunch
    analysis = analyze(read_records(open_store(store)))
    k = analysis.keeper
    assert k is not None and analysis.completed and analysis.final_step == nominal
    assert (k.refills, k.creates, k.restarts, k.failovers) == (2, 1, 1, 1)
    assert k.stockouts_by_zone == {ZONE_A: len(of(events, "keeper_stockout"))}
    assert k.relaunches == 1 and not k.gave_up
    one, two = k.jobs
    assert one.exit_code == exit_["exit_code"] and two.exit_code == 0
    assert two.restored_step == cut and two.resumed_step == cut + 1
    assert two.outage_s is not None and 0 < two.outage_s < training_again - wave_at + 1
    assert "driver" not in {w.host for w in analysis.workers}  # the keeper is no worker
    text = render_text(analysis, None)
    assert "== keeper ==" in text and "1 relaunch(es)" in text
    assert to_json(analysis, None)["keeper"]["jobs"][1]["restored_step"] == cut
    assert one.ended_at is not None
    with capsys.disabled():
        print(f"\nrestarted {restarted['name']}, created {NEW}: agreed step {cut}, restored {two.restored_step}, "
              f"final {analysis.final_step}; "
              f"{training_again - wave_at:.1f} s from the notices to the first step of the relaunch (job ended "
              f"{one.ended_at - wave_at:.1f} s after the notices, {'by the keeper' if one.reason else 'by itself'}; "
              f"relaunched {relaunched_at - wave_at:.1f} s after them)")
