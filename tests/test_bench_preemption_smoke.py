"""The preemption-cost and restore benchmarks run end to end at tiny sizes and write their summaries.

No timing is asserted: only that each benchmark measures what it says and writes a valid JSON
with its summary keys (and a PNG). How the preemption benchmark reads a run (RunAnalysis) is
also checked on hand-made event logs, where the right answers are known.

Real runs: both variants on a join (the Keras scripts, the baseline's plain-Horovod worker included), ours
on a worker's notice with PyTorch (``--framework torch``: the benchmark's scenarios do not depend on the
framework; plain Horovod's PyTorch worker runs in the PyTorch goodput smoke), and a cold restart against a
fresh start. The baseline's kill at the deadline is read on a hand-made log only: what it adds to a real run
is Horovod's own recovery from a lost worker, which ``test_attempt_e2e.py`` runs (a master killed mid-save,
the survivors rolled back).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench import preemption_cost as pc

REPO_ROOT = Path(__file__).resolve().parent.parent

PREEMPTION_KEYS = ("ours_steps_rolled_back", "baseline_steps_rolled_back", "ours_resume_ms_median",
                   "baseline_resume_ms_median", "ours_join_stall_s", "baseline_join_stall_s", "scenarios")


def run_bench(module: str, out: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", *args, "--out", str(out), "--tmpdir",
                           str(out.parent / "work")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.with_suffix(".md").read_text().strip()
    work = out.parent / "work"
    assert not any(work.iterdir()), f"left behind: {list(work.iterdir())}"
    doc: dict[str, Any] = json.loads(out.read_text())
    # a run that failed is a row with its error's first line; the bench's log has the rest (horovodrun's log tail)
    failed = [(r.get("variant"), r.get("scenario"), r["error"]) for r in doc.get("rows", []) if r.get("error")]
    assert not failed, f"{failed}\nthe bench's log:\n{proc.stderr[-8000:]}"
    return doc


# --------------------------------------------------------------------------- reading known logs

SURVIVORS = ("localhost", "127.0.0.1")
TARGET = "127.0.1"


def ev(t: float, event: str, host: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, "host": host, "pid": {"localhost": 1, "127.0.0.1": 2}.get(host, 3), **fields}


def ring(t: float, step: int, hosts: tuple[str, ...], *, plain: bool = False) -> list[dict[str, Any]]:
    """Every rank's ring event; ``plain``: as the plain-Horovod worker writes them (master host on rank 0 only)."""
    return [ev(t + 0.001 * r, "ring", h, step=step, rank=r, size=len(hosts), master=0,
               master_host=None if plain and r else hosts[0]) for r, h in enumerate(hosts)]


def record(variant: str, events: list[dict[str, Any]], killed_at: float | None,
           scenario: str = "worker") -> pc.RunRecord:
    plan = pc.RunPlan(variant, scenario, 0, "memory://x", Path("/nonexistent"), 100)
    return pc.RunRecord(plan, 80.0, 100.0, TARGET, "localhost", 100, events, killed_at=killed_at, exit_code=0,
                        ended_at=130.0)


def three_then_two(reset_t: float, rolled_back: int, last_step_at: float | None = None) -> list[dict[str, Any]]:
    """A ring of 3 from t=80; the survivors, whose last step on it ended at ``last_step_at``, reset at
    ``reset_t`` and train on 2 from step 50."""
    events = ring(80.0, 0, (*SURVIVORS, TARGET))
    events += [ev(90.0, "first_step", h, step=1, size=3) for h in (*SURVIVORS, TARGET)]
    events += [ev(reset_t, "reset", h, step=50, rolled_back=rolled_back, last_step=50 + rolled_back,
                  last_step_at=None if last_step_at is None else last_step_at - 0.01 * (h == "localhost"))
               for h in SURVIVORS]
    events += ring(reset_t + 0.1, 50, SURVIVORS)
    events += [ev(reset_t + 0.2, "first_step", "localhost", step=51, size=2),
               ev(reset_t + 0.21, "first_step", "127.0.0.1", step=51, size=2)]
    events += [ev(reset_t + 1.2 + i, "progress", "localhost", step=60 + 10 * i, size=2) for i in range(5)]
    return events


def test_graceful_leave_is_measured_from_leaving_the_ring() -> None:
    events = three_then_two(101.51, 0, last_step_at=101.31)
    events += [ev(100.01, "notice", TARGET, source="gce", reason="preempted", detected_at=100.001, deadline=110.0),
               ev(100.1, "notice_agreed", "localhost", step=40, leaving=[TARGET], deadline=105.0, size=3),
               ev(100.2, "commit", "localhost", kind="emergency", step=40, size=3),
               ev(100.21, "leave_published", TARGET, step=40, deadline=110.0)]
    m = pc.measure(record("ours", sorted(events, key=lambda e: e["t"]), killed_at=None))
    assert m.error is None
    assert m.steps_rolled_back == 0 and (m.step_before, m.step_after) == (50, 50) and m.resets == 1
    assert m.resume_ms == pytest.approx(400.0)            # training went on until the last survivor's last step
    assert m.publish_to_resume_ms == pytest.approx(1500.0)  # leave_published -> the first survivor's first step
    assert m.notice_to_resume_ms == pytest.approx(1710.0)
    assert m.stall_ms == pytest.approx(110.0)             # the emergency checkpoint blocked every rank
    assert m.lost_s == pytest.approx(0.51)
    assert m.train_to_t_s == pytest.approx(16.71)         # first step 90.0 -> step 100 at 106.71
    assert m.phases_ms["notice"] == pytest.approx(1.0)       # the watcher's detection
    assert m.phases_ms["committed"] == pytest.approx(100.0)
    assert m.phases_ms["last_step"] == pytest.approx(1100.0)  # discovery and Horovod's notification; training on
    assert m.phases_ms["reset"] == pytest.approx(200.0)
    after_left = pc.MARKS[pc.MARKS.index("left") + 1:]
    assert sum(v for k, v in m.phases_ms.items() if k in after_left) == pytest.approx(m.publish_to_resume_ms)
    after_last_step = pc.MARKS[pc.MARKS.index("last_step") + 1:]
    assert sum(v for k, v in m.phases_ms.items() if k in after_last_step) == pytest.approx(m.resume_ms)
    assert not m.killed


def test_failure_path_counts_the_rollback_and_the_redone_steps() -> None:
    events = three_then_two(111.0, 7)
    m = pc.measure(record("baseline", events, killed_at=110.0))
    assert m.steps_rolled_back == 7 and (m.step_before, m.step_after) == (57, 50)
    assert m.resume_ms == pytest.approx(1200.0) and m.publish_to_resume_ms is None   # from the kill
    assert m.lost_s == pytest.approx(1.2 + 7 / 10.0)       # resume + the 7 steps redone at 10 steps/s
    assert m.phases_ms["left"] == pytest.approx(10000.0)    # the notice window nobody used
    assert m.phases_ms["reset"] == pytest.approx(1000.0)    # the survivors' failure, rendezvous and rollback
    assert "last_step" not in m.phases_ms
    assert m.train_to_t_s == pytest.approx(116.2 - 90.0)
    assert m.killed


def test_join_stall_comes_from_the_run_analysis() -> None:
    two = ("localhost", "127.0.0.1")
    events = ring(80.0, 0, two, plain=True)
    events += [ev(81.0, "first_step", h, step=1, size=2) for h in two]
    events += [ev(99.0, "progress", h, step=40, size=2) for h in two]
    events += [ev(103.0, "reset", h, step=44, rolled_back=0, last_step=44) for h in two]
    events += ring(104.0, 44, (*two, TARGET), plain=True)
    events += [ev(106.5, "first_step", h, step=45, size=3) for h in (*two, TARGET)]
    m = pc.measure(record("baseline", events, killed_at=None, scenario="join"))
    assert m.error is None and m.join_stall_s == pytest.approx(7.5) and m.steps_rolled_back == 0
    summary = pc.summarize([m], pc.Config("small_cnn", 1, 10.0, "local", 20, 30, None, 10, 100, 0.05, 10,
                                          ("join",), ("baseline",)))
    assert summary["baseline_join_stall_s"] == pytest.approx(7.5) and summary["ours_join_stall_s"] is None
    assert summary["baseline_resume_ms_median"] is None


def config(total_steps: int | None = None) -> pc.Config:
    """The defaults: a 10 s window, epochs of 20 steps, a warm-up of 30."""
    return pc.Config("small_cnn", 1, 10.0, "local", 20, 30, total_steps, 10, 100, 0.05, 10, ("worker",), ("ours",))


def test_targets() -> None:
    assert pc.pick_target("master", "127.0.1") == "127.0.1"
    assert pc.pick_target("worker", "127.0.1") not in ("127.0.1",)


def test_step_t_follows_the_step_of_the_notice_not_the_warm_up() -> None:
    """Through a store that answers in seconds the bench reads the log late: the job saw step 30 at t=100 but
    the notice came at t=112, about step 150. The target trains until its deadline at the latest (t=122,
    about step 250), so T must come after that, whatever the warm-up."""
    rate = 10.0
    events = [ev(90.0, "first_step", "localhost", step=1, size=3), ev(100.0, "progress", "localhost", step=30, size=3),
              ev(104.0, "progress", "localhost", step=70, size=3)]  # written after the bench read the log
    notice_step = pc.step_at(events[:2], 112.0, rate)
    assert notice_step == pytest.approx(150.0)
    assert pc.step_at(events, 104.5, rate) == pytest.approx(75.0)  # the latest report before the time counts
    total = pc.choose_total_steps(config(), rate, notice_step)
    latest_resume = notice_step + rate * config().window_s
    assert total >= latest_resume + pc.RESUME_MARGIN_STEPS and total % config().steps_per_epoch == 0
    assert total == 340  # 150 + 1.5 windows of 10 steps/s + 40, in epochs of 20
    # a notice on time keeps the old figure: warm-up + 1.5 windows + 40
    assert pc.choose_total_steps(config(), rate, 30.0) == 220


def test_a_late_resume_moves_a_chosen_step_t_and_fails_only_a_fixed_one() -> None:
    cfg = config()
    assert pc.settle_total_steps(220, 180, cfg, chosen_here=True) == 220  # resumed before T: kept
    # chosen by this run: it goes on until the survivors resumed, then 40 steps more, in epochs
    assert pc.settle_total_steps(220, 260, cfg, chosen_here=True) == 300
    assert pc.settle_total_steps(220, 220, cfg, chosen_here=True) == 260
    with pytest.raises(pc.LateResume):  # chosen by an earlier run: this run is reported as failed, the rest go on
        pc.settle_total_steps(220, 260, cfg, chosen_here=False)
    with pytest.raises(pc.bc.BenchError, match="raise --total-steps"):  # the user's own T
        pc.settle_total_steps(220, 260, config(total_steps=220), chosen_here=False)


# --------------------------------------------------------------------------- real runs


@pytest.mark.horovod
def test_preemption_cost_join_both_variants(tmp_path: Path) -> None:
    doc = run_bench("preemption_cost", tmp_path / "results" / "preemption_cost.json",
                    "--repeats", "1", "--scenarios", "join", "--warmup-steps", "10",
                    # no peer dies in a join: a long wait only lets plain Horovod's new worker import TensorFlow
                    # on a loaded machine while the others wait for it in Gloo's rendezvous
                    "--gloo-timeout-seconds", "60")
    summary = doc["summary"]
    for key in PREEMPTION_KEYS:
        assert key in summary, key
    assert summary["ours_join_stall_s"] > 0 and summary["baseline_join_stall_s"] > 0
    assert summary["ours_resume_ms_median"] is None and summary["total_steps"] is None
    assert [(r["variant"], r["target"], r["error"]) for r in doc["rows"]] == [("ours", "127.0.1", None),
                                                                              ("baseline", "127.0.1", None)]


@pytest.mark.horovod
def test_preemption_cost_with_pytorch(tmp_path: Path) -> None:
    """A worker's preemption, ours, with ``--framework torch`` (examples/torch_elastic.py; plain Horovod's
    ``TorchState`` worker runs in the PyTorch goodput smoke, the Keras scripts in the join run above): its run
    is a row without an error, with the phases the benchmark reads, and the JSON and the markdown say which
    framework ran. No figure is judged (step T comes from the run)."""
    doc = run_bench("preemption_cost", tmp_path / "results" / "preemption_cost.json", "--framework", "torch",
                    "--repeats", "1", "--scenarios", "worker", "--variants", "ours",
                    timeout=540)
    summary = doc["summary"]
    for key in PREEMPTION_KEYS:
        assert key in summary, key
    assert summary["framework"] == doc["params"]["framework"] == "torch"
    assert [(r["variant"], r["scenario"], r["error"]) for r in doc["rows"]] == [("ours", "worker", None)]
    assert summary["ours_runs"] == {"ok": 1, "failed": 0}
    assert summary["ours_steps_rolled_back"] == 0  # the worker left gracefully: Horovod did not roll back
    assert summary["ours_resume_ms_median"] > 0 and summary["baseline_resume_ms_median"] is None
    row = doc["rows"][0]
    assert row["target"] != row["master"] and not row["killed"]
    assert {"agreed", "left", "last_step", "first_step"} <= set(row["phases_ms"])
    assert doc["machine"]["load_average_at_start"] is not None
    markdown = (tmp_path / "results" / "preemption_cost.md").read_text()
    assert "PyTorch (examples/torch_elastic.py against bench/plain_torch_elastic_worker.py)" in markdown


def test_framework_picks_both_scripts_and_a_results_file_of_its_own() -> None:
    """``--framework torch``: the PyTorch example and plain Horovod's TorchState worker, on the Keras scripts'
    2,048 samples; its results do not overwrite the Keras ones unless --out says so."""
    cfg = replace(config(), framework="torch")
    ours = pc.worker_command(pc.RunPlan("ours", "worker", 0, "/s", Path("/w"), 100), cfg)
    plain = pc.worker_command(pc.RunPlan("baseline", "worker", 0, "/s", Path("/w"), 100), cfg)
    assert ours[1].endswith("examples/torch_elastic.py") and plain[1].endswith("bench/plain_torch_elastic_worker.py")
    for command in (ours, plain):
        assert command[command.index("--samples") + 1] == "2048" and "--cifar10-npz" not in command
    keras = pc.worker_command(pc.RunPlan("baseline", "worker", 0, "/s", Path("/w"), 100), config())
    assert keras[1].endswith("bench/plain_elastic_worker.py") and "--samples" not in keras
    out = {f: pc.bc.results_path(pc.build_parser().parse_args(["--framework", f]), "preemption_cost").name
           for f in ("keras", "torch")}
    assert out == {"keras": "preemption_cost.json", "torch": "preemption_cost-torch.json"}
    given = pc.build_parser().parse_args(["--framework", "torch", "--out", "x.json"])
    assert pc.bc.results_path(given, "preemption_cost") == Path("x.json")


def test_the_torch_small_cnn_has_the_keras_layers_and_resnet8_is_torch_only(capsys: pytest.CaptureFixture[str]) -> None:
    """PyTorch's ``small_cnn`` costs a step about what the Keras one does (the same layers, as many weights);
    the narrow ResNet-8 that it was until 2026-12-02 stays as ``resnet8``, for PyTorch runs only."""
    import torch

    from hvd_transient.testing.torch_workloads import MODELS

    model = MODELS["small_cnn"]()
    assert sum(p.numel() for p in model.parameters()) == 3 * 3 * 3 * 8 + 8 + 2 * 8 + 8 * 32 + 32 + 32 * 10 + 10
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in MODELS["resnet8"]().parameters()) > 10 * sum(p.numel() for p in model.parameters())
    args = pc.build_parser().parse_args(["--framework", "torch", "--model", "resnet8"])
    assert args.model == "resnet8"
    with pytest.raises(SystemExit):
        pc.main(["--model", "resnet8", "--framework", "keras"])
    assert "--model resnet8 is a PyTorch model" in capsys.readouterr().err


def test_restore_read_throughput(tmp_path: Path) -> None:
    doc = run_bench("restore", tmp_path / "results" / "restore.json", "--sizes-mb", "1", "--writers", "1,2",
                    "--readers", "1,2", "--repeats", "1", "--skip-restart")
    summary = doc["summary"]
    assert set(summary["restore_mb_per_s"]) == {"local", "gcs"}
    assert all(v > 0 for v in summary["restore_mb_per_s"].values())
    for store in ("local", "gcs"):
        assert set(summary["restore_mb_per_s_by_size"][store]["1MB"]) == {"1->1", "1->2", "2->1", "2->2"}
    assert {r["op"] for r in doc["rows"]} == {"save", "restore"}


@pytest.mark.horovod
def test_restore_cold_restart_vs_fresh_start(tmp_path: Path) -> None:
    doc = run_bench("restore", tmp_path / "results" / "restore.json", "--skip-throughput",
                    "--restart-repeats", "1", "--steps-per-epoch", "5")
    summary = doc["summary"]
    assert summary["cold_restart_s"] > 0 and summary["fresh_start_s"] > 0
    assert summary["checkpoint"]["writers"] == 3
    launches = {r["kind"]: r for r in doc["rows"]}
    assert launches["cold_restart"]["restored_step"] == summary["checkpoint"]["step"]
    assert launches["fresh_start"]["restored_step"] is None
    assert {"start", "ring", "first_step"} <= set(launches["cold_restart"]["marks"])
