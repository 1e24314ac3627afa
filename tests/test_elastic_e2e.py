"""End to end: real `horovodrun` over local host aliases, real metadata emulator, real stores.

Each scenario drives a small Keras model through a preemption schedule and then
checks the event log every worker wrote, the store, and the job's exit code.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
from fault_proxy import FaultProxy

from ckpt_service.manager import CheckpointManager
from hvd_transient.core.checksums import state_crc
from hvd_transient.report import main as report_main
from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec, of

pytestmark = pytest.mark.horovod

REPO = Path(__file__).resolve().parent.parent
ELASTIC = str(REPO / "examples" / "keras_elastic.py")
STATIC = str(REPO / "examples" / "keras_static.py")
TORCH_STATIC = str(REPO / "examples" / "torch_static.py")
BASE_LR = 0.01


def elastic_cmd(store: str, *, epochs: int, steps: int = 40, save_every: int = 25,
                step_seconds: float = 0.05, notice_window: float = 30.0,
                leave: str | None = "at_notice") -> tuple[str, ...]:
    """The example's command; ``leave`` None: the product's default (``near_deadline``). These scenarios
    time the departure at the notice, so they ask for ``at_notice``."""
    return (sys.executable, ELASTIC, "--store", store, "--model", "small_cnn", "--epochs", str(epochs),
            "--steps-per-epoch", str(steps), "--save-every", str(save_every), "--base-lr", str(BASE_LR),
            "--batches-per-commit", "5", "--step-seconds", str(step_seconds),
            "--notice-window", str(notice_window)) + (("--leave", leave) if leave else ())


def cluster(tmp_path: Path, name: str, store: str, hosts: tuple[str, ...], command: tuple[str, ...],
            **kw) -> LocalCluster:
    return LocalCluster(LocalClusterSpec(store=store, hosts=hosts, command=command, workdir=tmp_path / name,
                                         **kw))


def steps_by_host(events: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in events:
        if e["event"] in ("progress", "first_step", "reset", "train_end"):
            out.setdefault(e["host"], []).append(e["step"])
    return out


def assert_all_committed_steps_verify(store: str) -> list[int]:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        steps = mgr.all_steps()
        for step in steps:
            assert mgr.verify(step).ok, step
    return steps


def current_master(events: list[dict]) -> str:
    return of(events, "ring")[-1]["master_host"]


def test_whole_cluster_notice_during_async_save_then_cold_restart(tmp_path: Path, gcs_emulator_session) -> None:
    """Every worker gets a notice while a periodic async save is in flight; the cluster is lost;
    a relaunch on fewer workers resumes from exactly that checkpoint."""
    store = f"gs://{gcs_emulator_session.new_bucket('e2e')}/run"
    hosts = ("localhost", "127.0.0.1", "127.0.1")
    # The workers reach the emulator through a slow link, so a periodic save is still being
    # persisted when the notices arrive.
    proxy = FaultProxy(gcs_emulator_session.url)
    proxy.slow_down(1.0)  # each upload takes a second: a periodic save lasts several seconds
    c = cluster(tmp_path, "first", store, hosts, elastic_cmd(store, epochs=1000, save_every=5),
                extra_env=(("STORAGE_EMULATOR_HOST", proxy.url),))
    with c, proxy:
        c.wait_for_step(15, 180, size=3)
        seen = len(of(c.events(), "async_save"))
        # a save that has just started (its start event is written at once) is still in flight
        c.wait_for(lambda ev: len(of(ev, "async_save")) > seen, 120, "a new periodic save to start")
        for host in hosts:
            c.preempt(host, window_s=60, kill_at_deadline=False)
        c.wait_for(lambda ev: len(of(ev, "leave_published")) == 3, 120, "all three to publish leaving")
        events = c.events()
        c.stop()  # the whole cluster is gone
    # the three notices are given one after another: a round can fall between them, and each round that finds
    # new ones commits an emergency checkpoint; the relaunch resumes from the last
    commit = of(events, "commit", kind="emergency")
    assert 1 <= len(commit) <= 3
    emergency_step = max(e["step"] for e in commit)
    assert of(events, "inflight_cancelled", reason="emergency"), "the notice should have met an in-flight periodic save"
    steps = assert_all_committed_steps_verify(store)  # nothing torn
    assert steps[-1] == emergency_step
    with CheckpointManager(store) as mgr:
        saved = mgr.restore(step=emergency_step)
    assert saved.manifest.world_size == 3

    # finish the epoch the checkpoint was taken in (40 steps per epoch), on two workers
    relaunch = cluster(tmp_path, "second", store, ("localhost", "127.0.0.1"),
                       elastic_cmd(store, epochs=emergency_step // 40 + 1, step_seconds=0.0))
    with relaunch:
        def new_starts(ev: list[dict]) -> list[dict]:
            found = [e for e in of(ev, "start") if e["t"] >= relaunch.started_at]
            return found if len(found) == 2 else []

        starts = relaunch.wait_for(new_starts, 180, "both workers to start")
        assert relaunch.wait(300) == 0, relaunch.log_tail()
    restored = [e for e in starts if e.get("restored_step") is not None]
    assert [e["restored_step"] for e in restored] == [emergency_step]  # rank 0 read it
    # every rank starts bit-exact from the checkpoint: weights AND optimizer state
    assert {e["full_crc"] for e in starts} == {state_crc(saved.tensors)}
    assert {e["step"] for e in starts} == {emergency_step}


def test_aws_rebalance_checkpoints_in_place_then_the_interruption_notice_removes_the_host(tmp_path: Path) -> None:
    """AWS IMDSv2 on the emulator: a rebalance recommendation makes every rank checkpoint at once and
    nobody leave; the spot interruption notice that follows removes the host with nothing rolled back."""
    store = str(tmp_path / "store")
    hosts = ("localhost", "127.0.0.1")
    c = cluster(tmp_path, "run", store, hosts, elastic_cmd(store, epochs=1000, save_every=100000), cloud="aws")
    with c:
        c.wait_for_step(10, 180, size=2)
        master = current_master(c.events())
        worker = next(h for h in hosts if h != master)
        c.recommend_rebalance(worker)
        (early,) = c.wait_for(lambda ev: of(ev, "commit", kind="early"), 60, "the early-warning checkpoint")
        c.wait_for_step(early["step"] + 20, 60, size=2)   # and both keep training
        warned = c.events()
        c.preempt(worker, window_s=30)
        ring = c.wait_for(lambda ev: of(ev, "ring", size=1, host=master), 120, "the ring to shrink to 1")
        c.wait_for_step(ring[0]["step"] + 10, 60, size=1)
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()
    assert [e["host"] for e in of(warned, "early_warning")] == [worker]
    assert {e["host"] for e in of(warned, "async_save", kind="early", step=early["step"])} == set(hosts)
    assert not of(warned, "reset") and not of(warned, "leave_published")
    assert [r["size"] for r in of(warned, "ring", host=master)] == [2]
    (notice,) = of(events, "notice", host=worker)
    assert notice["source"] == "aws"
    assert [e["host"] for e in of(events, "leave_published")] == [worker]
    assert all(e["rolled_back"] == 0 for e in of(events, "reset"))
    # the stop request ended the job at one step, after a final checkpoint; every committed step verifies
    (stop_step,) = {e["step"] for e in of(events, "stop_requested")}
    (final,) = of(events, "weights")
    steps = assert_all_committed_steps_verify(store)
    assert early["step"] in steps and steps[-1] == final["step"] >= stop_step
    # what `hvd-transient report` makes of the run's own log
    report = tmp_path / "report.json"
    assert report_main([store, "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    (p,) = doc["preemptions"]
    assert p["host"] == worker and p["notice"] is True and p["was_master"] is False
    assert p["steps_rolled_back"] == 0 and p["checkpoint_committed"] is True
    assert p["resume_ms"] is not None and p["resume_ms"] > 0
    assert doc["completed"] is True and [r["size"] for r in doc["rings"]] == [2, 1]


# Keras over Gloo, PyTorch over MPI: the plugin's static path is the same for both frameworks (the frontends
# differ in what they snapshot, which the elastic runs cover over Gloo), and each controller runs once
@pytest.mark.parametrize("controller, framework", [("gloo", "keras"), ("mpi", "torch")])
def test_static_job_checkpoints_on_notice_and_relaunch_resumes(tmp_path: Path, controller: str,
                                                               framework: str) -> None:
    """``horovodrun -np N`` without discovery: the notice stops the job after a checkpoint; a relaunch resumes.

    Gloo: two host aliases, one notified. MPI: one VM with two slots (mpirun has no host aliases),
    whose notice reaches both ranks, as a preempted multi-GPU VM's would. PyTorch
    (examples/torch_static.py) resumes at the exact sample too.
    """
    store = str(tmp_path / "store")
    # the notice comes at step 10 or so, and is acted on within a second (tens of steps; PyTorch's are slower)
    steps = 120 if framework == "torch" else 200
    script, extra = (TORCH_STATIC, ("--samples", "2048")) if framework == "torch" else (STATIC, ())
    cmd = (sys.executable, script, "--store", store, "--model", "small_cnn", "--steps", str(steps), *extra,
           "--save-every", "1000", "--step-seconds", "0.05")
    if controller == "mpi":
        hosts, slots, target = (socket.gethostname(),), 2, socket.gethostname()
    else:
        hosts, slots, target = ("localhost", "127.0.0.1"), 1, "127.0.0.1"
    kw = dict(elastic=False, controller=controller, slots=slots)
    c = cluster(tmp_path, "first", store, hosts, cmd, **kw)
    with c:
        c.wait_for_step(10, 180)
        c.preempt(target, window_s=60, kill_at_deadline=False)
        assert c.wait(300) == 0, c.log_tail()
        events = c.events()
    assert {e["size"] for e in of(events, "ring")} == {2}
    commit = of(events, "commit", kind="emergency")
    assert len(commit) == 1 and commit[0]["step"] < steps
    step = commit[0]["step"]
    resumed = cluster(tmp_path, "second", store, hosts, cmd[:-2] + ("--step-seconds", "0"), **kw)
    with resumed:
        assert resumed.wait(300) == 0, resumed.log_tail()
        events = resumed.events()
    starts = [e for e in of(events, "start") if e["t"] >= resumed.started_at]
    assert len(starts) == 2 and {e["step"] for e in starts} == {step}, \
        "the relaunch must resume from the emergency checkpoint"
    over = {"gloo": "Gloo", "mpi": "MPI"}[controller]
    exact = f", {steps * 2 * 32} samples" if framework == "torch" else ""  # 2 ranks of 32 per step, throughout
    assert f"stopped at step {steps} (resumed from {step}) on 2 processes over {over}{exact}" in resumed.log_tail(80)


def expected_samples(rings: list[dict], step: int, batch: int) -> int:
    """The global sample offset at ``step`` on a trajectory of rings (step they began at, size)."""
    total = 0
    for ring, following in zip(rings, rings[1:] + [None]):
        end = step if following is None else min(step, following["step"])
        total += max(0, end - ring["step"]) * ring["size"] * batch
    return total


def test_whole_run_through_metadata_faults_leave_join_master_leave_loss_and_relaunch(tmp_path: Path) -> None:
    """A run's life: the metadata server misbehaves (no notice is invented, training goes on), a worker
    leaves, a VM joins, the checkpoint master leaves (a new master is elected, fenced), every VM left is
    preempted at once and the cluster is lost, then horovodrun is relaunched on every host name: every host
    gets a worker once the leaving records expire, training resumes at the emergency checkpoint's exact step
    and sample offset on the new worker count, and the run ends at exactly epochs x steps_per_epoch, every
    step having taken the next size x batch samples."""
    store = str(tmp_path / "store")
    # long enough that the first launch never reaches its end before the wave, however fast its steps
    epochs, per_epoch, batch = 25, 40, 32
    hosts = ("localhost", "127.0.0.1", "127.0.1")
    newcomer = "127.1"
    # leaving records outlive their deadlines a little: a preempted VM is unlisted (stopped) when its window
    # ends, which is at its record's deadline or up to a metadata poll after it; the relaunch waits for them
    grace = (("HVDT_LEAVING_GRACE_S", "5"),)
    # a short notice window, so that the leaving records expire soon after the whole cluster is lost
    window = 10.0  # the emergency commit gets the 5 s before leave_margin_s; leaving takes ~1.5 s
    c = cluster(tmp_path, "first", store, hosts,
                elastic_cmd(store, epochs=epochs, steps=per_epoch, notice_window=window),
                instances=hosts + (newcomer,), extra_env=grace)
    with c:
        c.wait_for_step(10, 180, size=3)
        master = current_master(c.events())
        worker, observer = [h for h in hosts if h != master]  # the observer stays until the wave
        # A misbehaving metadata server must not disturb training, and the watcher must recover.
        for mode in ("500", "garbage", "hang"):
            c.set_metadata_fault(observer, mode)
            reached = c.wait_for_step(0, 5)
            c.wait_for_step(reached + 20, 120, size=3)
        c.set_metadata_fault(observer, "ok")
        c.preempt(worker, window_s=window)  # its VM stops when the window ends: a worker leaves
        c.wait_for(lambda ev: of(ev, "ring", size=2, host=master), 120, "the ring to shrink to 2")
        c.add_host(newcomer)  # a new VM joins
        c.wait_for(lambda ev: of(ev, "ring", size=3, host=newcomer), 180, f"{newcomer} to join")
        c.wait_for_step(max(e["step"] for e in of(c.events(), "ring", host=newcomer)) + 10, 120, size=3)
        assert current_master(c.events()) == master
        c.preempt(master, window_s=window)  # the checkpoint master leaves
        (ring,) = c.wait_for(lambda ev: [e for e in of(ev, "ring", size=2, host=observer)
                                          if e["t"] > of(ev, "election")[0]["t"]] if of(ev, "election") else None,
                             120, "a new master on a ring of 2")
        c.wait_for_step(ring["step"] + 5, 60, size=2)
        live = (observer, newcomer)
        wave_at = time.time()
        for host in live:  # a wave: every VM left is preempted at once
            c.preempt(host, window_s=window, kill_at_deadline=False)
        c.wait_for(lambda ev: {e["host"] for e in of(ev, "leave_published")} == set(hosts + (newcomer,)), 120,
                   "every worker to publish leaving")
        first_events = c.events()
        c.stop()  # the whole cluster is gone

    # no notice was invented while the metadata server misbehaved
    assert {e["host"] for e in of(first_events, "notice") if e["t"] < wave_at} == {worker, master}
    agreed = {e["leaving"][0]: e for e in of(first_events, "notice_agreed", host=observer) if e["t"] < wave_at}
    assert set(agreed) == {worker, master}
    # emergency checkpoints committed before each deadline, by the master of the moment
    commits = sorted(of(first_events, "commit", kind="emergency"), key=lambda e: e["t"])
    assert len(commits) == 3, commits
    first, second, emergency = commits
    assert first["host"] == master and first["t"] < agreed[worker]["deadline"]
    assert second["host"] in live, "the departing master must not be the one committing"
    assert second["t"] < agreed[master]["deadline"]
    (election,) = of(first_events, "election", host=observer)
    assert election["old_master_host"] == master and election["new_master_host"] == second["host"]
    assert second["lease_generation"] > first["lease_generation"]  # the fencing token moved on
    # every host left gracefully: published, removed, no rollback for the survivors
    assert all(e["rolled_back"] == 0 for e in of(first_events, "reset")), of(first_events, "reset")
    for host, steps in steps_by_host(first_events).items():
        assert steps == sorted(steps), f"{host}: step counter went back: {steps}"
    cut = emergency["step"]
    assert emergency["t"] > wave_at and 0 < cut < epochs * per_epoch
    records_end = max(e["deadline"] for e in of(first_events, "leave_published")) + 1
    with CheckpointManager(store) as mgr:  # read now: retention removes it once the relaunch saves
        meta = mgr.restore(step=cut).metadata

    # relaunched on the same names, those that had left earlier included: the same VMs (no new
    # incarnation), so each is admitted when its record's deadline + grace has passed; it trains two to three
    # epochs past the cut (a script may be given fewer epochs than the launch before it had)
    everyone = hosts + (newcomer,)
    epochs = cut // per_epoch + 3
    relaunch = cluster(tmp_path, "second", store, everyone,
                       elastic_cmd(store, epochs=epochs, steps=per_epoch, step_seconds=0.0), extra_env=grace)
    relaunch.start(vm_started=c.vm_started)
    try:
        assert relaunch.wait(420) == 0, relaunch.log_tail()
        events = relaunch.events()
    finally:
        relaunch.close()
    second_events = [e for e in events if e["t"] >= relaunch.started_at]
    starts = of(second_events, "start")
    assert {e["host"] for e in starts} == set(everyone), "every host must get a worker"
    assert min(e["t"] for e in starts) >= records_end - 0.5  # none was admitted while its record held
    assert [e["restored_step"] for e in starts if e.get("restored_step") is not None] == [cut]
    [resumed] = [e for e in of(second_events, "resume_at") if e["step"] == cut][:1]

    # the trajectory: the first launch's rings up to the emergency step, then the relaunch's;
    # the ring followed the schedule (3 -> 2 -> 3 -> 2 workers, then 4) and the LR followed the ring
    first_rings = [e for e in of(first_events, "ring", host=observer) if e["step"] < cut]
    rings = first_rings + of(second_events, "ring", host=observer)
    assert [r["size"] for r in rings] == [3, 2, 3, 2, 4], rings
    for e in of(first_events, "lr") + of(second_events, "lr"):
        assert e["lr"] == pytest.approx(BASE_LR * e["size"])
    assert meta["samples"] == expected_samples(first_rings, cut, batch)
    assert (resumed["epoch"], resumed["batch"]) == divmod(cut, per_epoch)
    assert resumed["samples"] == meta["samples"]
    # every logged offset is where the trajectory says: no sample skipped or taken twice
    for e in of(first_events, "progress") + of(first_events, "first_step"):
        if e["step"] <= cut:
            assert e["samples"] == expected_samples(first_rings, e["step"], batch), e
    for e in of(second_events, "progress") + of(second_events, "first_step"):
        assert e["samples"] == expected_samples(rings, e["step"], batch), e
    # exactly the nominal number of steps, on every worker, with identical weights; every committed step verifies
    final = of(second_events, "weights")
    assert {e["step"] for e in final} == {epochs * per_epoch}
    assert len(final) == 4 and len({e["crc"] for e in final}) == 1
    done = f"done at step {epochs * per_epoch} on 4 workers, {expected_samples(rings, epochs * per_epoch, batch)}"
    assert done in relaunch.log_tail(200)
    assert assert_all_committed_steps_verify(store)[-1] == epochs * per_epoch
