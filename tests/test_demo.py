"""The main job, `hvd-transient demo`, end to end (small model, so it runs in about a minute and a half)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_service.stores import LocalStore
from hvd_transient.discovery.ready import read_ready
from hvd_transient.report.analysis import analyze
from hvd_transient.telemetry.events import read_records

pytestmark = pytest.mark.horovod

CLI = str(Path(sys.executable).parent / "hvd-transient")
#: What a rejoin through a standby may stall the survivors for (their last step before the reset -> their first
#: step on the bigger ring): 0.8-1.1 s alone here, 1.1-1.8 s with another end-to-end run beside it, as make test
#: runs it. Without a standby the newcomer's cold start (interpreter, TensorFlow, model, the first step's trace)
#: stalls them 7-11 s on 2 cores (bench/preemption_cost.py's join scenario).
JOIN_STALL_BOUND_S = 4.0


def test_demo_plays_the_default_story_and_reports(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    # 800 steps: after the second notice the keeper restarts the VM, and its standby (a fresh TensorFlow that
    # warms up) must still find the run going on a loaded machine, where the lone survivor steps on quickly
    out = subprocess.run(
        [CLI, "demo", "--model", "small_cnn", "--epochs", "40", "--steps-per-epoch", "20",
         "--save-every", "40", "--step-seconds", "0.05", "--window", "10", "--workdir", str(tmp_path / "runs"),
         "--json", str(report), "--timeout", "600"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    body = json.loads(report.read_text())
    assert body["completed"] is True
    assert body["final_step"] == 40 * 20  # exactly the nominal steps: no epoch re-run after a reset
    preemptions = body["preemptions"]
    assert [p["was_master"] for p in preemptions] == [False, True]
    for p in preemptions:
        assert p["notice"] and p["checkpoint_committed"] and p["steps_rolled_back"] == 0
        assert p["resume_ms"] > 0
    # the keeper started the preempted VMs again; each rejoined through its standby, the survivors barely pausing
    assert body["keeper"]["refills"] >= 1 and body["keeper"]["restarts"] == body["keeper"]["refills"]
    assert body["joins"] and {j["host"] for j in body["joins"]} <= {p["host"] for p in preemptions}
    # a host can rejoin at the last step, when the new ring only saves the final checkpoint: no stall to measure
    trained_on = [j for j in body["joins"] if j["step"] < body["final_step"]]
    assert trained_on and all(j["stall_s"] is not None and j["stall_s"] < JOIN_STALL_BOUND_S for j in trained_on), \
        body["joins"]
    assert all(j["stall_s"] is None for j in body["joins"] if j["step"] == body["final_step"]), body["joins"]
    # each host that rejoined was listed only once its standby was ready, and the worker that joined is the
    # standby's: it took the job the launcher handed it, warmed up by a rehearsed step
    (run,) = (tmp_path / "runs").glob("run-*")
    store = LocalStore(str(run / "store"))
    ready = {r.host: r for r in read_ready(store)}
    joins = [j for j in analyze(read_records(store)).joins if j.step < body["final_step"]]
    assert {j.host for j in joins} == {j["host"] for j in trained_on}
    for join in joins:
        assert ready[join.host].pid == join.pid and ready[join.host].ready_at < join.t, (ready, join)
        standby_log = (run / f"standby-{join.host}.log").read_text(errors="replace")
        assert "took the job of launcher" in standby_log and "warm-up (rehearsed)" in standby_log
        assert join.steps_rolled_back == 0
    assert "keeper:" in out.stdout and "== keeper ==" in out.stdout
    assert body["cost_transient_usd"] < body["cost_on_demand_usd"]
    assert "preemption notice to" in out.stdout and "== cost ==" in out.stdout
    assert list((tmp_path / "runs").glob("run-*/timeline.png"))


def test_demo_with_pytorch_plays_the_same_story_and_reports(tmp_path: Path) -> None:
    """``--framework torch``: examples/torch_elastic.py in the same story (a worker's and the master's notice,
    the keeper's restarts joining through standbys), with the same report, at the Keras story's pace."""
    report = tmp_path / "report.json"
    out = subprocess.run(
        [CLI, "demo", "--framework", "torch", "--model", "small_cnn", "--epochs", "40", "--steps-per-epoch", "20",
         "--save-every", "40", "--step-seconds", "0.05", "--window", "10", "--workdir", str(tmp_path / "runs"),
         "--json", str(report), "--timeout", "600"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "torch small_cnn" in out.stdout
    body = json.loads(report.read_text())
    assert body["completed"] is True and body["final_step"] == 40 * 20
    preemptions = body["preemptions"]
    assert [p["was_master"] for p in preemptions] == [False, True]
    for p in preemptions:
        assert p["notice"] and p["checkpoint_committed"] and p["steps_rolled_back"] == 0
    assert body["keeper"]["refills"] >= 1 and body["joins"]
    (run,) = (tmp_path / "runs").glob("run-*")
    joins = [j for j in analyze(read_records(LocalStore(str(run / "store")))).joins if j.step < body["final_step"]]
    for join in joins:
        standby_log = (run / f"standby-{join.host}.log").read_text(errors="replace")
        assert "took the job of launcher" in standby_log and join.steps_rolled_back == 0
    assert "== cost ==" in out.stdout
