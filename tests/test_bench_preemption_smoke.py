"""The preemption-cost and restore benchmarks run end to end at tiny sizes and write their summaries.

No timing is asserted: only that each benchmark measures what it says and writes a valid JSON
with its summary keys (and a PNG). The analysis of the preemption benchmark is also checked on
hand-made event logs, where the right answers are known.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import preemption_cost as pc  # noqa: E402  (bench/ scripts import their helpers as top-level modules)

PREEMPTION_KEYS = ("ours_steps_rolled_back", "baseline_steps_rolled_back", "ours_resume_ms_median",
                   "baseline_resume_ms_median", "scenarios", "discovery")


def run_bench(script: str, out: Path, *args: str, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out), "--tmpdir",
                           str(out.parent / "work")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.with_suffix(".md").read_text().strip()
    work = out.parent / "work"
    assert not any(work.iterdir()), f"left behind: {list(work.iterdir())}"
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- analysis on known logs

SURVIVORS = ("localhost", "127.0.0.1")
TARGET = "127.0.1"


def ev(t: float, event: str, host: str, **fields) -> dict:
    return {"t": t, "event": event, "host": host, "pid": 1, **fields}


def record(variant: str, events: list[dict], trace: list[dict], discovery: list[dict],
           killed_at: float | None) -> pc.RunRecord:
    plan = pc.RunPlan(variant, "worker", 0, "memory://x", Path("/nonexistent"), 100)
    return pc.RunRecord(plan=plan, launched_at=80.0, notice_at=100.0, target=TARGET, master="localhost",
                        total_steps=100, events=events, trace=trace, discovery=discovery, killed_at=killed_at,
                        kill_error=None, exit_code=0, ended_at=130.0, rate_before=12.0)


def test_graceful_leave_is_measured_from_leaving_the_ring() -> None:
    events = [ev(90.0, "first_step", h, step=1, size=3) for h in (*SURVIVORS, TARGET)]
    events += [ev(100.01, "notice", TARGET, detected_at=100.001),
               ev(100.1, "notice_agreed", "localhost", step=40),
               ev(100.2, "commit", "localhost", kind="emergency", step=40),
               ev(100.21, "leave_published", TARGET, step=40)]
    events += [ev(101.51, "reset", h, step=50, rolled_back=0, last_step=50) for h in SURVIVORS]
    events += [ev(101.6, "ring", h, size=2, step=50) for h in SURVIVORS]
    events += [ev(101.7, "first_step", "localhost", step=51, size=2), ev(101.71, "first_step", "127.0.0.1",
                                                                          step=51, size=2)]
    events += [ev(102.71, "progress", "localhost", step=60, size=2), ev(104.71, "progress", "localhost", step=80,
                                                                        size=2)]
    events += [ev(106.71, "progress", "localhost", step=100, size=2)]
    trace = [ev(101.2, "hosts_updated", "localhost", driver_t=101), ev(101.3, "interrupt", "localhost"),
             ev(101.31, "interrupt", "127.0.0.1")]
    trace += [ev(101.5, "reset_done", h) for h in SURVIVORS]
    discovery = [{"t": 99.0, "end": 99.1, "code": 0, "hosts": [*SURVIVORS, TARGET]},
                 # started before the publication, read the store after it
                 {"t": 100.15, "end": 101.1, "code": 0, "hosts": list(SURVIVORS)}]
    m = pc.analyze(record("ours", events, trace, discovery, killed_at=None))
    assert m.steps_rolled_back == 0 and (m.step_before, m.step_after) == (50, 50) and m.resets == 1
    assert m.resume_ms == pytest.approx(400.0)            # training went on until the interrupt
    assert m.publish_to_resume_ms == pytest.approx(1500.0)  # leave_published -> latest survivor's first step
    assert m.notice_to_resume_ms == pytest.approx(1710.0)
    assert m.stall_ms == pytest.approx(110.0)             # the emergency checkpoint blocked every rank
    assert m.lost_s == pytest.approx(0.51)
    assert m.train_to_t_s == pytest.approx(16.71)
    assert m.rate_after == pytest.approx(10.0)
    assert m.phases_ms["discovery"] == pytest.approx(890.0)   # until the call that dropped the host ended
    assert m.phases_ms["notified"] == pytest.approx(100.0)
    assert m.phases_ms["rendezvous"] == pytest.approx(190.0)
    assert sum(v for k, v in m.phases_ms.items() if k in pc.OURS_MARKS[4:]) == pytest.approx(m.publish_to_resume_ms)
    after_interrupt = pc.OURS_MARKS[pc.OURS_MARKS.index("interrupt") + 1:]
    assert sum(v for k, v in m.phases_ms.items() if k in after_interrupt) == pytest.approx(m.resume_ms)
    assert not m.killed


def test_failure_path_counts_the_rollback_and_the_redone_steps() -> None:
    events = [ev(90.0, "first_step", h, step=1, size=3) for h in (*SURVIVORS, TARGET)]
    events += [ev(111.0, "reset", h, step=50, rolled_back=7, last_step=57) for h in SURVIVORS]
    events += [ev(111.1, "ring", h, size=2, step=50) for h in SURVIVORS]
    events += [ev(111.2, "first_step", h, step=51, size=2) for h in SURVIVORS]
    events += [ev(112.2, "progress", "localhost", step=60, size=2), ev(113.2, "progress", "localhost", step=70,
                                                                      size=2)]
    trace = [ev(110.1, "reset_begin", "localhost"), ev(110.12, "reset_begin", "127.0.0.1")]
    trace += [ev(110.9, "reset_done", h) for h in SURVIVORS]
    m = pc.analyze(record("baseline", events, trace, [], killed_at=110.0))
    assert m.steps_rolled_back == 7 and (m.step_before, m.step_after) == (57, 50)
    assert m.resume_ms == pytest.approx(1200.0) and m.publish_to_resume_ms is None
    assert m.lost_s == pytest.approx(1.2 + 7 / 10.0)       # resume + the 7 steps redone at 10 steps/s
    assert m.phases_ms["killed"] == pytest.approx(10000.0)  # the notice window nobody used
    assert m.phases_ms["failure_detected"] == pytest.approx(100.0)
    assert m.train_to_t_s is None                          # step T (100) never reached in this log
    assert m.killed


def test_targets_follow_the_master() -> None:
    rings = [{"event": "ring", "host": "127.0.1", "rank": 0, "master_host": "127.0.1"},
             {"event": "ring", "host": "localhost", "rank": 1, "master_host": "127.0.1"}]
    assert pc.current_master(rings, "ours") == "127.0.1"
    assert pc.current_master(rings, "baseline") == "127.0.1"
    assert pc.pick_target("master", "127.0.1") == "127.0.1"
    assert pc.pick_target("worker", "127.0.1") not in ("127.0.1",)
    assert pc.choose_total_steps(pc.Config("small_cnn", 1, 10.0, "local", 20, 30, None, 10, 100, 0.05, 10,
                                           ("worker",), ("ours",)), rate=10.0) == 220


# --------------------------------------------------------------------------- real runs


@pytest.mark.horovod
def test_preemption_cost_ours_worker(tmp_path: Path) -> None:
    doc = run_bench("preemption_cost.py", tmp_path / "results" / "preemption_cost.json",
                    "--repeats", "1", "--variants", "ours", "--scenarios", "worker", "--warmup-steps", "10",
                    "--total-steps", "100", "--window-s", "20")
    summary = doc["summary"]
    for key in PREEMPTION_KEYS:
        assert key in summary, key
    assert summary["ours_runs"] == {"ok": 1, "failed": 0}
    assert summary["ours_steps_rolled_back"] == 0  # the worker left gracefully: Horovod did not roll back
    assert summary["ours_resume_ms_median"] > 0 and summary["baseline_resume_ms_median"] is None
    row = doc["rows"][0]
    assert row["variant"] == "ours" and row["target"] != row["master"] and not row["killed"]
    assert {"left", "discovery", "interrupt", "first_step"} <= set(row["phases_ms"])
    assert doc["machine"]["load_average_at_start"] is not None


@pytest.mark.horovod
def test_preemption_cost_baseline_master(tmp_path: Path) -> None:
    doc = run_bench("preemption_cost.py", tmp_path / "results" / "preemption_cost.json",
                    "--repeats", "1", "--variants", "baseline", "--scenarios", "master", "--warmup-steps", "10",
                    "--total-steps", "200", "--window-s", "3", "--gloo-timeout-seconds", "5")
    summary = doc["summary"]
    for key in PREEMPTION_KEYS:
        assert key in summary, key
    assert summary["baseline_runs"] == {"ok": 1, "failed": 0}
    assert summary["baseline_resume_ms_median"] > 0 and summary["ours_resume_ms_median"] is None
    row = doc["rows"][0]
    assert row["target"] == row["master"] and row["killed"]  # rank 0's host, killed at the deadline
    assert row["resets"] >= 1 and row["steps_rolled_back"] >= 0
    assert summary["scenarios"]["master"]["baseline"]["runs"] == 1


def test_restore_read_throughput(tmp_path: Path) -> None:
    doc = run_bench("restore.py", tmp_path / "results" / "restore.json", "--sizes-mb", "1", "--writers", "1,2",
                    "--readers", "1,2", "--repeats", "1", "--skip-restart")
    summary = doc["summary"]
    assert set(summary["restore_mb_per_s"]) == {"local", "gcs"}
    assert all(v > 0 for v in summary["restore_mb_per_s"].values())
    for store in ("local", "gcs"):
        assert set(summary["restore_mb_per_s_by_size"][store]["1MB"]) == {"1->1", "1->2", "2->1", "2->2"}
    assert {r["op"] for r in doc["rows"]} == {"save", "restore"}


@pytest.mark.horovod
def test_restore_cold_restart_vs_fresh_start(tmp_path: Path) -> None:
    doc = run_bench("restore.py", tmp_path / "results" / "restore.json", "--skip-throughput",
                    "--restart-repeats", "1", "--steps-per-epoch", "5")
    summary = doc["summary"]
    assert summary["cold_restart_s"] > 0 and summary["fresh_start_s"] > 0
    assert summary["checkpoint"]["writers"] == 3
    launches = {r["kind"]: r for r in doc["rows"]}
    assert launches["cold_restart"]["restored_step"] == summary["checkpoint"]["step"]
    assert launches["fresh_start"]["restored_step"] is None
    assert "restore_end" in launches["cold_restart"]["marks"]
