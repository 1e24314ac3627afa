"""The session both frontends drive the protocol through (hvd_transient.frontend.session), on in-process
ranks with a numpy trainee: the metadata places the run (step, epoch, batch, samples, learning rate, the
framework's own part), a notice's emergency checkpoint holds every rank's share, the learning rate follows
the ring, and the end takes a final checkpoint that restores bit-exact."""
from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup

from ckpt_service.manager import CheckpointManager
from ckpt_service.plan import TensorSpecs
from hvd_transient.core.transient import TransientConfig, TransientImpl
from hvd_transient.frontend.position import DataPosition
from hvd_transient.frontend.session import Session
from hvd_transient.frontend.share import NamedShare
from hvd_transient.watchers.base import Notice

HOSTS = ("h0", "h1")
BATCH, PER_EPOCH = 4, 10


class NumpyTrainee:
    def __init__(self) -> None:
        self.tensors = {"w": np.arange(5000, dtype=np.float32), "opt/m": np.zeros(300, dtype=np.float64)}
        self.lr: float | None = None

    def train(self) -> None:
        self.tensors["w"] += 1
        self.tensors["opt/m"] += 0.5

    def specs(self) -> TensorSpecs:
        return TensorSpecs(self.tensors)

    def share(self, plan: Any, rank: int) -> list[np.ndarray]:
        return NamedShare(self.specs(), lambda name: self.tensors[name])(plan, rank)

    def metadata(self) -> dict[str, Any]:
        return {"framework": {"groups": [{"momentum": 0.9}]}}

    def learning_rate(self) -> float | None:
        return self.lr

    def set_learning_rate(self, lr: float, size: int) -> bool:
        self.lr = lr
        return True

    def crcs(self) -> tuple[int, int]:
        return 1, 2


def test_a_notice_checkpoint_and_the_final_one_place_the_run_and_restore_exactly() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    group = ThreadGroup(2)
    config = TransientConfig(store=url, save_every_steps=None, check_every_steps=1, leave_margin_s=1.0,
                             base_lr=0.1, leave="at_notice")
    watchers = [FakeWatcher(), FakeWatcher()]
    trainees = [NumpyTrainee(), NumpyTrainee()]
    sessions = [Session(config, lambda r=r: FakeCollectives(group, r), trainees[r], DataPosition(),
                        counters=lambda: {"epoch_offset": 0},
                        make_impl=lambda c, comm, r=r: TransientImpl(c, comm, host=HOSTS[r], watcher=watchers[r]))
                for r in range(2)]

    def begin(r: int) -> None:
        sessions[r].position.track(2 * BATCH)
        sessions[r].begin(12, 96)
        sessions[r].resumed(12, PER_EPOCH)

    group.run(begin)
    assert [t.lr for t in trainees] == [0.2, 0.2]  # linear in the ring's size

    def step(r: int, at: int) -> Any:
        trainees[r].train()
        return sessions[r].after_step(at)

    group.run(lambda r: step(r, 13))
    now = time.time()
    watchers[1].notice = Notice("test", "vm", now, now + 30, "preempted")
    outcomes = group.run(lambda r: step(r, 14))
    assert {o.emergency_step for o in outcomes} == {14} and all(o.committed for o in outcomes)
    with CheckpointManager(url) as mgr:
        ckpt = mgr.restore(step=14)
    assert ckpt.manifest.world_size == 2
    assert ckpt.metadata["samples"] == 96 + 2 * 2 * BATCH
    assert (ckpt.metadata["epoch"], ckpt.metadata["batch"], ckpt.metadata["steps_per_epoch"]) == (1, 4, PER_EPOCH)
    assert ckpt.metadata["lr"] == 0.2 and ckpt.metadata["epoch_offset"] == 0
    assert ckpt.metadata["framework"] == {"groups": [{"momentum": 0.9}]}
    np.testing.assert_array_equal(ckpt.tensors["w"], trainees[0].tensors["w"])

    group.run(lambda r: step(r, 15))
    group.run(lambda r: sessions[r].end(15))
    with CheckpointManager(url) as mgr:
        final = mgr.restore()
    assert final.step == 15 and final.metadata["samples"] == 96 + 3 * 2 * BATCH
    for name, array in trainees[0].tensors.items():
        np.testing.assert_array_equal(final.tensors[name], array)
    events = [e["event"] for e in sessions[0].impl.events.events]
    assert {"start", "ring", "lr", "resume_at", "commit", "weights"} <= set(events)
    for s in sessions:
        s.close()
