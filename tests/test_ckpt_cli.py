"""`hvd-transient ckpt ...` through the installed console script."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import flip_one_byte_of_a_chunk, sample_state

from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore

CLI = str(Path(sys.executable).parent / "hvd-transient")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "ckpt", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    with CheckpointManager(str(root), max_to_keep=None) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, sample_state(step), {"epoch": step // 10})
    return root


def test_ls_and_inspect_json(store_dir: Path) -> None:
    out = run("ls", str(store_dir), "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert [s["step"] for s in listing["steps"]] == [10, 20, 30]
    assert all(s["ok"] and s["writers"] == 1 for s in listing["steps"])
    out = run("inspect", f"file://{store_dir}", "--step", "20", "--json")
    body = json.loads(out.stdout)
    assert body["step"] == 20 and body["metadata"] == {"epoch": 2}
    assert {t["name"] for t in body["tensors"]} == set(sample_state())
    human = run("inspect", str(store_dir))
    assert "step 30" in human.stdout and "dense/kernel:0" in human.stdout


def test_verify_flags_corruption_with_nonzero_exit(store_dir: Path) -> None:
    assert run("verify", str(store_dir)).returncode == 0
    flip_one_byte_of_a_chunk(LocalStore(store_dir), 30)
    out = run("verify", str(store_dir), "--json")
    assert out.returncode == 1
    report = json.loads(out.stdout)
    bad = [s for s in report["steps"] if not s["ok"]]
    assert [s["step"] for s in bad] == [30]
    assert "tensors [" in bad[0]["problems"][0]
    human = run("verify", str(store_dir), "--step", "30")
    assert human.returncode == 1 and "CORRUPT" in human.stdout
    assert run("verify", str(store_dir), "--step", "20").returncode == 0


def test_gc_and_export(store_dir: Path, tmp_path: Path) -> None:
    out = run("gc", str(store_dir), "--keep", "1")
    assert out.returncode == 0 and "10" in out.stdout
    assert json.loads(run("ls", str(store_dir), "--json").stdout)["steps"][0]["step"] == 30
    npz = tmp_path / "s30.npz"
    assert run("export", str(store_dir), "--step", "30", str(npz)).returncode == 0
    with np.load(npz) as data:
        for name, arr in sample_state(30).items():
            np.testing.assert_array_equal(data[name], arr)
        assert json.loads(str(data["__metadata__"])) == {"epoch": 3}


def test_errors_are_clear(tmp_path: Path) -> None:
    out = run("ls", "s3://bucket/x")
    assert out.returncode == 2 and "unsupported store URL scheme" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run("inspect", str(empty))
    assert out.returncode == 2 and "no committed checkpoint" in out.stderr
    out = run("export", str(empty), "--step", "3", str(tmp_path / "x.npz"))
    assert out.returncode == 2 and "not committed" in out.stderr
    out = run("ls", str(tmp_path / "typo"))
    assert out.returncode == 2 and "no store at" in out.stderr and "typo" in out.stderr
    assert not (tmp_path / "typo").exists()
    out = run("inspect", str(empty), "--step", "-1")
    assert out.returncode == 2 and "'-1'" in out.stderr and "Traceback" not in out.stderr


def test_missing_step_and_corrupt_manifest(store_dir: Path) -> None:
    out = run("inspect", str(store_dir), "--step", "25")
    assert out.returncode == 2 and "step 25 is not committed" in out.stderr and "[10, 20, 30]" in out.stderr
    store = LocalStore(store_dir)
    (manifest,) = [k for k in store.list(f"steps/{30:012d}/") if "/manifest." in k]
    store.delete(manifest)
    out = run("inspect", str(store_dir))  # the store is damaged, not the command line: exit 1
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 and "missing" in out.stderr and "Traceback" not in out.stderr
    assert run("inspect", str(store_dir), "--step", "20").returncode == 0
