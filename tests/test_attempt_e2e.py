"""End to end: the checkpoint master is killed in the middle of a periodic save, the ring rolls back
and saves that step again; the step commits one attempt's state, never a mix.

Real ``horovodrun`` over local host aliases, writing through a slow link to fake-gcs-server, so a
periodic save is still being committed when its master is killed with SIGKILL; the other ranks'
shard records of that attempt stay in the store. Horovod rolls the survivors back to their last
in-memory commit, before the saved step, and the ring of two saves the step again (another ring
size: another state). Every rank prints a checksum of its replicated state at every periodic save
step; every committed step must restore to one of the states printed for it. After the rollback the
input stream restarts at the offset committed with the weights, and the survivors end on one state.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from test_elastic_e2e import expected_samples

from ckpt_service import layout
from ckpt_service.manager import CheckpointManager
from hvd_transient.core.checksums import state_crc
from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec, of

pytestmark = pytest.mark.horovod

REPO = Path(__file__).resolve().parent.parent
ELASTIC = str(REPO / "examples" / "keras_elastic.py")
SAVE_EVERY = 30
# Horovod's in-memory commits at 29, 58...: a kill after the save of step 30 rolls back to 29, so
# the ring replays step 30 and saves it again.
BATCHES_PER_COMMIT = 29
PRINTED = re.compile(r"saved-state step (\d+) size (\d+) rank (\d+) crc (\d+)")


def replicated_crc(tensors: dict) -> int:
    """What ``hvd_transient.keras.weights_crc`` computes on the live model, from restored tensors: batch-norm
    moving statistics (the model's only non-trainable weights) are per rank, so they are left out."""
    return state_crc({name: t for name, t in tensors.items() if "/moving_" not in name})


def test_a_step_saved_again_after_its_master_was_killed_commits_one_attempt(tmp_path: Path,
                                                                            gcs_emulator_session) -> None:
    store = f"gs://{gcs_emulator_session.new_bucket('attempts')}/run"
    hosts = ("localhost", "127.0.0.1", "127.0.1")
    cmd = (sys.executable, ELASTIC, "--store", store, "--model", "small_cnn", "--epochs", "1000",
           "--steps-per-epoch", "40", "--save-every", str(SAVE_EVERY), "--base-lr", "0.01",
           "--batches-per-commit", str(BATCHES_PER_COMMIT), "--step-seconds", "0.2", "--print-saved-crc")
    proxy = FaultProxy(gcs_emulator_session.url)
    proxy.slow_down(1.0)  # every upload: the save's pieces, records, manifest, fence and marker take seconds
    c = LocalCluster(LocalClusterSpec(store=store, hosts=hosts, command=cmd, workdir=tmp_path / "run",
                                      gloo_timeout_s=5, extra_env=(("STORAGE_EMULATOR_HOST", proxy.url),)))
    with c, proxy:
        ring = c.wait_for(lambda ev: of(ev, "ring", size=3, rank=0), 240, "the ring of 3")[0]
        master = ring["master_host"]
        save = c.wait_for(lambda ev: of(ev, "async_save", host=master, step=SAVE_EVERY), 240,
                          f"the master's periodic save of step {SAVE_EVERY}")[0]
        c.kill(master)  # before its commit: its start event took one upload, the commit takes four more
        c.wait_for(lambda ev: of(ev, "commit", step=SAVE_EVERY), 180,
                   f"step {SAVE_EVERY} to be saved again and committed")
        c.request_stop()
        assert c.wait(180) == 0, c.log_tail()
        events = c.events()
        output = c.log_path.read_text(errors="replace")

    printed: dict[int, dict[int, set[int]]] = {}  # step -> ring size -> the states printed
    for step, size, _rank, crc in (tuple(map(int, m)) for m in PRINTED.findall(output)):
        printed.setdefault(step, {}).setdefault(size, set()).add(crc)
    # each attempt's ranks agree on the state; the two rings' states of the step differ
    assert {size: len(crcs) for size, crcs in printed[SAVE_EVERY].items()} == {3: 1, 2: 1}, printed[SAVE_EVERY]
    assert printed[SAVE_EVERY][3] != printed[SAVE_EVERY][2]

    [commit] = [e for e in of(events, "commit", step=SAVE_EVERY)]
    assert commit["host"] != master and commit["size"] == 2 and commit["t"] > save["t"]
    assert of(events, "reset"), "Horovod's rollback must have run"
    assert not of(events, "leave_published"), "a kill gives no notice: nobody published leaving"
    # after the rollback the input stream restarts at the offset committed with the weights
    survivor = next(h for h in hosts if h != master)
    rings = of(events, "ring", host=survivor)
    assert [r["size"] for r in rings] == [3, 2]
    after = [e for e in of(events, "progress", host=survivor) + of(events, "first_step", host=survivor)
             if e["t"] > rings[1]["t"]]
    assert after and all(e["samples"] == expected_samples(rings, e["step"], 32) for e in after), after
    final = of(events, "weights")
    assert {e["host"] for e in final} == set(hosts) - {master} and len({e["crc"] for e in final}) == 1
    with CheckpointManager(store, max_to_keep=None) as mgr:
        attempts = {k.split("/")[3] for k in mgr.store.list(layout.step_prefix(SAVE_EVERY) + "records/")}
        assert len(attempts) == 2, attempts  # the killed attempt's records are still there
        steps = mgr.all_steps()
        assert SAVE_EVERY in steps
        for step in steps:
            assert mgr.verify(step).ok, step
            if step % SAVE_EVERY:
                continue  # the final save at the stop: no state printed for it
            crc = replicated_crc(mgr.restore(step).tensors)
            states = set().union(*printed[step].values())
            assert crc in states, f"step {step} restores to a state no attempt had: {crc} not in {printed[step]}"
        assert replicated_crc(mgr.restore(SAVE_EVERY).tensors) in printed[SAVE_EVERY][2]
