"""The plugin and the checkpoint service under plain MPI (mpi4py + numpy, no Horovod), with real ``mpirun`` jobs.

examples/mpi_numpy.py runs against a GCE metadata emulator: each rank's VM is an emulated
instance (``--host vm{rank}`` and ``GCE_METADATA_HOST=.../i/{host}``), or, without
``--host``, the ranks of this machine share one VM and its one watcher.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pytest

from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import open_store
from hvd_transient.core.control import request_stop
from hvd_transient.core.membership import read_leaving
from hvd_transient.telemetry.events import read_events
from hvd_transient.testing.metadata_emulator import MetadataEmulator

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI's mpirun"),
]
pytest.importorskip("mpi4py")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "mpi_numpy.py"
CHECK = REPO / "tests" / "mpi_collectives_check.py"
STEPS = 400
PREEMPTED = 75  # the example's exit code after an emergency checkpoint
WAIT = 180  # upper bound for something that should happen soon; never a timing assertion


def mpi_env(emulator: MetadataEmulator | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        "OMPI_MCA_rmaps_base_oversubscribe": "1",   # more ranks than cores
        "OMPI_MCA_mpi_yield_when_idle": "1",        # ... so a waiting rank gives its core away
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "NO_GCE_CHECK": "true",
        "HVDT_WATCHER": "gce",
    })
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    if emulator is not None:  # each rank substitutes its own host name: one emulated VM per host
        env["GCE_METADATA_HOST"] = f"127.0.0.1:{emulator.port}/i/{{host}}"
    else:  # no notices: a local watcher with no notice file
        env.pop("GCE_METADATA_HOST", None)
        env["HVDT_WATCHER"] = "local"
    return env


def mpirun(n: int, *args: str | Path) -> list[str]:
    return ["mpirun", "-np", str(n), "--bind-to", "none", sys.executable, *map(str, args)]


def train(n: int, store: Path, *extra: str) -> list[str]:
    return mpirun(n, EXAMPLE, "--store", store, "--steps", str(STEPS), "--save-every", "50", *extra)


class Job:
    """An ``mpirun`` job in the background, its output in a file."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)

    def wait_until(self, what: str, predicate: Callable[[], bool]) -> None:
        """Poll another process's progress (nothing here can notify across processes)."""
        limit = time.monotonic() + WAIT
        while not predicate():
            assert self.proc.poll() is None, f"the job ended before {what}:\n{self.tail()}"
            assert time.monotonic() < limit, f"no {what} within {WAIT} s:\n{self.tail()}"
            time.sleep(0.05)

    def wait(self) -> int:
        try:
            return self.proc.wait(WAIT)
        finally:
            self._out.close()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # the job's own process group, started above
            self.proc.wait()
        self._out.close()


def run(cmd: Sequence[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WAIT, cwd=REPO)


def latest(store: Path) -> int:
    return CheckpointManager(str(store)).latest_step() or 0


def events(store: Path, event: str, since: float = 0.0, /, **match: Any) -> list[dict[str, Any]]:
    """Logged events of one kind, from ``since`` on, whose fields equal ``match``."""
    return [e for e in read_events(open_store(str(store)))
            if e["event"] == event and e["t"] >= since and all(e.get(k) == v for k, v in match.items())]


def preempt_after(job: Job, store: Path, after_step: int, emulator: MetadataEmulator, vm: str) -> None:
    """Let the job commit ``after_step`` (a periodic checkpoint), then give ``vm`` its notice."""
    job.wait_until(f"a checkpoint of step {after_step}", lambda: latest(store) >= after_step)
    emulator.preempt(vm, window=60)


def test_mpi_collectives_under_mpirun(tmp_path: Path) -> None:
    """allreduce/allgather/broadcast as JSON, the MPI shard-record gather (deadline, late records,
    background thread), one watcher per VM, and TransientImpl's emergency save, on 3 ranks."""
    done = run(mpirun(3, "-m", "mpi4py", CHECK, tmp_path), mpi_env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "mpi collectives: 3 ranks ok" in done.stdout


def test_notice_checkpoints_then_relaunches_resume_with_any_rank_count(tmp_path: Path) -> None:
    """A notice to one rank's VM: the emergency checkpoint commits at the agreed step and the job stops
    (exit 75); relaunched on 2 ranks it resumes from it; after a notice to the master's VM, relaunched on
    3 ranks it resumes again and ends at exactly ``STEPS``, with the weights of an uninterrupted run."""
    store, reference = tmp_path / "store", tmp_path / "reference"
    with MetadataEmulator(instances=["vm0", "vm1", "vm2"]) as emulator:
        env = mpi_env(emulator)
        slow = ("--host", "vm{rank}", "--step-seconds", "0.02")

        # 1. two ranks; rank 1's VM gets a notice
        first = Job(train(2, store, *slow), env, tmp_path / "first.log")
        try:
            preempt_after(first, store, 50, emulator, "vm1")
            assert first.wait() == PREEMPTED, first.tail()
        finally:
            first.stop()
        [agreed] = _agreed(store, 0.0)
        step1 = agreed["step"]
        assert agreed["leaving"] == ["vm1"] and 50 <= step1 < STEPS
        commit = emergency_commit(store, 0.0, first)
        assert commit["step"] == step1 and commit["host"] == "vm0"   # the master (rank 0) committed
        manager = CheckpointManager(str(store))
        assert manager.latest_step() == step1 and manager.manifest(step1).world_size == 2
        assert [r.host for r in read_leaving(open_store(str(store)))] == ["vm1"]
        assert f"stopped at step {step1} (resumed from 0) on 2 processes: preempted" in first.tail()

        # 2. relaunched on two ranks (vm1 replaced): resumes from it; then the master's VM gets a notice
        emulator.reset("vm1")
        t2 = time.time()
        second = Job(train(2, store, *slow), env, tmp_path / "second.log")
        try:
            preempt_after(second, store, step1 + 50, emulator, "vm0")
            assert second.wait() == PREEMPTED, second.tail()
        finally:
            second.stop()
        assert {e["restored_step"] for e in events(store, "start", t2)} == {step1}
        assert len(events(store, "start", t2)) == 2
        [agreed] = _agreed(store, t2)
        step2 = agreed["step"]
        assert agreed["leaving"] == ["vm0"] and step1 + 50 <= step2 < STEPS
        elections = events(store, "election", t2)  # every rank logs it
        assert {(e["step"], e["old_master"], e["new_master"]) for e in elections} == {(step2, 0, 1)}
        commit = emergency_commit(store, t2, second)
        assert commit["step"] == step2 and commit["host"] == "vm1"   # the new master
        assert CheckpointManager(str(store)).latest_step() == step2
        assert f"stopped at step {step2} (resumed from {step1}) on 2 processes: preempted" in second.tail()

        # 3. relaunched on three ranks (vm0 replaced): resumes, resharded, and finishes
        emulator.reset("vm0")
        t3 = time.time()
        third = run(train(3, store, "--host", "vm{rank}"), env)
        assert third.returncode == 0, third.stdout[-4000:] + third.stderr[-4000:]
        assert f"stopped at step {STEPS} (resumed from {step2}) on 3 processes: done" in third.stdout
        assert {e["restored_step"] for e in events(store, "start", t3)} == {step2}
        assert len(events(store, "start", t3)) == 3

        reference_run = run(train(1, reference, "--host", "vm0"), env)
        assert reference_run.returncode == 0, reference_run.stdout[-4000:] + reference_run.stderr[-4000:]

    final, expected = CheckpointManager(str(store)).restore(), CheckpointManager(str(reference)).restore()
    assert final.step == expected.step == STEPS and final.manifest.world_size == 3
    assert max(CheckpointManager(str(store)).all_steps()) == STEPS
    for name in ("w", "velocity"):
        np.testing.assert_allclose(final.tensors[name], expected.tensors[name], rtol=0, atol=1e-12)
    print(f"\nagreed steps {step1} (2 ranks) and {step2} (2 ranks); restored {step1}, {step2}; "
          f"final step {final.step} on 3 ranks")


def _agreed(store: Path, since: float) -> list[dict[str, Any]]:
    """The notice agreement, once per job (every rank logs it; they must agree)."""
    agreed = events(store, "notice_agreed", since)
    assert agreed and len({(e["step"], tuple(e["leaving"])) for e in agreed}) == 1, agreed
    return [agreed[0]]


def emergency_commit(store: Path, since: float, job: Job) -> dict[str, Any]:
    """The one emergency commit of a job (logged by its master)."""
    commits = events(store, "commit", since, kind="emergency")
    assert len(commits) == 1, (commits, events(store, "save_failed", since), job.tail())
    return commits[0]


def test_ranks_on_one_vm_share_its_watcher_and_leave_together(tmp_path: Path) -> None:
    """Without --host, both ranks are one VM: only its lowest rank watches, and its notice makes
    both ranks leave after the emergency checkpoint."""
    store, host = tmp_path / "store", socket.gethostname()
    with MetadataEmulator(instances=[host]) as emulator:
        job = Job(train(2, store, "--step-seconds", "0.02"), mpi_env(emulator), tmp_path / "job.log")
        try:
            preempt_after(job, store, 50, emulator, host)
            assert job.wait() == PREEMPTED, job.tail()
        finally:
            job.stop()
    [agreed] = _agreed(store, 0.0)
    assert agreed["leaving"] == [host, host]
    assert len({e["pid"] for e in events(store, "notice")}) == 1          # one watcher saw it
    assert len({e["pid"] for e in events(store, "leave_published")}) == 2  # both ranks left
    commit = emergency_commit(store, 0.0, job)
    assert commit["step"] == agreed["step"] == CheckpointManager(str(store)).latest_step()


def test_stop_request_ends_the_job_with_a_final_checkpoint(tmp_path: Path) -> None:
    store = tmp_path / "store"
    job = Job(train(2, store, "--step-seconds", "0.02"), mpi_env(), tmp_path / "job.log")
    try:
        job.wait_until("a checkpoint of step 50", lambda: latest(store) >= 50)
        request_stop(open_store(str(store)))
        assert job.wait() == 0, job.tail()
    finally:
        job.stop()
    [stopped] = {e["step"] for e in events(store, "stop_requested")}
    assert 50 <= stopped < STEPS and CheckpointManager(str(store)).latest_step() == stopped
    assert f"stopped at step {stopped} (resumed from 0) on 2 processes: stop requested" in job.tail()
