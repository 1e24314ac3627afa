"""The PyTorch state as named tensors and JSON: a round trip through a sharded checkpoint written by
several ranks and read back by one, model, optimizer and scheduler alike."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ckpt_service.manager import CheckpointManager

torch = pytest.importorskip("torch")


def make(seed: int) -> tuple[object, object, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(model: object, optimizer: object, scheduler: object, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        scheduler.step()


def test_a_checkpoint_written_by_three_ranks_restores_model_optimizer_and_scheduler_into_one(
        tmp_path: Path) -> None:
    from ckpt_service.plan import TensorSpecs
    from hvd_transient.frontend.share import NamedShare
    from hvd_transient.torch.state import full_crc
    from hvd_transient.torch.tensors import META_KEY, json_part, load_state, specs_of, state_tensors, to_host

    model, optimizer, scheduler = make(0)
    train(model, optimizer, scheduler, 5)
    tensors = state_tensors(model, optimizer)
    assert any(name.startswith("optimizer/") for name in tensors)  # Adam's moments and its step counters
    specs = TensorSpecs(specs_of(tensors))
    share = NamedShare(specs, lambda name: to_host(tensors[name]))
    meta = {META_KEY: json_part(model, optimizer, scheduler)}
    with CheckpointManager(str(tmp_path)) as mgr:
        plan = mgr.plan(specs, 3)
        pieces = [share(plan, rank) for rank in range(3)]
    assert sum(a.nbytes for p in pieces for a in p) == sum(s.nbytes for s in specs.values())
    # the ranks' shares, written by one process through the store gather
    with CheckpointManager(str(tmp_path)) as mgr:
        errors: list[BaseException] = []

        def write(rank: int) -> None:
            try:
                mgr.save(7, specs, meta, rank=rank, world_size=3, snapshot=share, attempt="a1")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(r,)) for r in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        ckpt = mgr.restore()
    fresh, fresh_opt, fresh_sched = make(1)
    load_state(fresh, fresh_opt, fresh_sched, ckpt.tensors, ckpt.metadata[META_KEY])
    assert full_crc(fresh, fresh_opt) == full_crc(model, optimizer)
    assert fresh_sched.state_dict() == scheduler.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    # both go on alike
    torch.manual_seed(5)
    train(model, optimizer, scheduler, 2)
    torch.manual_seed(5)
    train(fresh, fresh_opt, fresh_sched, 2)
    assert full_crc(fresh, fresh_opt) == full_crc(model, optimizer)


def test_a_tensor_numpy_cannot_hold_is_refused_clearly() -> None:
    from hvd_transient.torch.tensors import numpy_dtype

    assert numpy_dtype(torch.float32) == "float32"
    with pytest.raises(TypeError, match="bfloat16"):
        numpy_dtype(torch.bfloat16)
