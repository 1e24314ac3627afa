"""`bench scale` on rings of 2 and 4 (local store, short): a row per size with every figure, and sane ones;
discovery timed at those sizes and one more, without a ring."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("step_ms", "step_ms_p99", "step_cpu_ms", "step_cpu_ms_p99", "round_ms", "round_cpu_ms",
           "notice_to_agreed_ms", "agreed_to_committed_ms", "notice_to_committed_ms", "departure_stall_ms",
           "join_stall_ms", "notice_requests", "commit_requests", "commit_writes")


@pytest.mark.horovod
def test_scale_bench_on_rings_of_2_and_4(tmp_path: Path) -> None:
    out = tmp_path / "results" / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--sizes", "2,4", "--stores", "local", "--warmup-steps", "12",
         "--after-join-steps", "3", "--discovery-calls", "2", "--discovery-sizes", "32", "--out", str(out),
         "--tmpdir", str(tmp_path / "work")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(out.read_text())
    rows = {r["n"]: r for r in doc["rows"] if not r.get("discovery_only")}
    discovery = {r["n"]: r for r in doc["rows"] if r.get("discovery_only")}
    assert sorted(rows) == [2, 4] and all(r["store"] == "local" for r in rows.values())
    assert sorted(discovery) == [2, 4, 32]
    for n, r in discovery.items():  # the process costs its start at least; its search grows with the records
        assert r["discovery_cpu_ms"] > r["discovery_search_cpu_ms"] > 0, f"N={n}: {r}"
    for n, r in rows.items():
        missing = [k for k in FIGURES if r.get(k) is None]
        assert not missing, f"N={n}: no {missing}"
        assert 0 < r["step_cpu_ms"] <= r["step_cpu_ms_p99"] and 0 < r["step_ms"] <= r["step_ms_p99"] < 1000
        assert r["plain_steps"] > r["rounds"] > 0 and r["round_ms"] > 0
        assert 0 < r["notice_to_agreed_ms"] < r["notice_to_committed_ms"] < 30_000  # inside the notice window
        assert 0 < r["departure_stall_ms"] < 30_000 and 0 < r["join_stall_ms"] < 60_000
        # every commit writes its data, manifest, lease and marker; the notice's requests include the commit's
        assert r["notice_requests"] >= r["commit_requests"] >= r["commit_writes"] >= 4
        assert all(v is not None and v >= 0 for k in ("departure_phases_ms", "join_phases_ms") for v in r[k].values())
    model = doc["summary"]["model"]
    assert [p["n"] for p in model["predictions"]] == [64, 256, 1024]
    assert set(model["first_limits"]) == {"bucket write rate", "commit window", "discovery", "notice allreduce"}
    assert doc["machine"]["cores"] and len(doc["summary"]["load_during"]) == 2
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
