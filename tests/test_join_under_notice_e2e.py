"""End to end under real `horovodrun` with standbys: a VM that gets its preemption notice while its standby warms
up is never admitted. The standby publishes no ready record but the host as leaving, discovery keeps it out of
the ring past the join gate's timeout (after which a VM without a ready record is listed anyway), and the ring
of two trains on undisturbed, with nothing rolled back."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_elastic_e2e import cluster, elastic_cmd

from hvd_transient.core.membership import read_leaving
from hvd_transient.discovery.ready import read_ready
from hvd_transient.testing.local_cluster import of

pytestmark = pytest.mark.horovod

JOIN_TIMEOUT_S = 15.0


def _log_says(path: Path, text: str, timeout: float, what: str) -> None:
    """Wait until the standby's log holds ``text`` (it writes there as it goes)."""
    end = time.time() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        if time.time() > end:
            tail = path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; standby log:\n{tail}")
        time.sleep(0.2)


def test_a_vm_under_notice_during_its_standbys_warm_up_is_not_admitted(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    hosts, newcomer = ("localhost", "127.0.0.1"), "127.0.1"
    c = cluster(tmp_path, "run", store, hosts, elastic_cmd(store, epochs=1000, save_every=100000, leave=None),
                instances=hosts + (newcomer,), standby=True, join_timeout_s=JOIN_TIMEOUT_S)
    with c:
        c.wait_for_step(5, 180, size=2)
        c.add_host(newcomer)  # a new VM boots its standby
        started = c.vm_started[newcomer]
        standby_log = c.standby_log_path(newcomer)
        _log_says(standby_log, "watcher started", 60, "the standby's watcher to start")
        noticed_at = c.preempt(newcomer, window_s=30, kill_at_deadline=False)  # during its warm-up
        _log_says(standby_log, "not offered to the job", 90, "the standby to see the notice")
        # training goes on on two past the join gate's timeout, when a VM without a ready record is listed anyway
        c.wait_for(lambda ev: [e for e in of(ev, "progress") if e["t"] > started + JOIN_TIMEOUT_S + 3], 120,
                   "steps past the join timeout")
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()

    assert not [r for r in read_ready(c.store) if r.host == newcomer]  # never offered
    [record] = [r for r in read_leaving(c.store) if r.host == newcomer]
    assert record.leave_at is None and noticed_at <= record.published_at
    assert record.deadline is not None and record.deadline <= noticed_at + 30  # dated by its last clear read
    assert not [e for e in events if e["host"] == newcomer]  # no worker of it ever ran
    assert all(r["size"] == 2 for r in of(events, "ring")), of(events, "ring")
    assert all(e["rolled_back"] == 0 for e in of(events, "reset"))
    assert not of(events, "notice")  # nobody in the ring was under notice


def test_a_worker_that_starts_on_a_vm_already_under_notice_leaves_at_once(tmp_path: Path) -> None:
    """The notice is there before the worker's watcher first reads: nothing says when it came, so its window may
    be over already. The worker leaves at once (no emergency save can end by a deadline already past), its
    record written all the same, rather than training through a second full window."""
    store = str(tmp_path / "store")
    hosts = ("localhost", "127.0.0.1")
    c = cluster(tmp_path, "run", store, hosts, elastic_cmd(store, epochs=1000, save_every=100000, leave=None))
    with c:
        noticed_at = c.preempt("127.0.0.1", window_s=90, kill_at_deadline=False)  # before any worker runs
        ring = c.wait_for(lambda ev: of(ev, "ring", size=1), 180, "the ring to shrink to 1")
        c.wait_for_step(ring[0]["step"] + 5, 60, size=1)
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()

    (notice,) = of(events, "notice", host="127.0.0.1")
    # dated from its first read (leave now), not a full window from the worker's start
    assert noticed_at < notice["deadline"] <= notice["detected_at"]
    (published,) = of(events, "leave_published", host="127.0.0.1")
    assert published.get("leave_at") is None and published["deadline"] == pytest.approx(notice["deadline"])
    [record] = [r for r in read_leaving(c.store) if r.host == "127.0.0.1"]
    assert record.leave_at is None
    (first,) = of(events, "ring", size=2, host="localhost")
    assert ring[0]["t"] - first["t"] < 20  # at once, not near a deadline 90 s away
    assert [e["leaving"] for e in of(events, "notice_agreed", host="localhost")] == [["127.0.0.1"]]
    assert all(e["rolled_back"] == 0 for e in of(events, "reset"))
