"""End to end with PyTorch: real `horovodrun` over local host aliases running examples/torch_elastic.py.

The master's notice, then a worker's on the smaller ring (each VM trains through its window, then leaves
with nothing rolled back), two new VMs that join together through their standbys (torch imported and the
script run up to its elastic function before each VM is offered; one ring change for both), and the whole
cluster killed (kill -9) then relaunched at another size. Every worker logs the index of each sample it trains
on: across all of it, each pass over the data is used exactly once.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_elastic_e2e import (
    assert_all_committed_steps_verify,
    cluster,
    current_master,
    expected_samples,
    steps_by_host,
)

from ckpt_service.manager import CheckpointManager
from hvd_transient.core.checksums import state_crc
from hvd_transient.core.config import DEFAULT_LEAVE_LEAD_S
from hvd_transient.discovery.ready import read_ready
from hvd_transient.testing.local_cluster import of

pytest.importorskip("horovod.torch")
pytestmark = pytest.mark.horovod

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "torch_elastic.py")
BASE_LR = 0.01
BATCH = 8
SAMPLES = 200  # a pass every few dozen steps: each test crosses passes at several ring sizes


def torch_cmd(store: str, samples_log: Path, *, epochs: int, steps: int = 20, save_every: int = 100000,
              step_seconds: float = 0.05, notice_window: float = 30.0, leave: str | None = None,
              batches_per_commit: int = 5) -> tuple[str, ...]:
    return (sys.executable, EXAMPLE, "--store", store, "--model", "small_cnn", "--epochs", str(epochs),
            "--steps-per-epoch", str(steps), "--batch-size", str(BATCH), "--samples", str(SAMPLES),
            "--save-every", str(save_every), "--base-lr", str(BASE_LR), "--batches-per-commit", str(batches_per_commit),
            "--step-seconds", str(step_seconds), "--notice-window", str(notice_window),
            "--log-samples", str(samples_log)) + (("--leave", leave) if leave else ())


def trained_batches(samples_log: Path) -> dict[int, list[int]]:
    """Step -> the global batch of sample indices that step trained, in the model's final history: of a
    step trained more than once (before a relaunch, say), the ring that trained it last."""
    records = [json.loads(line) for f in samples_log.glob("*.jsonl") for line in f.read_text().splitlines()]
    latest: dict[int, dict] = {}
    for r in records:
        if r["step"] not in latest or r["t"] > latest[r["step"]]["t"]:
            latest[r["step"]] = r
    out = {}
    for step, last in latest.items():
        ring = sorted((r for r in records if r["step"] == step and r["ring"] == last["ring"]),
                      key=lambda r: r["rank"])
        assert [r["rank"] for r in ring] == list(range(last["size"])), (step, ring)
        out[step] = [i for r in ring for i in r["ids"]]
    return out


def assert_each_sample_once_per_pass(samples_log: Path, last_step: int) -> int:
    """Steps 1..last_step took consecutive stream positions: every full pass is a permutation of the data
    set, and the last, partial one repeats no sample. Returns the number of samples trained."""
    batches = trained_batches(samples_log)
    assert sorted(batches) == list(range(1, last_step + 1)), "a step is missing from the history"
    stream = [i for step in range(1, last_step + 1) for i in batches[step]]
    for start in range(0, len(stream), SAMPLES):
        chunk = stream[start:start + SAMPLES]
        assert len(set(chunk)) == len(chunk), f"a sample repeated within the pass at {start}"
        if len(chunk) == SAMPLES:
            assert sorted(chunk) == list(range(SAMPLES)), f"the pass at {start} skipped samples"
    return len(stream)


def assert_left_through_window(events: list[dict], leaver: str, survivor: str, noticed_at: float,
                               window_s: float, *, nth: int, size: int, lead_s: float) -> None:
    """The ``nth`` notice (0-based) of the run, on a ring of ``size``: its emergency checkpoint committed at
    once, by a host not under notice; the leaver trained on until about its leave_at (at least ``lead_s``
    before its deadline), then left with nothing rolled back."""
    agreed = of(events, "notice_agreed", host=survivor)[nth]
    emergency = of(events, "commit", kind="emergency")[nth]
    assert emergency["step"] == agreed["step"] and emergency["size"] == size and emergency["t"] < noticed_at + 5
    assert emergency["host"] != leaver, "the VM under notice must not be the one committing"
    published = of(events, "leave_published")[nth]
    assert published["host"] == leaver and published["t"] < noticed_at + 5
    # dated from the watcher's last read that said no: never after the VM's deadline (the notice was given before
    # noticed_at), at most a few seconds before it (a loaded machine spaces the watcher's reads)
    assert noticed_at + window_s - 4.0 <= published["deadline"] <= noticed_at + window_s
    assert published["deadline"] - published["leave_at"] >= lead_s
    leaver_steps = [e for e in events if e["host"] == leaver and e["event"] in ("progress", "first_step")]
    assert max(e["t"] for e in leaver_steps) > published["leave_at"] - 3, "the leaver stopped training early"
    rings = of(events, "ring", host=survivor)
    assert rings[nth + 1]["size"] == size - 1
    assert published["leave_at"] <= rings[nth + 1]["t"] < published["deadline"]
    assert rings[nth + 1]["step"] > agreed["step"] + 10  # the window's steps are in the model


def test_the_master_then_a_worker_under_notice_train_through_their_windows_and_leave_with_nothing_rolled_back(
        tmp_path: Path) -> None:
    """Three VMs: the checkpoint master gets a notice (a new master is elected, fenced), then, on the ring
    of two, the worker that is not the new master. Each trains through its window and leaves gracefully."""
    store, samples_log = str(tmp_path / "store"), tmp_path / "samples"
    # at most 10 steps/s (the sleep): both windows end before the last step (the first notice at step 10, the
    # second once the first VM has left, 8 s into its window: both windows end by about 28 s, the 340th step
    # no sooner than 34 s). The second lead is measured from the first departure, which a loaded machine can
    # make slow (5 s gives a lead of about 12 s): the window leaves room for that.
    window, epochs, per_epoch = 18.0, 17, 20
    hosts = ("localhost", "127.0.0.1", "127.0.1")
    c = cluster(tmp_path, "run", store, hosts, torch_cmd(store, samples_log, epochs=epochs, steps=per_epoch,
                                                         step_seconds=0.1, notice_window=window))
    with c:
        c.wait_for_step(10, 120, size=3)
        master = current_master(c.events())
        first_noticed = c.preempt(master, window_s=window)  # its worker is killed at the deadline
        c.wait_for_step(1, 120, size=2)
        new_master = current_master(c.events())
        worker = next(h for h in hosts if h not in (master, new_master))
        second_noticed = c.preempt(worker, window_s=window)
        assert c.wait(180) == 0, c.log_tail()
        events = c.events()
    survivor = new_master
    assert_left_through_window(events, master, survivor, first_noticed, window, nth=0, size=3,
                               lead_s=DEFAULT_LEAVE_LEAD_S)
    # the second lead is the measured one: a wait for a step boundary, the departure timed, a margin
    assert_left_through_window(events, worker, survivor, second_noticed, window, nth=1, size=2, lead_s=1.0)
    (election,) = of(events, "election", host=survivor)
    assert election["old_master_host"] == master and election["new_master_host"] == survivor
    rings = of(events, "ring", host=survivor)
    assert [r["size"] for r in rings] == [3, 2, 1]
    assert all(e["rolled_back"] == 0 for e in of(events, "reset")), of(events, "reset")
    for host, steps in steps_by_host(events).items():
        assert steps == sorted(steps), f"{host}: step counter went back: {steps}"
    for e in of(events, "lr"):
        assert e["lr"] == pytest.approx(BASE_LR * e["size"])
    (weights,) = of(events, "weights")
    assert weights["host"] == survivor and weights["step"] == epochs * per_epoch
    for e in of(events, "progress", host=survivor):
        assert e["samples"] == expected_samples(rings, e["step"], BATCH), e
    trained = assert_each_sample_once_per_pass(samples_log, epochs * per_epoch)
    assert trained == expected_samples(rings, epochs * per_epoch, BATCH)
    assert f"done at step {epochs * per_epoch} on 1 workers, {trained} samples" in c.log_tail(80)


def test_new_vms_join_through_their_standbys_together_and_the_ring_trains_on_at_the_exact_sample(
        tmp_path: Path) -> None:
    """Two VMs start together, the second booting 10 s longer: each warms a standby, and discovery lists them
    together once both are ready (one ring change, not one per VM; with --join-gather 0 the ring would change
    twice). The script never commits Horovod's state (whose commit runs Horovod's host check): the driver's
    message of the join is taken at a notice round."""
    store, samples_log = str(tmp_path / "store"), tmp_path / "samples"
    epochs, per_epoch = 1000, 20  # stopped through the store once the grown ring has trained a while
    hosts, newcomers = ("localhost", "127.0.0.1"), ("127.0.1", "127.1")  # local host aliases
    cmd = torch_cmd(store, samples_log, epochs=epochs, steps=per_epoch, batches_per_commit=10**9)
    # a gather long enough that the second standby, warming up beside the first on a loaded machine, is not late
    c = cluster(tmp_path, "run", store, hosts, cmd, instances=hosts + newcomers, standby=True, join_timeout_s=120,
                extra_env=(("HVDT_JOIN_GATHER_S", "60"),))
    with c:
        c.wait_for_step(10, 180, size=2)
        for newcomer, boot_s in zip(newcomers, (0.0, 10.0)):  # their standbys run the script up to hvd.elastic.run
            c.add_host(newcomer, boot_s=boot_s)
        joined = c.wait_for(lambda ev: of(ev, "ring", size=4, host=newcomers[0]), 240, f"{newcomers} to join")
        c.wait_for_step(joined[0]["step"] + 10, 120, size=4)
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()
    for newcomer in newcomers:
        standby_log = c.standby_log_path(newcomer).read_text(errors="replace")
        assert "ready for a job" in standby_log, standby_log[-2000:]  # offered only once its standby was ready
    rings = of(events, "ring", host="localhost")
    assert [r["size"] for r in rings] == [2, 4]  # both in one ring change
    assert all(e["rolled_back"] == 0 for e in of(events, "reset")), of(events, "reset")
    for e in of(events, "lr"):
        assert e["lr"] == pytest.approx(BASE_LR * e["size"])
    final = of(events, "weights")
    last_step = max(e["step"] for e in final)
    assert {e["step"] for e in final} == {last_step} and len(final) == 4 and len({e["crc"] for e in final}) == 1, final
    trained = assert_each_sample_once_per_pass(samples_log, last_step)
    assert trained == expected_samples(rings, last_step, BATCH)


def test_a_standby_takes_the_slot_of_a_vm_that_leaves_in_the_same_reset(tmp_path: Path) -> None:
    """A ring at --max-np with a standby ready: the VM under notice leaves at its leave_at and the standby
    takes its slot in the same reset. Horovod's survivors saw a removal only and would skip the state's sync
    that the newcomer waits in (the ring hung); every reset syncs (frontend/host_updates.py)."""
    store, samples_log = str(tmp_path / "store"), tmp_path / "samples"
    hosts, newcomer = ("localhost", "127.0.0.1"), "127.0.1"
    window = 20.0
    c = cluster(tmp_path, "run", store, hosts,
                torch_cmd(store, samples_log, epochs=1000, steps=20, notice_window=window),
                instances=hosts + (newcomer,), standby=True, join_timeout_s=120, max_np=2)
    with c:
        c.wait_for_step(10, 180, size=2)
        c.add_host(newcomer)  # listed once its standby is ready, but the ring is full: it waits for a slot
        c.wait_for(lambda ev: [r for r in read_ready(c.store) if r.host == newcomer], 120, "the standby to be ready")
        c.preempt("127.0.0.1", window_s=window)
        (joined,) = c.wait_for(lambda ev: of(ev, "ring", size=2, host=newcomer), 120, f"{newcomer} in the ring")
        c.wait_for_step(joined["step"] + 10, 120, size=2)
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()
    rings = of(events, "ring", host="localhost")
    assert [r["size"] for r in rings] == [2, 2] and rings[1]["hosts"] == ["localhost", newcomer], rings
    (published,) = of(events, "leave_published")
    assert published["host"] == "127.0.0.1" and published["leave_at"] <= rings[1]["t"] < published["deadline"]
    assert all(e["rolled_back"] == 0 for e in of(events, "reset")), of(events, "reset")
    final = of(events, "weights")
    last_step = max(e["step"] for e in final)
    assert {e["step"] for e in final} == {last_step} and len({e["crc"] for e in final}) == 1, final
    trained = assert_each_sample_once_per_pass(samples_log, last_step)
    assert trained == expected_samples(rings, last_step, BATCH)


def test_kill_9_of_the_whole_cluster_then_a_relaunch_at_another_size_resumes_at_the_exact_sample(
        tmp_path: Path) -> None:
    store, samples_log = str(tmp_path / "store"), tmp_path / "samples"
    epochs, per_epoch = 4, 20
    first = cluster(tmp_path, "first", store, ("localhost", "127.0.0.1"),
                    torch_cmd(store, samples_log, epochs=epochs, steps=per_epoch, save_every=10))
    with first:
        first.wait_for(lambda ev: [e for e in of(ev, "commit", kind="periodic") if e["step"] >= 20], 120,
                       "a periodic checkpoint at step 20 or later")
        killed_at = first.wait_for_step(0, 5)
        first.stop()  # kill -9 of horovodrun and every worker
        events = first.events()
    committed = assert_all_committed_steps_verify(store)
    cut = committed[-1]
    assert cut >= 20 and killed_at >= cut
    with CheckpointManager(store) as mgr:
        saved = mgr.restore(step=cut)
    assert saved.manifest.world_size == 2
    first_rings = of(events, "ring", host="localhost")
    assert saved.metadata["samples"] == expected_samples(first_rings, cut, BATCH)

    hosts = ("localhost", "127.0.0.1", "127.0.1")
    relaunch = cluster(tmp_path, "second", store, hosts,
                       torch_cmd(store, samples_log, epochs=epochs, steps=per_epoch, step_seconds=0.0))
    with relaunch:
        assert relaunch.wait(120) == 0, relaunch.log_tail()
        later = [e for e in relaunch.events() if e["t"] >= relaunch.started_at]
    starts = of(later, "start")
    assert {e["host"] for e in starts} == set(hosts)
    assert [e["restored_step"] for e in starts if e.get("restored_step") is not None] == [cut]
    assert {e["step"] for e in starts} == {cut}
    # every rank starts from the checkpoint, bit-exact: parameters and optimizer state alike
    assert {e["full_crc"] for e in starts} == {state_crc(saved.tensors)}
    (resumed,) = [e for e in of(later, "resume_at") if e["host"] == "localhost"]
    assert (resumed["step"], resumed["samples"]) == (cut, saved.metadata["samples"])
    rings = [r for r in first_rings if r["step"] < cut] + of(later, "ring", host="localhost")
    assert [r["size"] for r in rings] == [2, 3]
    final = of(later, "weights")
    assert {e["step"] for e in final} == {epochs * per_epoch} and len({e["crc"] for e in final}) == 1
    trained = assert_each_sample_once_per_pass(samples_log, epochs * per_epoch)
    assert trained == expected_samples(rings, epochs * per_epoch, BATCH)
