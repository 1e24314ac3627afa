"""End to end under real `horovodrun`: with the defaults (``leave="near_deadline"``, the lead measured) a worker
under a 30 s notice checkpoints at the notice, trains on for about 19 s (the job's first departure: nothing timed
yet, so the lead is 10 s plus one wait for a step at which it can leave, the 1 s check interval at these fast
steps), then leaves gracefully through discovery with nothing rolled back, and the run ends at exactly epochs x
steps_per_epoch."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_elastic_e2e import cluster, current_master, elastic_cmd, expected_samples, steps_by_host

from hvd_transient.core.config import DEFAULT_LEAVE_LEAD_S
from hvd_transient.testing.local_cluster import of

pytestmark = pytest.mark.horovod

WINDOW_S, LEAD_S = 30.0, DEFAULT_LEAVE_LEAD_S
#: the lead's wait for a step boundary: the check interval, or the slowest step if longer (a loaded box)
BOUNDARY_WAIT_S = (1.0, 4.0)


def test_a_worker_under_notice_trains_through_its_window_then_leaves_gracefully(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    # at most 10 steps/s (the sleep): ~200 steps in the window on 2 workers, the rest on 1
    epochs, per_epoch, batch = 8, 40, 32
    hosts = ("localhost", "127.0.0.1")
    command = elastic_cmd(store, epochs=epochs, steps=per_epoch, save_every=100000, step_seconds=0.1,
                          notice_window=WINDOW_S, leave=None)  # the defaults
    c = cluster(tmp_path, "run", store, hosts, command)
    with c:
        # after the first epoch's end: until one is timed, a leave_at past the epoch's end leaves at once
        c.wait_for_step(per_epoch + 5, 180, size=2)
        master = current_master(c.events())
        worker = next(h for h in hosts if h != master)
        noticed_at = c.preempt(worker, window_s=WINDOW_S)  # its worker is killed at the deadline
        assert c.wait(240) == 0, c.log_tail()
        events = c.events()

    # the emergency checkpoint committed at the notice, on both workers' shares
    (agreed,) = of(events, "notice_agreed", host=master)
    (emergency,) = of(events, "commit", kind="emergency")
    assert emergency["step"] == agreed["step"] and emergency["size"] == 2
    assert emergency["t"] < noticed_at + 5
    # the record was published at once, to take effect near the deadline
    (published,) = of(events, "leave_published")
    assert published["host"] == worker and published["t"] < noticed_at + 5
    lead = published["deadline"] - published["leave_at"]
    assert LEAD_S + BOUNDARY_WAIT_S[0] - 0.01 <= lead <= LEAD_S + BOUNDARY_WAIT_S[1], lead
    # dated from the watcher's last read that said no: never after the VM's deadline (the notice was given before
    # noticed_at), at most a few seconds before it (a loaded machine spaces the watcher's reads)
    assert noticed_at + WINDOW_S - 4.0 <= published["deadline"] <= noticed_at + WINDOW_S
    # the worker kept stepping in the ring of 2 until about leave_at, and was gone before its deadline
    worker_steps = [e for e in events if e["host"] == worker and e["event"] in ("progress", "first_step")]
    last = max(worker_steps, key=lambda e: e["t"])
    assert last["t"] > published["leave_at"] - 3, f"the worker stopped {published['leave_at'] - last['t']:.1f} s early"
    # (progress is logged every 10 steps, and the deadline is dated from the watcher's last clear read, up to
    # a poll before the notice)
    assert last["t"] - noticed_at > WINDOW_S - lead - 5
    assert all(e["size"] == 2 for e in worker_steps)
    # it left gracefully: the survivor reset after leave_at with nothing rolled back, well before the deadline
    rings = of(events, "ring", host=master)
    assert [r["size"] for r in rings] == [2, 1]
    assert published["leave_at"] <= rings[1]["t"] < published["deadline"]
    resets = of(events, "reset")
    assert resets and all(e["rolled_back"] == 0 for e in resets), resets
    assert rings[1]["step"] > agreed["step"] + 50  # the window's steps are in the model
    for host, steps in steps_by_host(events).items():
        assert steps == sorted(steps), f"{host}: step counter went back: {steps}"
    # the run ended at the exact step, every step having taken the next size x batch samples
    (weights,) = of(events, "weights")
    assert weights["host"] == master and weights["step"] == epochs * per_epoch
    for e in of(events, "progress", host=master):
        assert e["samples"] == expected_samples(rings, e["step"], batch), e
