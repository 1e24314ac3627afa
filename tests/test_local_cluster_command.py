"""The horovodrun command line LocalCluster builds for each kind of job (no processes started)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec


def spec(tmp_path: Path, **kw) -> LocalClusterSpec:
    return LocalClusterSpec(store=str(tmp_path / "store"), hosts=kw.pop("hosts", ("localhost", "127.0.0.1")),
                            command=("python", "train.py"), workdir=tmp_path / "w", **kw)


def test_elastic_job_uses_discovery_and_gloo(tmp_path: Path) -> None:
    cmd = LocalCluster(spec(tmp_path)).horovodrun_command()
    assert "--host-discovery-script" in cmd and "--gloo" in cmd and "-H" not in cmd and "--mpi" not in cmd
    assert cmd[cmd.index("-np") + 1] == "2" and cmd[-2:] == ["python", "train.py"]


def test_static_mpi_job_lists_slots_per_host(tmp_path: Path) -> None:
    cmd = LocalCluster(spec(tmp_path, hosts=("vm",), elastic=False, controller="mpi", slots=2)).horovodrun_command()
    assert cmd[cmd.index("-np") + 1] == "2" and cmd[cmd.index("-H") + 1] == "vm:2"
    assert "--mpi" in cmd and "--gloo" not in cmd and "--host-discovery-script" not in cmd


@pytest.mark.parametrize("kw, match", [
    (dict(controller="mpi"), "elastic mode always uses Gloo"),
    (dict(slots=2), "one Gloo slot per host alias"),
    (dict(elastic=False, controller="nccl"), "controller must be"),
    (dict(elastic=False, slots=0), "slots must be at least 1"),
])
def test_impossible_clusters_are_refused(tmp_path: Path, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalCluster(spec(tmp_path, **kw))
