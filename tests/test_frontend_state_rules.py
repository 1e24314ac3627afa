"""What the frontends' states promise, attacked: with PyTorch, exact non-tensor state (schedulers,
hyperparameters), a clear error for a checkpoint that does not fit and the learning rate scaled with every
scheduler; with PyTorch and Keras, the counters and the model that a rollback gives back belonging to one
step."""
from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from ckpt_service.errors import StructureMismatchError
from ckpt_service.manager import CheckpointManager
from hvd_transient.frontend.json_values import TAG, UnsupportedValueError, decode, encode
from hvd_transient.testing.horovodrun_main import HOROVODRUN

torch = pytest.importorskip("torch")
L = torch.optim.lr_scheduler
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- exact JSON values

@pytest.mark.parametrize("value", [
    Counter({2: 1, 4: 1}),  # MultiStepLR's milestones
    {"best": math.inf, "mode_worse": -math.inf, "nan": math.nan},  # ReduceLROnPlateau
    {"betas": (0.9, 0.999), "nested": [(1, (2, 3)), {"a": None}]},  # Adam's hyperparameters
    {1: "a", (2, 3): [True, False], "s": 1.5},  # keys that are not strings
    {TAG: "a plain key that looks like the tag", "x": 1},
])
def test_values_round_trip_exactly_through_json(value: Any) -> None:
    back = decode(json.loads(json.dumps(encode(value), allow_nan=False)))
    assert type(back) is type(value)
    assert repr(back) == repr(value)  # the types of the keys and of the items too (nan != nan)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types throughout (dicts in any order; nan equals nan; tensors alike)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return set(a) == set(b) and all(type(k) is type(next(j for j in b if j == k)) and same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def test_a_value_that_would_need_pickling_is_refused_with_its_path() -> None:
    with pytest.raises(UnsupportedValueError, match=r"\['fn'\] is a function"):
        encode({"fn": lambda: 0})


# ---------------------------------------------------------------------------- the checkpoint's state

def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _trained(model: Any, optimizer: Any, scheduler: Any, steps: int = 3) -> None:
    torch.manual_seed(steps)  # the same batches for a model and its restored copy
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4, dtype=next(model.parameters()).dtype)).pow(2).mean()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step(float(loss)) if isinstance(scheduler, L.ReduceLROnPlateau) else scheduler.step()


def _save(store: str, model: Any, optimizer: Any, scheduler: Any, writers: int = 2, step: int = 3) -> None:
    from hvd_transient.frontend.share import NamedShare
    from hvd_transient.torch.tensors import META_KEY, SpecCache, json_part, state_tensors, to_host

    tensors = state_tensors(model, optimizer)
    specs = SpecCache()(tensors)
    share = NamedShare(specs, lambda name: to_host(tensors[name]))
    meta = {META_KEY: json_part(model, optimizer, scheduler)}
    with CheckpointManager(store) as mgr:
        threads = [threading.Thread(target=mgr.save, args=(step, specs, meta),
                                    kwargs=dict(rank=r, world_size=writers, snapshot=share, attempt="a1"))
                   for r in range(writers)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert mgr.latest_step() == step


def _restore(store: str, model: Any, optimizer: Any, scheduler: Any) -> None:
    from hvd_transient.frontend.restore import latest_checkpoint
    from hvd_transient.torch.tensors import META_KEY, load_state

    ckpt = latest_checkpoint(store)
    assert ckpt is not None
    load_state(model, optimizer, scheduler, ckpt.tensors, ckpt.metadata.get(META_KEY, {}))


SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[2, 4], gamma=0.1),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=20),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_the_optimizer_and_scheduler_restore_exactly_as_saved(tmp_path: Path, name: str) -> None:
    """Adam's betas stay a tuple, MultiStepLR's milestones a Counter of int keys (else it never decays
    again), ReduceLROnPlateau's infinities are saved (else no save could be taken at all)."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.99))
    scheduler = SCHEDULERS[name](optimizer)
    _trained(model, optimizer, scheduler)
    _save(str(tmp_path), model, optimizer, scheduler)
    model2 = _model()
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    scheduler2 = SCHEDULERS[name](optimizer2)
    _restore(str(tmp_path), model2, optimizer2, scheduler2)
    assert same(scheduler2.state_dict(), scheduler.state_dict())
    assert same(optimizer2.state_dict(), optimizer.state_dict())  # betas a tuple, the moments bit-identical
    _trained(model, optimizer, scheduler, 4)  # both go on alike: the schedules decay at the same steps
    _trained(model2, optimizer2, scheduler2, 4)
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("change, match", [
    (lambda: (_model().double(), "sgd"), "the model has .* float64, the checkpoint .* float32"),
    (lambda: (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)), "sgd"), r"\(3,\)"),
    (lambda: (_model(), "adam"), "the optimizer is a Adam, the checkpoint's a SGD"),
    (lambda: (_model(), "two groups"), "parameter groups hold"),
    (lambda: (_model(), "reversed"), "another order or grouping"),
    (lambda: (_model(), "grouped by kind"), "another order or grouping"),
    (lambda: (_model(), "a scheduler"), "no scheduler state"),
    (lambda: (_model(), "another scheduler"), "the scheduler is"),
    (lambda: (_model(), "a foreign parameter of another shape"), "have the shapes"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_loaded(
        tmp_path: Path, change: Callable[[], tuple[Any, str]], match: str) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _trained(model, optimizer, None)
    _save(str(tmp_path), model, optimizer, None)
    other, kind = change()
    other_sched = None
    if kind == "adam":
        other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    elif kind == "two groups":
        other_opt = torch.optim.SGD([{"params": other[0].parameters()}, {"params": other[1].parameters()}], lr=0.1)
    elif kind == "reversed":
        other_opt = torch.optim.SGD(list(other.parameters())[::-1], lr=0.1, momentum=0.9)
    elif kind == "grouped by kind":  # the same counts per group as a split by layer would have
        other_opt = torch.optim.SGD([{"params": [other[0].weight, other[1].weight]},
                                     {"params": [other[0].bias, other[1].bias]}], lr=0.1, momentum=0.9)
        optimizer2 = torch.optim.SGD([{"params": [model[0].weight, model[0].bias]},
                                      {"params": [model[1].weight, model[1].bias]}], lr=0.1, momentum=0.9)
        _trained(model, optimizer2, None)
        _save(str(tmp_path), model, optimizer2, None, step=4)
    elif kind == "a foreign parameter of another shape":  # one the model does not own: no name tells it apart
        _save(str(tmp_path), model, torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1),
              None, step=4)
        other_opt = torch.optim.SGD([*other.parameters(), torch.nn.Parameter(torch.ones(5))], lr=0.1)
    else:
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    if kind in ("a scheduler", "another scheduler"):
        if kind == "another scheduler":
            _save(str(tmp_path), model, optimizer, L.StepLR(optimizer, 2), step=4)
        other_sched = L.CosineAnnealingLR(other_opt, 10)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StructureMismatchError, match=match):
        _restore(str(tmp_path), other, other_opt, other_sched)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # nothing loaded
    with CheckpointManager(str(tmp_path), max_to_keep=None) as mgr:  # the checkpoint is intact
        assert mgr.latest_step() in (3, 4) and len(mgr.restore().tensors) >= len(model.state_dict())


def test_a_state_a_checkpoint_cannot_carry_is_refused_when_the_hook_is_made() -> None:
    """A tensor learning rate (or any value JSON cannot carry) is refused at once, with what to do, rather
    than failing every save of the run (the hook writes its metadata once when it is made)."""
    from hvd_transient.torch.tensors import json_part

    model = _model()
    with pytest.raises(TypeError, match="give it as a float"):
        json_part(model, torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)), None)


# ---------------------------------------------------------------------------- learning-rate scaling

RATE_SCHEDULES: dict[str, Callable[[Any], Any]] = {
    "StepLR": lambda o: L.StepLR(o, 2, 0.5),
    "CosineAnnealingLR(eta_min)": lambda o: L.CosineAnnealingLR(o, 10, eta_min=0.01),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=20),
    "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.5, step_size_up=4),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.25, total_iters=3),
                                                 L.CosineAnnealingLR(o, 8, eta_min=0.02)], milestones=[3]),
}


@pytest.mark.parametrize("name", RATE_SCHEDULES)
def test_scaled_rates_follow_the_schedule_times_the_ring_size(name: str) -> None:
    """Rings of 4, 2, 3, 1 and 4 workers, two steps each: the rate is the one-worker schedule's times the
    size at every step, whatever the scheduler keeps its own copies of the rates in."""
    from hvd_transient.torch.lr import scale_learning_rates

    def fresh() -> tuple[Any, Any]:
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
        return opt, RATE_SCHEDULES[name](opt)

    ref_opt, ref_sched = fresh()
    reference = []
    for _ in range(10):
        ref_opt.step()
        ref_sched.step()
        reference.append(ref_opt.param_groups[0]["lr"])
    opt, sched = fresh()
    scaled_for, got, want = 1, [], []
    for size in (4, 2, 3, 1, 4):
        scale_learning_rates(opt, sched, size / scaled_for)
        scaled_for = size
        for _ in range(2):
            opt.step()
            sched.step()
            got.append(opt.param_groups[0]["lr"])
            want.append(reference[len(got) - 1] * size)
    assert got == pytest.approx(want, rel=1e-9)


# ---------------------------------------------------------------------------- one process under Horovod

ROLLBACK_AFTER_A_DEPARTURE = """
import tempfile, time
import horovod.torch as hvd, torch
from horovod.common.exceptions import HorovodInternalError
from horovod.runner.elastic.worker import HostUpdateResult
import hvd_transient.torch as hvdt

hvd.init()
store = tempfile.mkdtemp()
model = torch.nn.Linear(1, 1)
model.register_buffer("nsteps", torch.zeros((), dtype=torch.int64))  # the steps the model really took
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1000, 0.5)
state = hvdt.elastic_state(model, opt, sched, store=store, seen=0, history=[])  # the script's own values
tr = hvdt.Transient(state, store=store, save_every_steps=None, watcher="local", base_lr=0.1)
used, done = [], set()

@hvd.elastic.run
def train(state):
    for (ids,) in hvdt.elastic_batches(state, (torch.arange(64),), 4, epochs=1, steps_per_epoch=16):
        opt.zero_grad(); model(torch.ones(1, 1)).sum().backward(); opt.step(); sched.step()
        model.nsteps += 1
        state.seen += len(ids)
        state.history.append(int(state.step) + 1)  # changed in place: a rollback must undo it too
        used.append(ids.tolist())
        tr.after_step()
        if state.step % 5 == 0:
            state.commit()
        if state.step == 7 and "departure" not in done:  # a reset without a commit, as a departure's
            done.add("departure")
            state.on_hosts_updated(time.time(), HostUpdateResult.removed)
            state.check_host_updates()
        if state.step == 9 and "rollback" not in done:  # then a rollback before the next commit
            done.add("rollback")
            raise HorovodInternalError("a peer died in an allreduce")

def on_reset():
    del used[int(model.nsteps):]  # what the restored model did not train on is gone
state.register_reset_callbacks([on_reset])
train(state)
tr.close()
ids = sorted(i for batch in used for i in batch)
print("RESULT", int(state.step), int(model.nsteps), ids == list(range(64)), opt.param_groups[0]["lr"], state.seen,
      state.history == list(range(1, 17)))
"""


@pytest.mark.horovod
def test_a_rollback_after_a_departure_pairs_the_counters_with_the_model_they_belong_to(tmp_path: Path) -> None:
    """A departure's reset syncs the state without a commit; a rollback before the next commit must give
    back the model and the step, data position and learning-rate size of one and the same step: before,
    the counters stayed at the departure's step and the rolled-back steps' samples were skipped."""
    script = tmp_path / "rollback.py"
    script.write_text(ROLLBACK_AFTER_A_DEPARTURE)
    # gloo: a reset shuts Horovod down and starts it again
    out = subprocess.run([*HOROVODRUN, "--gloo", "-np", "1", "-H", "localhost:1", sys.executable, str(script)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (line,) = [x.split(">:", 1)[-1] for x in out.stdout.splitlines() if "RESULT" in x]
    _, step, nsteps, each_once, lr, seen, history = line.split()
    assert (int(step), int(nsteps), each_once) == (16, 16, "True")  # every sample once, in 16 real steps
    assert int(seen) == 64 and history == "True"  # the script's own values, kept with the model as the counters
    assert float(lr) == pytest.approx(0.1)  # a ring of one, not a rate scaled for an earlier size


ROLLBACK_AFTER_A_DEPARTURE_KERAS = """
import tempfile, time
import numpy as np, tensorflow as tf
import horovod.tensorflow.keras as hvd
from horovod.common.exceptions import HorovodInternalError
from horovod.runner.elastic.worker import HostUpdateResult
import hvd_transient.keras as hvdt

hvd.init()
store = tempfile.mkdtemp()
model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
state = hvdt.elastic_state(model, store=store, epoch=0, batch=0, hist=[])
done, checks = set(), []

class Faults(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(model.optimizer.iterations.numpy())
        state.hist.append(step)  # changed in place: a rollback must undo it too
        if step == 7 and "departure" not in done:  # a reset without a commit, as a departure's
            done.add("departure")
            state.on_hosts_updated(time.time(), HostUpdateResult.removed)
            state.check_host_updates()
        if step == 8 and "rollback" not in done:  # then a rollback before the next commit
            done.add("rollback")
            raise HorovodInternalError("a peer died in an allreduce")

def on_reset():  # the offset, epoch and batch must be those of the restored model's step
    checks.append((int(model.optimizer.iterations.numpy()), int(state.samples), int(state.epoch), int(state.batch)))
state.register_reset_callbacks([on_reset])
callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=5), hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvdt.TransientCallback(state, store=store, save_every_steps=None, watcher="local"), Faults()]

@hvd.elastic.run
def train(state):
    model.fit(hvdt.elastic_dataset(state, (np.ones((64, 1), np.float32), np.ones((64, 1), np.float32)), 4),
              steps_per_epoch=6, epochs=3 - state.epoch, callbacks=callbacks, verbose=0)

train(state)
print("RESULT", int(model.optimizer.iterations.numpy()), int(state.samples), state.hist == list(range(1, 19)), checks)
"""


@pytest.mark.horovod
def test_a_keras_rollback_after_a_departure_gives_back_the_offset_of_the_model_it_restores(tmp_path: Path) -> None:
    """The Keras state likewise (Horovod saves its model at every sync): the offset, epoch and batch a
    rollback restores belong to the model's step, and the run ends at its exact step."""
    script = tmp_path / "rollback_keras.py"
    script.write_text(ROLLBACK_AFTER_A_DEPARTURE_KERAS)
    out = subprocess.run([*HOROVODRUN, "--gloo", "-np", "1", "-H", "localhost:1", sys.executable, str(script)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (line,) = [x.split(">:", 1)[-1] for x in out.stdout.splitlines() if "RESULT" in x]
    _, step, samples, hist, checks = line.split(" ", 4)
    resets = ast.literal_eval(checks)
    # Horovod's callbacks keep the epoch and the index of the last batch done in it
    assert len(resets) == 2 and all((offset, epoch, batch) == (at * 4, at // 6, max(0, at % 6 - 1))
                                    for at, offset, epoch, batch in resets), resets
    assert (int(step), int(samples), hist) == (18, 72, "True")


STATIC_RELAUNCH_AFTER_A_STOP = """
import sys
import horovod.torch as hvd, torch
import hvd_transient.torch as hvdt
from ckpt_service.stores import open_store
from hvd_transient.core.control import request_stop, stop_requested

hvd.init()
store = sys.argv[1]
request_stop(open_store(store))  # asked of the previous launch
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = hvdt.static_state(model, opt, store=store)
tr = hvdt.Transient(state, store=store, save_every_steps=None, watcher="local")
for (x,) in hvdt.elastic_batches(state, (torch.randn(64, 2),), 4, epochs=1, steps_per_epoch=10):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
    tr.after_step()
tr.close()
print("RESULT", state.step, stop_requested(open_store(store)))
"""


@pytest.mark.horovod
def test_a_static_relaunch_clears_the_stop_request_the_previous_launch_was_given(tmp_path: Path) -> None:
    """A stop request is for the running job: a relaunch of a static job trains to its end, as an elastic
    job's cold start does (before, every relaunch stopped again within a step or two)."""
    script = tmp_path / "static_stop.py"
    script.write_text(STATIC_RELAUNCH_AFTER_A_STOP)
    out = subprocess.run([*HOROVODRUN, "--gloo", "-np", "1", "-H", "localhost:1", sys.executable, str(script),
                          str(tmp_path / "store")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (line,) = [x.split(">:", 1)[-1] for x in out.stdout.splitlines() if "RESULT" in x]
    assert line.split() == ["RESULT", "10", "False"]
