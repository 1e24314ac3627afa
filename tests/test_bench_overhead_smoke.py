"""The ckpt-overhead and emergency-save benchmarks run end to end at tiny sizes.

No timing is asserted: only that each benchmark measures every configuration it says it
does, writes the summary keys the README documents, a PNG, and cleans up after itself.
The windows plan, the stall arithmetic and the goal check are checked as pure functions.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import ckpt_overhead

REPO_ROOT = Path(__file__).resolve().parent.parent

OVERHEAD_KEYS = ("async_overhead_pct", "async_stall_ms", "memcpy_ms", "baseline_overhead_pct", "sync_overhead_pct",
                 "baseline_stall_ms", "sync_stall_ms", "steps_per_s", "goal", "notice_collective_ms",
                 "throughput_noise_pct", "async_blocking_estimate_pct", "async_plain_call_ms",
                 "async_plain_call_cpu_ms", "async_stall_vs_memcpy", "async_stall_ms_by_interval",
                 "async_overhead_pct_by_interval")
EMERGENCY_KEYS = ("sharded_speedup_vs_single", "max_state_mb_in_30s", "notice_to_commit_s", "single_writer_s",
                  "fits_in_30s")

USER_MODEL = textwrap.dedent("""
    import tensorflow as tf

    def build():
        model = tf.keras.Sequential([tf.keras.Input(shape=(8,)), tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(3)])
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
""")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# --------------------------------------------------------------------------- ckpt-overhead


def test_every_window_starts_with_a_save_and_configurations_alternate() -> None:
    configs = ("none", "save_weights", "ours_sync", "ours_async")
    plan = ckpt_overhead.plan_windows(configs, (50, 200), 200)
    measured = [w for w in plan if w.index >= 0]
    warmups = [w for w in plan if w.index < 0]
    assert {(w.config, w.interval) for w in warmups} == {(c, k) for c in configs[1:] for k in (50, 200)}
    assert all(plan.index(w) < plan.index(measured[0]) for w in warmups)
    for w in plan:
        assert w.start_step % w.interval == 0 and w.start_step > 0
    for config in configs:
        for interval, windows in ((50, 4), (200, 1)):
            mine = [w for w in measured if (w.config, w.interval) == (config, interval)]
            assert len(mine) == windows and all(w.steps == interval for w in mine)
            assert len({w.start_step for w in mine}) == windows  # never the same checkpoint step twice
    # each round runs every configuration once, in a rotated order
    round0 = [w.config for w in measured if w.index == 0 and w.interval == 50]
    round1 = [w.config for w in measured if w.index == 1 and w.interval == 50]
    assert sorted(round0) == sorted(configs) and round0 != round1


def merged(*per_rank_windows: list[dict]) -> list:
    return ckpt_overhead.config_stats(ckpt_overhead.merge_ranks(
        [{"rank": r, "windows": windows} for r, windows in enumerate(per_rank_windows)]))


def test_stall_is_the_slowest_rank_beyond_its_usual_call() -> None:
    window = {"config": "ours_sync", "interval": 4, "index": 0, "save_steps": [0], "train_s": [0.1] * 4,
              "window_s": 0.5}
    none = {"config": "none", "interval": 4, "index": 0, "save_steps": [], "train_s": [0.1] * 4, "hook_s": [0.0] * 4,
            "window_s": 0.4}
    stats = {s.config: s for s in merged([dict(window, hook_s=[0.05, 0.01, 0.01, 0.01]), none],
                                         [dict(window, hook_s=[0.08, 0.02, 0.02, 0.02]), none])}
    assert stats["ours_sync"].stall_ms.median == pytest.approx(60.0)  # rank 1: 80 ms - its usual 20 ms
    assert stats["ours_sync"].overhead_pct.median == pytest.approx(25.0)  # 0.5 s against 0.4 s
    assert stats["ours_sync"].per_step_call_ms == pytest.approx(10.0)  # rank 0
    assert stats["none"].overhead_pct is None and stats["none"].stall_ms is None


def test_stall_leaves_out_the_notice_collective_the_save_step_also_ran() -> None:
    # steps 0 (the save) and 2 ran the notice collective (12 ms); 1 and 3 ran nothing (0.1 ms)
    window = {"config": "ours_async", "interval": 4, "index": 0, "save_steps": [0], "train_s": [0.1] * 4,
              "round_steps": [0, 2], "window_s": 0.5, "hook_s": [0.015, 0.0001, 0.012, 0.0001]}
    stats = merged([window], [window])[0]
    assert stats.stall_ms.median == pytest.approx(3.0)  # 15 ms - the other round step's 12 ms
    assert stats.notice_rounds == 1  # step 2; the save step's round is in its stall
    assert stats.plain_call_ms == pytest.approx(0.1)
    assert stats.plain_call_cpu_ms is None  # a run that did not time the call's CPU


def test_the_plain_call_goal_is_judged_in_cpu_time() -> None:
    """Wall time of a 0.1 ms call on a loaded box measures the other processes; its CPU time does not."""
    common = {"interval": 10, "index": 0, "train_s": [0.1] * 10, "window_s": 1.0}
    async_w = dict(common, config="ours_async", save_steps=[0], round_steps=[0, 5], own_stall_s=[0.001],
                   hook_s=[0.002] + [0.0004] * 9, hook_cpu_s=[0.002] + [0.00006] * 4 + [0.001] + [0.00006] * 4)
    none_w = dict(common, config="none", save_steps=[], hook_s=[0.0] * 10, copy_s=[0.001])
    stats = merged([async_w, none_w], [async_w, none_w])
    mine = {s.config: s for s in stats}["ours_async"]
    assert mine.plain_call_ms == pytest.approx(0.4) and mine.plain_call_cpu_ms == pytest.approx(0.06)
    summary = ckpt_overhead.summarize(stats, 3.0, {"state_bytes": 100, "tensors": 3}, (10,))
    assert summary["goal"]["plain_call_met"] is True
    assert "0.060 ms CPU (goal <= 0.1 ms CPU: met)" in ckpt_overhead.goal_text(summary)
    assert "0.400 (0.060)" in ckpt_overhead.table_rows(stats)[1]


def test_async_stall_is_the_slowest_ranks_own_blocked_time() -> None:
    window = {"config": "ours_async", "interval": 4, "index": 0, "save_steps": [0], "train_s": [0.1] * 4,
              "round_steps": [0, 2], "window_s": 0.5,
              "hook_s": [0.040, 0.0001, 0.012, 0.0001]}  # rank 0 also waited for rank 1 at the save step
    stats = merged([dict(window, own_stall_s=[0.004])], [dict(window, own_stall_s=[0.006])])[0]
    assert stats.stall_ms.median == pytest.approx(6.0)  # rank 1's own 6 ms, not the call's 28 ms excess


def test_the_stall_is_compared_with_a_copy_of_the_state_at_the_same_point_of_the_loop() -> None:
    common = {"interval": 10, "index": 0, "train_s": [0.1] * 10, "window_s": 1.0, "hook_s": [0.0] * 10}
    async_w = dict(common, config="ours_async", save_steps=[0], round_steps=[0, 5],
                   hook_s=[0.0] + [0.0005] * 4 + [0.003] + [0.0005] * 4)
    none_w = dict(common, config="none", save_steps=[])
    stats = merged([dict(async_w, own_stall_s=[0.002]), dict(none_w, copy_s=[0.001, 0.0008])],
                   [dict(async_w, own_stall_s=[0.001]), dict(none_w, copy_s=[0.0025, 0.0011])])
    assert {s.config: s for s in stats}["none"].copy_ms.median == pytest.approx(1.8)  # the slower rank's copies
    summary = ckpt_overhead.summarize(stats, 3.0, {"state_bytes": 100, "tensors": 3}, (10,))
    assert summary["memcpy_ms"] == pytest.approx(1.8) and summary["memcpy_samples"] == 2
    assert summary["async_stall_ms"] == pytest.approx(2.0)
    assert summary["async_stall_vs_memcpy"] == pytest.approx(2.0 / 1.8)
    assert summary["goal"]["stall_met"] is True
    # 10 steps of 100 ms: one 2 ms stall + one more notice collective of 3 ms + the 8 other steps' calls of
    # 0.5 ms = 0.9%
    assert summary["async_plain_call_ms"] == pytest.approx(0.5)
    assert summary["async_notice_rounds_per_interval"] == 1
    assert summary["async_blocking_estimate_pct"] == pytest.approx(0.9)
    assert summary["goal"]["blocking_estimate_met"] is True
    text = ckpt_overhead.goal_text(summary)
    assert "1.1x" in text and "0.90%" in text


def test_the_goal_is_left_undecided_when_the_noise_is_as_large_as_the_goal() -> None:
    verdict = ckpt_overhead.goal_verdict
    assert verdict(0.5, 0.2, 1.0) is True and verdict(1.5, 0.2, 1.0) is False
    assert verdict(0.5, 5.0, 1.0) is None and verdict(-7.0, 5.0, 1.0) is None
    assert verdict(8.0, 5.0, 1.0) is False  # above the goal by more than the noise
    assert verdict(None, 0.1, 1.0) is None


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    for args, message in ((["--model", "no_colon"], "module:function"),
                          (["--model", str(tmp_path / "missing.py") + ":build"], "no such file"),
                          (["--np", "7"], "--np at most 6")):
        proc = subprocess.run([sys.executable, "-m", "bench.ckpt_overhead", *args, "--out", str(tmp_path / "o.json")],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o.json").exists()


@pytest.mark.horovod
def test_ckpt_overhead_runs_a_users_model_under_horovodrun(tmp_path: Path) -> None:
    (tmp_path / "user_model.py").write_text(USER_MODEL)
    out, work = tmp_path / "results" / "ckpt_overhead.json", tmp_path / "work"
    _run(["bench.ckpt_overhead", "--model", f"{tmp_path / 'user_model.py'}:build", "--steps", "3", "--intervals", "3",
          "--warmup-steps", "2", "--batch-size", "8", "--out", str(out), "--tmpdir", str(work)], timeout=240)
    doc = json.loads(out.read_text())
    assert doc["name"] == "ckpt_overhead"
    summary = doc["summary"]
    for key in OVERHEAD_KEYS:
        assert key in summary, f"summary.{key} missing"
    assert summary["memcpy_ms"] > 0 and summary["async_stall_ms"] is not None and summary["state_bytes"] > 0
    assert set(summary["steps_per_s"]) == set(ckpt_overhead.CONFIGS)
    assert doc["params"]["model_info"]["loss"].startswith("sparse")  # the model's own compiled loss was kept
    assert {(r["config"], r["interval"]) for r in doc["rows"]} == {(c, 3) for c in ckpt_overhead.CONFIGS}
    for row in doc["rows"]:
        assert row["steps_per_s"]["median"] > 0
        assert (row["stall_ms"] is None) == (row["config"] == "none")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goal check" in out.with_suffix(".md").read_text()
    assert work.is_dir() and not any(work.iterdir()), f"left behind: {list(work.iterdir())}"


# --------------------------------------------------------------------------- emergency-save


@pytest.fixture(scope="module")
def emergency_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    base = tmp_path_factory.mktemp("emergency")
    out, work = base / "results" / "emergency_save.json", base / "work"
    _run(["bench.emergency_save", "--sizes-mb", "1,10", "--writers", "1,2", "--repeats", "1", "--stores", "local,gcs",
          "--out", str(out), "--tmpdir", str(work)], timeout=120)
    return json.loads(out.read_text()), out, work


def test_emergency_save_summary_has_the_keys_per_store(emergency_result: tuple[dict, Path, Path]) -> None:
    doc, _out, _work = emergency_result
    summary = doc["summary"]
    for key in EMERGENCY_KEYS:
        assert key in summary, f"summary.{key} missing"
    assert summary["largest_size"] == "10MB"
    for store in ("local", "gcs"):
        speedup = summary["sharded_speedup_vs_single"][store]
        assert speedup["best"] > 0 and speedup["best_writers"] in (1, 2) and {"1", "2"} <= set(speedup)
        capacity = summary["max_state_mb_in_30s"][store]
        assert capacity["extrapolated"] is True and capacity["mb"] > 0
        assert set(summary["notice_to_commit_s"][store]["1MB"]) == {"1", "2"}
    assert doc["machine"]["cores"] >= 1 and doc["command"].startswith("python -m bench.emergency_save")


def test_emergency_save_measures_every_combination_and_cleans_up(emergency_result: tuple[dict, Path, Path]) -> None:
    doc, out, work = emergency_result
    combos = {(r["store"], r["size"], r["method"], r["writers"]) for r in doc["rows"]}
    for store, single in (("local", "np.savez"), ("gcs", "np.savez + 1 upload")):
        for size in ("1MB", "10MB"):
            assert {(store, size, "ckpt_service save", 1), (store, size, "ckpt_service save", 2),
                    (store, size, single, 1)} <= combos
    for row in doc["rows"]:
        assert row["op"] == "save" and row["seconds"]["n"] == 1 and row["seconds"]["median"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "EXTRAPOLATED" in out.with_suffix(".md").read_text()
    assert work.is_dir() and not any(work.iterdir()), f"left behind: {list(work.iterdir())}"
