"""`bench goodput` end to end on a tiny trace: what a broken benchmark would get wrong.

Two VMs, one preempted with a notice 10 s into a 20 s window, hvd-transient only (the baselines take as long
again each). The figures must hold together: 0 steps rolled back, goodput in [0, 1], the ideal recomputed
from the calibration and n(t) the bench wrote, the useful samples those of the ideal times the goodput; the
goodput at the run's own pace that against the calibration times the step-time ratio, the lost time's
phases adding up to the loss, and the load sampled during the run. With PyTorch (``--framework torch``):
plain Horovod elastic on the same trace, only what ran checked.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_transient.report.goodput import CHECKPOINT_STALLS, REMAINDER, SLOWER_STEADY, ideal_samples

REPO_ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.horovod
@pytest.mark.solo  # the calibration and the run must see the same machine, or goodput can pass 1
def test_goodput_bench_on_a_tiny_trace(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.csv"
    trace.write_text("0,add,a\n0,add,b\n10000,remove,b\n60000,remove,a\n")
    out = tmp_path / "results" / "goodput.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.goodput", "--trace", str(trace), "--trace-start", "0", "--trace-hours",
         str(20 / 3600), "--time-scale", "1", "--max-nodes", "2", "--window", "6", "--calibration-s", "3",
         "--warmup-steps", "5", "--gloo-timeout-seconds", "5", "--step-seconds", "0.05", "--variants", "ours",
         "--out", str(out), "--tmpdir", str(tmp_path / "work")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(out.read_text())
    summary, params = doc["summary"], doc["params"]
    assert summary["trace"].startswith("tiny.csv (parcae)") and summary["preemptions"] == 1
    assert summary["ours_steps_rolled_back"] == 0
    assert summary["ours_leave_leads_s"] == [None]  # a 6 s window is shorter than the first lead: at once
    g_cal, ratio = summary["ours_goodput_vs_calibration"], summary["ours_step_time_ratio"]
    assert 0.0 < g_cal <= 1.0
    assert summary["horovod_elastic_goodput"] is None and summary["restart_goodput"] is None  # not run
    rates = {int(k): v for k, v in summary["calibration_samples_per_s"].items()}
    assert set(rates) == {1, 2} and all(r > 0 for r in rates.values())
    availability = [tuple(x) for x in params["availability"]]
    assert availability == [(0.0, 2), (10.0, 1)]
    assert summary["ideal_samples"] == pytest.approx(ideal_samples(availability, rates, 20.0))
    (row,) = doc["rows"]
    assert row["useful_samples"] == pytest.approx(g_cal * summary["ideal_samples"])
    # the same machine state: the ring's steady steps against the calibration's, and the goodput at that pace
    assert 0.2 < ratio < 5.0 and summary["ours_goodput"] == pytest.approx(g_cal * ratio)
    by_size = summary["step_time_ratio_by_size"]["ours"]
    assert by_size and set(by_size) <= {"1", "2"} and all(0.2 < r < 5.0 for r in by_size.values())
    assert all(p["size"] in (1, 2) and p["steady_s"] > 0 and p["steps_per_s"] > 0 for p in row["ring_paces"])
    # the lost time names what it holds, and its phases (the remainder signed) add up to the loss
    phases = row["lost_phases_s"]
    assert {SLOWER_STEADY, CHECKPOINT_STALLS, REMAINDER} <= set(phases) and "other" not in " ".join(phases)
    assert phases[SLOWER_STEADY] == pytest.approx(20.0 * g_cal * (ratio - 1.0))
    assert phases[CHECKPOINT_STALLS] >= 0.0
    assert sum(phases.values()) == pytest.approx(20.0 * (1.0 - g_cal), abs=0.01)
    # the machine during the run: sampled every 5 s, the benchmark's own cores told apart from the others'
    cores = doc["machine"]["cores"]
    for load in (summary["load"]["ours"], summary["load"]["calibration"], row["load"]):
        assert load["samples"] >= 1 and 0.0 <= load["load_1m"] <= load["load_1m_max"]
        assert 0.0 <= load["others_cores"] <= load["busy_cores"] <= cores + 0.5
    assert row["useful_samples"] % 32 == 0  # whole steps of whole batches
    assert 0 < summary["cost_per_m_samples_on_demand"] and 0 < summary["cost_per_m_samples_spot"]
    assert (out.parent / "goodput-ours.png").read_bytes()[:8] == PNG_MAGIC
    markdown = out.with_suffix(".md").read_text()
    assert "| hvd-transient |" in markdown
    assert "| step time / calibration |" in markdown and "| other processes' cores |" in markdown
    work = tmp_path / "work"
    assert not any(work.iterdir()), f"left behind: {list(work.iterdir())}"


@pytest.mark.horovod
def test_goodput_bench_with_pytorch_plays_plain_horovod_elastic(tmp_path: Path) -> None:
    """``--framework torch``: plain Horovod's ``TorchState`` worker (which the calibration runs too) on the
    same tiny trace (examples/torch_elastic.py runs in the PyTorch preemption-cost smoke and the end-to-end
    runs). Only what ran is checked: its row, no error, the framework in the JSON and the markdown; no
    figure is judged."""
    trace = tmp_path / "tiny.csv"
    trace.write_text("0,add,a\n0,add,b\n10000,remove,b\n60000,remove,a\n")
    out = tmp_path / "results" / "goodput-torch.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.goodput", "--framework", "torch", "--trace", str(trace), "--trace-start", "0",
         "--trace-hours", str(20 / 3600), "--time-scale", "1", "--max-nodes", "2", "--window", "6",
         "--calibration-s", "8", "--warmup-steps", "5", "--gloo-timeout-seconds", "5", "--step-seconds", "0.05",
         "--variants", "horovod_elastic", "--no-plot", "--out", str(out), "--tmpdir", str(tmp_path / "work")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["framework"] == doc["params"]["framework"] == "torch"
    assert summary["errors"] == {}, summary["errors"]
    assert [row["variant"] for row in doc["rows"]] == ["horovod_elastic"]
    assert set(summary["calibration_samples_per_s"]) == {"1", "2"} and summary["restart_goodput"] is None
    markdown = out.with_suffix(".md").read_text()
    assert "PyTorch (examples/torch_elastic.py against bench/plain_torch_elastic_worker.py)" in markdown
    assert "| plain Horovod elastic |" in markdown
    work = tmp_path / "work"
    assert not any(work.iterdir()), f"left behind: {list(work.iterdir())}"


def test_the_table_names_a_variant_that_failed_and_why() -> None:
    """A variant whose run failed (plain Horovod's driver can stop after three worker failures) is a row of the
    table, in the variants' order, with its error: a reader must not take two rows for the whole comparison."""
    from bench import goodput as gp
    from hvd_transient.report.goodput import Goodput

    ours = Goodput("ours", useful_samples=900, ideal_samples=1000.0, final_step=10, steps_rolled_back=0,
                   preemptions_seen=1)
    restart = Goodput("restart", useful_samples=600, ideal_samples=1000.0, final_step=7, steps_rolled_back=0,
                      preemptions_seen=1)
    out = {"results": {"restart": restart, "ours": ours}, "launches": {"ours": 1, "restart": 2},
           "errors": {"horovod_elastic": "ClusterError: failure count == 3 -> stop running"},
           "rates": {1: 10.0, 2: 18.0}}
    summary = {"cost_per_m_samples_spot_by_variant": {"ours": 0.1, "restart": 0.2},
               "cost_per_m_samples_on_demand": 0.3, "instance_type": "n1", "ours_leave_leads_s": [None]}
    lines = [line for line in gp.table(out, summary).splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]  # below the header and rule
    assert [c[0] for c in cells] == ["hvd-transient", "plain Horovod elastic", "checkpoint-restart"]
    assert cells[0][1] == "0.900" and cells[2][1] == "0.600"
    assert cells[1][1] == "failed" and cells[1][-1] == "ClusterError: failure count == 3 -> stop running"


def test_the_table_says_which_driver_messages_rank_0_announced() -> None:
    """A run where Horovod's driver lost a message says so beside the leads, so that a stall it caused is not
    read as the protocol's; a run where none was lost says nothing of it."""
    from bench import goodput as gp
    from hvd_transient.report.goodput import Goodput

    ours = Goodput("ours", useful_samples=900, ideal_samples=1000.0, final_step=10, steps_rolled_back=0,
                   preemptions_seen=1, host_updates_announced={"join": 1})
    out = {"results": {"ours": ours}, "launches": {"ours": 1}, "errors": {}, "rates": {1: 10.0}}
    summary = {"cost_per_m_samples_spot_by_variant": {"ours": 0.1}, "cost_per_m_samples_on_demand": 0.3,
               "instance_type": "n1", "ours_leave_leads_s": [4.0], "ours_host_updates_announced": {"join": 1}}
    assert "Horovod's driver lost its message of 1 join(s), which rank 0 announced" in gp.table(out, summary)
    summary["ours_host_updates_announced"] = {}
    assert "driver lost" not in gp.table(out, summary)
