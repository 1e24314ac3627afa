"""The checkpoint I/O benchmark runs end to end at a tiny size, and `hvd-transient bench` finds it.

No timing is asserted: only that the benchmark measures what it says (every combination
present, positive numbers, summary figures that are the quotients of the rows they name), writes
a valid JSON and its tables, and cleans up after itself.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_transient import cli
from hvd_transient.cli import bench as bench_cli

REPO_ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = ("save_mb_per_s", "restore_mb_per_s", "async_stall_ms", "memcpy_ms", "stall_vs_memcpy",
                "speedup_vs_savez")


@pytest.fixture(scope="module")
def ckpt_io_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    base = tmp_path_factory.mktemp("ckpt-io")
    out, work = base / "results" / "ckpt_io.json", base / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ckpt_io", "--sizes-mb", "0.5", "--writers", "1,2", "--readers", "1,2",
         "--stores", "local,gcs", "--baselines", "savez", "--repeats", "1", "--out", str(out),
         "--tmpdir", str(work)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text()), out, work


def test_results_have_the_summary_keys_and_the_machine(ckpt_io_result: tuple[dict, Path, Path]) -> None:
    doc, _out, _work = ckpt_io_result
    assert doc["name"] == "ckpt_io"
    for key in SUMMARY_KEYS:
        assert doc["summary"][key], f"summary.{key} is empty"
    machine = doc["machine"]
    for key in ("cpu_model", "cores", "memory_gib", "python", "numpy", "tensorflow", "date"):
        assert key in machine
    assert machine["cores"] >= 1
    assert doc["command"].startswith("python -m bench.ckpt_io --sizes-mb 0.5")


def test_every_store_writer_and_reader_combination_was_measured(ckpt_io_result: tuple[dict, Path, Path]) -> None:
    summary = ckpt_io_result[0]["summary"]
    for store in ("local", "gcs"):
        saves = summary["save_mb_per_s"][store]["0.5MB"]
        assert {"1", "2"} <= set(saves) and saves["best_writers"] in (1, 2)
        assert all(saves[w] > 0 for w in ("1", "2"))
        assert set(summary["restore_mb_per_s"][store]["0.5MB"]) == {"1->1", "1->2", "2->1", "2->2"}
        assert summary["speedup_vs_savez"][store]["0.5MB"] > 0
    assert set(summary["async_stall_ms"]["0.5MB"]) == {"1", "2"}
    assert summary["memcpy_ms"]["0.5MB"] > 0
    assert summary["stall_vs_memcpy"]["0.5MB"]["1"] > 0


def test_rows_carry_median_and_spread(ckpt_io_result: tuple[dict, Path, Path]) -> None:
    rows = ckpt_io_result[0]["rows"]
    methods = {(r["store"], r["op"], r["method"]) for r in rows}
    assert ("local", "save", "np.savez") in methods
    assert ("gcs", "save", "np.savez + 1 upload") in methods
    assert ("mem", "memcpy", "np.copy of every array") in methods
    for row in rows:
        s = row["seconds"]
        assert s["n"] == 1 and s["min"] <= s["median"] <= s["max"] and s["median"] > 0


def test_summary_figures_are_the_rows_they_come_from(ckpt_io_result: tuple[dict, Path, Path]) -> None:
    """What a broken summary would violate: every rate is the state's bytes over its row's median time,
    every ratio the quotient of the rows it names."""
    doc = ckpt_io_result[0]
    rows, summary = doc["rows"], doc["summary"]
    mb = summary["state_bytes"]["0.5MB"] / 1e6

    def median(**match: object) -> float:
        (row,) = [r for r in rows if r["size"] == "0.5MB" and all(r[k] == v for k, v in match.items())]
        return float(row["seconds"]["median"])

    for store in ("local", "gcs"):
        saves = summary["save_mb_per_s"][store]["0.5MB"]
        for w in (1, 2):
            seconds = median(store=store, op="save", method="ckpt_service save", writers=w)
            assert saves[str(w)] == pytest.approx(mb / seconds, rel=1e-6)
        best = min(median(store=store, op="save", method="ckpt_service save", writers=w) for w in (1, 2))
        assert saves["best"] == pytest.approx(mb / best, rel=1e-6)
        savez = "np.savez" if store == "local" else "np.savez + 1 upload"
        assert summary["speedup_vs_savez"][store]["0.5MB"] == pytest.approx(
            median(store=store, op="save", method=savez) / best, rel=1e-6)
    memcpy_ms = summary["memcpy_ms"]["0.5MB"]
    assert memcpy_ms == pytest.approx(median(store="mem", op="memcpy") * 1000, rel=1e-6)
    for w, stall_ms in summary["async_stall_ms"]["0.5MB"].items():
        assert summary["stall_vs_memcpy"]["0.5MB"][w] == pytest.approx(stall_ms / memcpy_ms, rel=1e-6)


def test_tables_written_and_temporary_data_removed(ckpt_io_result: tuple[dict, Path, Path]) -> None:
    _doc, out, work = ckpt_io_result
    tables = out.with_suffix(".md").read_text()
    assert "**Save**" in tables and "**Restore**" in tables and "**Async stall**" in tables
    assert not any(out.parent.glob("*.tmp"))
    assert work.is_dir() and not any(work.iterdir()), f"left behind: {list(work.iterdir())}"


def test_bench_list_names_ckpt_io(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "list"]) == 0
    assert "ckpt-io" in capsys.readouterr().out.split()


def test_names_map_to_modules_and_bad_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.find_module("ckpt-io") == "bench.ckpt_io"
    assert "overhead-worker" not in bench_cli.available() and "common" not in bench_cli.available()
    for missing in ("no-such-bench", "common", "overhead-worker"):
        assert bench_cli.main([missing]) == 2
        assert "available: ckpt-io" in capsys.readouterr().err
    assert bench_cli.main(["../tests/conftest"]) == 2
    assert "not a benchmark name" in capsys.readouterr().err


def test_missing_bench_directory_says_to_use_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(bench_cli.BenchNotFoundError, match="source checkout"):
        bench_cli.find_module("ckpt-io", tmp_path / "site-packages")


def test_arguments_and_exit_code_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.main(["ckpt-io", "--repeats", "0"]) == 2  # the benchmark's own refusal
    assert bench_cli.main(["all", "--repeats", "1"]) == 2
    assert "takes no arguments" in capsys.readouterr().err


def test_commit_scaling_counts_requests_and_fits_latency(tmp_path: Path) -> None:
    out = tmp_path / "results" / "commit_scaling.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.commit_scaling", "--writers", "2,3,4", "--repeats", "1", "--rtt-ms", "0",
         "--read-threads", "4", "--no-plot", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(out.read_text())
    summary = doc["summary"]["rtt 0 ms, 4 read threads"]
    assert set(summary["requests"]) == {"2", "3", "4"}
    for n in (2, 3, 4):
        row = next(r for r in doc["rows"] if r["writers"] == n)
        assert row["record_objects"] == n and row["lease_writes"] == 1 and row["commit_latency_s"] > 0
        assert row["coordinator_record_reads"] == n - 1  # its own record is not read back
        assert row["requests_by_kind"]["marker"] >= 1 and row["requests_by_kind"]["manifest"] >= 1
    assert summary["fit_commit_latency"]["better"] in ("linear", "log2")
    assert "**Commit protocol cost" in out.with_suffix(".md").read_text()
    assert "commit-scaling" in bench_cli.available()
