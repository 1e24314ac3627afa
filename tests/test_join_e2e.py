"""End to end: a VM joins a running job through the standby worker it booted (real horovodrun).

The local cluster runs the job's command through ``python -m hvd_transient.worker`` and starts a
standby on the new VM; discovery lists the VM once the standby is ready, and the worker Horovod
then starts on it only hands the job over. The survivors' stall is what the run's own analysis
reports (:class:`hvd_transient.report.run_analysis.Join`).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ckpt_service.stores import LocalStore
from hvd_transient.discovery.ready import read_ready
from hvd_transient.report.analysis import analyze
from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec, of

pytestmark = pytest.mark.horovod

REPO = Path(__file__).resolve().parent.parent
ELASTIC = str(REPO / "examples" / "keras_elastic.py")
NEW = "127.0.1"
#: What a join may stall the survivors for with a standby (their last step before the reset -> their
#: first step on the bigger ring). Without one, the newcomer's cold start (interpreter, TensorFlow,
#: model build, the first step's trace) stalls them 7-11 s on 2 cores (bench/preemption_cost.py's
#: join scenario, in make test's runs); with one, 0.6-1.2 s on an idle machine and 1.1-1.8 s with
#: another end-to-end run beside it, as make test runs it. The bound leaves room for that load.
STALL_BOUND_S = 4.0


def test_a_host_joins_through_its_standby_quickly_and_the_run_ends_at_the_nominal_step(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    epochs, per_epoch = 9, 40  # long enough for the standby to warm up while two workers train (~5 s here)
    hosts = ("localhost", "127.0.0.1")
    cmd = (sys.executable, ELASTIC, "--store", store, "--model", "small_cnn", "--epochs", str(epochs),
           "--steps-per-epoch", str(per_epoch), "--save-every", "100", "--base-lr", "0.01",
           "--batches-per-commit", "5", "--step-seconds", "0.05")
    spec = LocalClusterSpec(store=store, hosts=hosts, command=cmd, workdir=tmp_path / "run",
                            instances=(*hosts, NEW), standby=True)
    with LocalCluster(spec) as c:
        c.wait_for_step(10, 180, size=2)
        added = time.time()
        c.add_host(NEW)
        c.wait_for(lambda ev: of(ev, "ring", size=3, host=NEW), 300, f"{NEW} to join")
        assert c.wait(600) == 0, c.log_tail()
        events = c.events()
        standby_log = c.standby_log_path(NEW).read_text(errors="replace")
        tail = c.log_tail(200)

    [ready] = [r for r in read_ready(LocalStore(store)) if r.host == NEW]
    [join] = [j for j in analyze(events).joins if j.host == NEW]
    # listed only once its standby was ready, and the worker that joined is the standby's
    assert added < ready.ready_at < join.t
    assert join.pid == ready.pid
    assert "took the job of launcher" in standby_log
    assert "warm-up (rehearsed)" in standby_log
    print(f"join stall {join.stall_s:.2f}s; standby ready {ready.ready_at - added:.1f}s after the VM appeared")
    # the survivors barely noticed, and lost no step
    assert join.stall_s is not None and join.stall_s < STALL_BOUND_S, f"join stall {join.stall_s:.2f}s"
    assert join.steps_rolled_back == 0
    # exactly the nominal number of steps, on every worker, with identical weights
    final = of(events, "weights")
    assert {e["step"] for e in final} == {epochs * per_epoch}
    assert {e["host"] for e in final} == {*hosts, NEW} and len({e["crc"] for e in final}) == 1
    assert f"done at step {epochs * per_epoch} on 3 workers" in tail
