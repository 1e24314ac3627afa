"""End to end under real `horovodrun`: a worker under a GCE notice (``leave="near_deadline"``, the default) leaves
before the cloud stops its VM, whatever its watcher saw and however long its steps are. The window comes from the
VM's notice-length attribute on the metadata emulator, and the cluster kills the worker at the window's real end,
as Compute Engine would; each run must end with the departure before that moment and nothing rolled back.

- The metadata server answers 503 to the worker's VM for a spell, and the notice comes during it: the watcher sees
  the notice only once the spell is over, and must date the deadline from its last read that said "not
  preempted", before the spell, not from the read that saw the notice.
- Steps are long against the window: a VM can leave only at a step boundary, so its lead must cover a whole step
  besides the departure (or, where that does not fit, it leaves at once)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_elastic_e2e import cluster, current_master, elastic_cmd

from hvd_transient.testing.local_cluster import LocalCluster, of

pytestmark = pytest.mark.horovod

HOSTS = ("localhost", "127.0.0.1")


def _command(store: str, *, step_seconds: float, save_every: int, leave_lead_s: float) -> tuple[str, ...]:
    """The example with the product's default departure (near the deadline) and a fixed departure allowance;
    no ``--notice-window``: the watcher reads the window from the VM's metadata, as on GCE."""
    cmd = list(elastic_cmd(store, epochs=1000, save_every=save_every, step_seconds=step_seconds, leave=None))
    at = cmd.index("--notice-window")
    del cmd[at:at + 2]
    return (*cmd, "--leave-lead", f"{leave_lead_s:g}")


def _until_stopped_at_deadline(c: LocalCluster, worker: str, timeout: float) -> Any:
    """Wait until the emulator has acted at the worker's deadline (signalled its worker, or found it gone)."""
    if not c.emulator.wait_for(lambda s: s[worker].killed_at is not None or s[worker].kill_error is not None,
                               timeout):
        raise AssertionError(f"the deadline of {worker} did not pass within {timeout:.0f}s; log tail:\n"
                             f"{c.log_tail()}")
    return c.emulator.instance(worker)


def _assert_left_before_deadline(events: list[dict], worker: str, survivor: str, deadline: float) -> dict:
    """The worker published its departure and left the ring before ``deadline`` (the cloud's), and the
    survivor went on with nothing rolled back. Returns the worker's ``leave_published`` event."""
    (published,) = of(events, "leave_published", host=worker)
    assert published["t"] < deadline, (published, deadline)
    if published.get("leave_at") is not None:
        assert published["leave_at"] < deadline, (published, deadline)
    rings = of(events, "ring", host=survivor)
    assert [r["size"] for r in rings] == [2, 1], rings
    # the ring of two took its last step before the cloud stopped the VM, and the survivor's new ring began
    # before it too: the VM was never stopped inside the ring
    (reset,) = of(events, "reset", host=survivor)
    assert reset["rolled_back"] == 0, reset
    assert reset["last_step_at"] < deadline, (reset, deadline)
    assert rings[1]["t"] < deadline, (rings[1], deadline)
    assert all(e["rolled_back"] == 0 for e in of(events, "reset")), of(events, "reset")
    return published


SPELL_S, WINDOW_S, SPELL_LEAD_S = 9.0, 20.0, 6.0


def test_a_gce_notice_during_a_metadata_error_spell_is_dated_from_the_last_clear_read(tmp_path: Path) -> None:
    """The notice comes about a second into a 9 s spell of 503s. Dated from the read that saw it (after the
    spell), the deadline would be about 8 s late, the VM would plan to leave about a second after the cloud
    stopped it (the lead: 6 s plus a check interval), and the survivor would roll back. Dated from the last
    clear read (before the spell), it is early by the spell's first second and a poll or two, and the VM leaves
    in time."""
    store = str(tmp_path / "store")
    c = cluster(tmp_path, "run", store, HOSTS,
                _command(store, step_seconds=0.1, save_every=100000, leave_lead_s=SPELL_LEAD_S),
                notice_s=WINDOW_S)
    with c:
        c.wait_for_step(10, 180, size=2)
        master = current_master(c.events())
        worker = next(h for h in HOSTS if h != master)
        spell = c.emulator.set_fault(worker, "503", duration=SPELL_S)
        assert spell.fault_until is not None
        spell_start = spell.fault_until - SPELL_S
        # the notice comes once the worker's watcher has failed and retried for a while (its backoff: 0.25 s,
        # 0.5 s, then 1 s), about a second into the spell
        assert c.emulator.wait_for(lambda s: s[worker].fault_hits.get("503", 0) >= 5, SPELL_S / 2), \
            c.emulator.instance(worker)
        c.preempt(worker, window_s=WINDOW_S)  # its worker is signalled, and the VM unlisted, at the window's end
        truth = c.emulator.instance(worker)
        assert truth.notice_at is not None and truth.deadline is not None
        assert spell_start < truth.notice_at < spell.fault_until - 3, (spell_start, truth)
        c.wait_for(lambda ev: of(ev, "ring", size=1, host=master), 120, "the ring to shrink to 1")
        _until_stopped_at_deadline(c, worker, truth.deadline - truth.notice_at + 30)
        c.wait_for(lambda ev: [e for e in of(ev, "progress", host=master, size=1) if e["t"] > truth.deadline], 60,
                   "steps past the deadline")
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()

    (notice,) = of(events, "notice", host=worker)
    # seen only once the spell was over, and dated from the last read before it that said "not preempted"
    assert notice["detected_at"] >= spell.fault_until, (notice, spell)
    assert notice["deadline_basis"] == "last_clear_read", notice
    assert notice["deadline"] <= spell_start + WINDOW_S, (notice, spell_start)
    # ...which came about a long-poll or two before the spell (later on a loaded machine)
    assert notice["deadline"] > spell_start + WINDOW_S - 5, (notice, spell_start)
    assert notice["deadline"] <= truth.deadline
    published = _assert_left_before_deadline(events, worker, master, truth.deadline)
    assert published["deadline"] == pytest.approx(notice["deadline"]), (published, notice)


#: the departure allowance covers Horovod's discovery round (1 s plus the script, several seconds on a loaded
#: 2-core machine) and the ring's reset (up to 4.5 s there); the lead adds the slowest step to it
STEP_S, SLOW_WINDOW_S, SLOW_LEAD_S = 2.5, 16.0, 7.0


def test_slow_steps_against_a_short_window_leave_before_the_deadline(tmp_path: Path) -> None:
    """Steps of about 2.5 s in a 16 s window, the notice landing mid-step: the lead covers the slowest step the
    ranks timed besides the 7 s departure allowance, so the VM trains on (or, where that does not fit, leaves at
    once) and is gone before the window ends. A lead of the allowance and the 1 s check interval alone would
    leave the VM's last step boundary to chance against the deadline."""
    store = str(tmp_path / "store")
    c = cluster(tmp_path, "run", store, HOSTS,
                _command(store, step_seconds=STEP_S, save_every=3, leave_lead_s=SLOW_LEAD_S),
                notice_s=SLOW_WINDOW_S)
    with c:
        # steps timed on the ring of two (its first step, which pays for the set-up, is not): the periodic save
        # of step 3 is the first event after them
        c.wait_for(lambda ev: [e for e in of(ev, "commit", size=2) if e["step"] >= 3], 180,
                   "a save at step 3 on the ring of two")
        master = current_master(c.events())
        worker = next(h for h in HOSTS if h != master)
        c.preempt(worker, window_s=SLOW_WINDOW_S)  # mid-step; its worker is signalled at the window's end
        truth = c.emulator.instance(worker)
        assert truth.notice_at is not None and truth.deadline is not None
        c.wait_for(lambda ev: of(ev, "ring", size=1, host=master), 120, "the ring to shrink to 1")
        _until_stopped_at_deadline(c, worker, SLOW_WINDOW_S + 30)
        c.request_stop()
        assert c.wait(120) == 0, c.log_tail()
        events = c.events()

    (notice,) = of(events, "notice", host=worker)
    assert notice["deadline_basis"] == "last_clear_read", notice
    assert truth.deadline - 5 < notice["deadline"] <= truth.deadline, (notice, truth)
    published = _assert_left_before_deadline(events, worker, master, truth.deadline)
    if published.get("leave_at") is not None:
        # trained on: the lead kept a whole step (it can leave only at a boundary) besides the departure
        lead = published["deadline"] - published["leave_at"]
        assert lead >= STEP_S + SLOW_LEAD_S, published
    (agreed,) = of(events, "notice_agreed", host=master)
    assert agreed["leaving"] == [worker], agreed
