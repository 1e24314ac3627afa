"""End to end: real ``horovodrun``, fake-gcs-server behind the fault proxy on the workers' path.

Two workers train against a ``gs://`` store that every worker reaches through a
:class:`~fault_proxy.FaultProxy`: first healthy, then with the store slow (2-10 s added to
every request) or unreachable (every request dropped), during training and through a
preemption notice to the worker that is not the checkpoint master. Host discovery, on the
launcher, reads the store directly (the fault is on the workers' link).

What a user would check, from the run's own event log through the report's analysis:

* training does not slow down: the median step time of the faulty phase is within 10% of the
  healthy phase's, in the same run;
* the leaving host leaves gracefully: it published itself as leaving, the survivors rolled
  back 0 steps and went on within 1 s of the ring's reset, whether or not the emergency save
  committed. From the leaving rank's last step to that reset, Horovod's own reset runs
  (shutdown, the driver's barrier, the rendezvous): 0.3 s on an idle machine, up to about
  2 s on a loaded 2-core one, with a healthy store as with a faulty one; 4 s are allowed for it.

The event log goes through the same proxy, so events arrive late; they are read once the
proxy is healed.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from fault_proxy import Chaos, FaultProxy
from test_elastic_e2e import BASE_LR, ELASTIC, current_master

from hvd_transient.report.analysis import analyze
from hvd_transient.report.run_analysis import PREEMPTED, RunAnalysis
from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec, of

# step times of one run's two phases compared; the two scenarios are alike (same launch, same phases, same
# notice) and, started together, meet each other's same phase: make test runs them side by side
pytestmark = [pytest.mark.horovod, pytest.mark.solo, pytest.mark.twins]

HOSTS = ("localhost", "127.0.0.1")
WINDOW_S = 20.0      # the notice's window; the emergency save gets all but the 5 s leave margin
LEAVE_MARGIN_S = 5.0
STEP_S = 0.1         # each step sleeps this long on top of its (tiny) compute: CPU noise counts less
PHASE_S = 10.0       # training healthy, then under the fault before the notice (about 9 progress points each)
TOLERANCE = 1.10     # the faulty phase's median step time against the healthy one's
RESUME_MS = 1000.0   # the survivors' reset -> their first step on the new ring
HOROVOD_RESET_MS = 4000.0  # the leaving rank's last step -> the survivors' reset (Horovod's)


def command(store: str, proxy: FaultProxy) -> tuple[str, ...]:
    # Only the workers go through the proxy: the launcher's discovery keeps the direct link.
    return ("env", f"STORAGE_EMULATOR_HOST={proxy.url}", sys.executable, ELASTIC, "--store", store,
            "--model", "small_cnn", "--epochs", "1000", "--steps-per-epoch", "40", "--save-every", "20",
            "--base-lr", str(BASE_LR), "--batches-per-commit", "5", "--step-seconds", str(STEP_S),
            "--notice-window", str(WINDOW_S), "--leave", "at_notice")  # the emergency save's leave


def step_times(run: RunAnalysis, start: float, end: float) -> list[float]:
    """Seconds per step between the progress points of a 2-worker ring in [start, end)."""
    points = [p for p in run.progress if start <= p.t < end and p.size == 2]
    return [(b.t - a.t) / (b.step - a.step) for a, b in zip(points, points[1:]) if b.step > a.step]


def wait_for(c: LocalCluster, predicate: Callable[[list[dict]], Any], timeout: float, what: str) -> Any:
    """LocalCluster.wait_for, polling once a second: the proxy runs in this process and must not
    compete with the test for the CPU while the workers depend on it."""
    deadline = time.monotonic() + timeout
    while True:
        found = predicate(c.events())
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; log tail:\n{c.log_tail()}")
        time.sleep(1.0)  # polling the event log; nothing to wait on in the workers' processes


def run_scenario(tmp_path: Path, gcs, *, fault: Callable[[FaultProxy], None], heal_after_notice_s: float | None,
                 seen: str) -> tuple[RunAnalysis, str, float]:
    """Train healthy, arm ``fault``, notify the worker; heal ``heal_after_notice_s`` into the
    window (None: once the ring has shrunk). Returns the analysis, the leaving host, the notice time."""
    store = f"gs://{gcs.new_bucket('slow')}/run"
    with FaultProxy(gcs.url) as proxy:
        spec = LocalClusterSpec(store=store, hosts=HOSTS, command=command(store, proxy), workdir=tmp_path / "run",
                                notice_s=WINDOW_S)
        with LocalCluster(spec) as c:
            c.wait_for_step(20, 240, size=2)  # past the first steps' warm-up
            master = current_master(c.events())
            worker = next(h for h in HOSTS if h != master)
            # both phases are timed the same way, with this process idle (it runs the proxy)
            healthy_from = time.time()
            time.sleep(PHASE_S)  # training on a healthy store
            fault(proxy)
            faulty_from = time.time()
            time.sleep(PHASE_S)  # training under the fault (no event gets through to say so)
            notified_at = c.preempt(worker, window_s=WINDOW_S)
            if heal_after_notice_s is not None:
                time.sleep(max(0.0, notified_at + heal_after_notice_s - time.time()))  # the fault's length
            else:
                wait_for(c, lambda ev: of(ev, "ring", size=1, host=master), 60, "the ring to shrink to 1")
            assert seen in proxy.outcomes(), f"the fault never hit a request: {set(proxy.outcomes())}"
            proxy.reset()  # healed: the events held back on the workers get through now

            ring = wait_for(c, lambda ev: of(ev, "ring", size=1, host=master), 60, "the ring to shrink to 1")
            wait_for(c, lambda ev: [e for e in of(ev, "progress", size=1) if e["step"] >= ring[0]["step"] + 10],
                     60, "10 steps on the new ring")
            wait_for(c, lambda ev: of(ev, "leave_published", host=worker), 30, f"{worker}'s leave_published")
            events = c.events()
    (tmp_path / "events.json").write_text(json.dumps(events))  # for a look after a failure

    run = analyze(events)
    healthy = step_times(run, healthy_from, faulty_from)
    faulty = step_times(run, faulty_from + 1.0, notified_at)  # from when every rank is under the fault
    assert len(healthy) >= 3 and len(faulty) >= 3, (healthy, faulty)
    assert statistics.median(faulty) <= TOLERANCE * statistics.median(healthy), (
        f"steps slowed down under the fault: healthy {statistics.median(healthy):.3f} s, "
        f"faulty {statistics.median(faulty):.3f} s")

    # the leaving host left gracefully: published, no rollback, survivors on within 1 s
    (p,) = [p for p in run.preemptions if p.host == worker]
    print(f"healthy {statistics.median(healthy):.4f} s/step, faulty {statistics.median(faulty):.4f} s/step; "
          f"marks after the notice: { {k: round(t - notified_at, 2) for k, t in p.marks.items()} }; "
          f"committed {p.checkpoint_committed}, resume {p.resume_ms} ms")
    assert p.notice and not p.was_master and p.agreed_step is not None
    assert {w.host: w.outcome for w in run.workers}[worker] == PREEMPTED
    assert p.departed_at < notified_at + WINDOW_S, "it must leave before its VM stops"
    assert p.steps_rolled_back == 0 and all(e["rolled_back"] == 0 for e in of(events, "reset")), of(events, "reset")
    assert p.reset_to_first_step_ms is not None and p.reset_to_first_step_ms < RESUME_MS, p
    assert p.resume_ms is not None and p.resume_ms < HOROVOD_RESET_MS + RESUME_MS, p
    return run, worker, notified_at


def test_a_slow_store_slows_neither_training_nor_the_leave(tmp_path: Path, gcs_emulator_session) -> None:
    """Every request of the workers takes 2-10 s longer, from before the notice until the ring has shrunk."""
    run_scenario(tmp_path, gcs_emulator_session, seen="delayed-reply",
                 fault=lambda proxy: proxy.mix(Chaos(p_delay=1.0, delay_s=(2.0, 10.0), seed=7)),
                 heal_after_notice_s=None)


def test_an_unreachable_store_slows_neither_training_nor_the_leave(tmp_path: Path, gcs_emulator_session) -> None:
    """Every request of the workers is dropped, through training and the first part of the notice:
    the leaving record, written first and retried, gets through once the store answers again."""
    run, worker, notified_at = run_scenario(tmp_path, gcs_emulator_session, seen="blackholed",
                                            fault=lambda proxy: proxy.blackhole(),
                                            heal_after_notice_s=WINDOW_S / 3)
    (p,) = [p for p in run.preemptions if p.host == worker]
    assert p.departed_at > notified_at + WINDOW_S / 3, "no record could be written while the store was away"
