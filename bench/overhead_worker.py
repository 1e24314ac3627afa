"""One rank of the ckpt-overhead benchmark: trains under ``horovodrun`` and times every step.

Started by ``bench/ckpt_overhead.py`` (one process per rank), never by hand. It reads a
plan (JSON) of *windows*: a window is ``steps`` training steps of one configuration with
the checkpoint interval ``interval``; its first step is a save step, so every window
holds exactly one save and everything that save costs afterwards (background
persisting, the other rank waiting). The configurations are interleaved in rounds,
so drift in the machine's load hits all of them alike.

Configurations (what runs after each ``train_on_batch`` step):

* ``none``: no checkpoint; at ten steps of each window (the first is where the others save) it
  times an ``np.copy`` of the state, the stall's reference.
* ``save_weights``: what Horovod's documentation recommends: rank 0 alone calls
  ``model.save_weights(prefix)`` (TensorFlow checkpoint format, as
  ``ModelCheckpoint(save_weights_only=True)`` does) at save steps.
* ``tf_checkpoint``: rank 0 alone calls ``tf.train.Checkpoint(model, optimizer).write``.
* ``ours_sync``: ``TransientImpl.after_step`` at every step (the notice collective of
  ``TransientCallback``) and at save steps ``TransientImpl.save_now``: every rank writes
  its share, records gathered with Horovod collectives, rank 0 commits.
* ``ours_async``: ``TransientImpl.after_step`` with ``save_every_steps=interval``: exactly
  what ``TransientCallback`` runs, a periodic ``save_async`` whose caller pays only the
  host-memory snapshot.

At the end of a window the worker waits for an in-flight background save (timed, and
counted in the window) and meets the other ranks in a barrier, so no window inherits
work from the previous one. Besides wall time, each window records the process's CPU time
(every thread: training, Horovod, the background save), which other work on a shared
machine disturbs far less. Each rank writes ``rank-<r>.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

log = logging.getLogger("overhead_worker")

#: repeats of the host-copy measurements at the end (medians are reported)
COPY_REPEATS = 21
#: np.copy timings per no-checkpoint window (the first at its save step)
COPIES_PER_WINDOW = 10
#: async saves whose background CPU time is measured at the end, and the steps they use
BACKGROUND_REPEATS = 15
BACKGROUND_FIRST_STEP = 10**9
#: async saves (and as many copies) alternating with training steps at the end, and their steps
PAIRED_REPEATS = 15
PAIRED_FIRST_STEP = 2 * 10**9
#: how long the process's CPU rate with nothing running is sampled (Horovod's own thread)
IDLE_PROBE_S = 1.0


class WorkerError(RuntimeError):
    """The plan or the model cannot be used as given."""


# --------------------------------------------------------------------------- the model


def _load_callable(spec: str) -> Callable[[], Any]:
    """``package.module:function`` or ``path/to/file.py:function``."""
    module_name, _, func_name = spec.rpartition(":")
    if not module_name or not func_name:
        raise WorkerError(f"--model {spec!r}: expected module:function or file.py:function")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise WorkerError(f"--model {spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, func_name)
    except AttributeError:
        raise WorkerError(f"--model {spec!r}: {module_name} has no attribute {func_name!r}") from None


def load_model(spec: dict[str, str]) -> tf.keras.Model:
    kind, value = spec["kind"], spec["value"]
    if kind == "builtin":
        from hvd_transient.testing.workloads import MODELS

        return MODELS[value]()
    if kind == "function":
        model = _load_callable(value)()
    else:  # saved
        model = tf.keras.models.load_model(value)
    if not isinstance(model, tf.keras.Model):
        raise WorkerError(f"{value!r} gave a {type(model).__name__}, not a Keras model")
    return model


def _loss_name(loss: Any) -> str:
    if isinstance(loss, str):
        return loss.lower()
    return str(getattr(loss, "name", None) or getattr(loss, "__name__", "") or type(loss).__name__).lower()


def compile_distributed(model: tf.keras.Model) -> str:
    """Re-compile with the model's own optimizer and loss (if it has them) under DistributedOptimizer."""
    loss = getattr(model, "loss", None)
    optimizer = getattr(model, "optimizer", None)
    if loss is None or optimizer is None:
        outputs = model.outputs[0].shape
        classes = outputs[-1] if len(outputs) == 2 else None
        loss = (tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True) if classes and classes > 1
                else tf.keras.losses.MeanSquaredError())
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    if isinstance(loss, (dict, list, tuple)):
        raise WorkerError("models with several losses are not supported: give a model with one output")
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss=loss)
    return _loss_name(loss)


def synthetic_batches(model: tf.keras.Model, loss_name: str, batch_size: int, seed: int,
                      count: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random inputs and targets shaped for the model (CIFAR-10 shapes for the built-in models)."""
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise WorkerError(f"the model has {len(model.inputs)} inputs and {len(model.outputs)} outputs; "
                          "the benchmark feeds one input and one target")
    in_shape = tuple(model.inputs[0].shape)[1:]
    out_shape = tuple(model.outputs[0].shape)[1:]
    if any(d is None for d in in_shape + out_shape):
        raise WorkerError(f"input {in_shape} / output {out_shape} have unknown dimensions; give a model "
                          "with fixed shapes (e.g. build it with tf.keras.Input(shape=...))")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal((batch_size, *in_shape)).astype(np.float32)
        if "sparse" in loss_name:
            y: np.ndarray = rng.integers(0, out_shape[-1], (batch_size, *out_shape[:-1])).astype(np.int64)
        elif "categorical" in loss_name:
            y = np.eye(out_shape[-1], dtype=np.float32)[rng.integers(0, out_shape[-1], (batch_size, *out_shape[:-1]))]
        elif "binary" in loss_name:
            y = rng.integers(0, 2, (batch_size, *out_shape)).astype(np.float32)
        else:
            y = rng.standard_normal((batch_size, *out_shape)).astype(np.float32)
        out.append((x, y))
    return out


# --------------------------------------------------------------------------- savers


class Saver:
    """What one configuration does after each training step. ``local`` is the saver's own step count."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def due(self, local: int) -> bool:
        return local > 0 and local % self.interval == 0

    def after_step(self, local: int) -> None:
        pass

    def notice_rounds(self) -> int:
        """Notice collectives run so far (hvd-transient configurations only)."""
        return 0

    def busy(self) -> bool:
        """A save started by this configuration is still running in the background."""
        return False

    def finish_window(self) -> None:
        """Wait for work started in this window (a background save)."""

    def save_stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def host_arrays(model: tf.keras.Model) -> list[np.ndarray]:
    """Every state variable read into host memory once: what the np.copy references copy."""
    from hvd_transient.keras import state_variables

    return [np.asarray(v) for v in state_variables(model).values()]


def copy_seconds(arrays: Sequence[np.ndarray]) -> float:
    """How long one np.copy of every array takes: the stall's reference."""
    t0 = time.perf_counter()
    copied = [np.copy(a) for a in arrays]
    elapsed = time.perf_counter() - t0
    del copied
    return elapsed


class NoSaver(Saver):
    """No checkpoint; it times a plain copy of the state where the others save, and at 9 more steps.

    That copy is the stall's reference taken where the stall is taken, on a loop under the
    same load (the other rank training, the same caches), instead of on an idle one; the
    extra steps give the median enough samples. It adds ten copies of the state per window
    (~15 ms against K steps of hundreds of ms).
    """

    def __init__(self, interval: int, model: tf.keras.Model) -> None:
        super().__init__(interval)
        self._arrays = host_arrays(model)
        self._copies: list[float] = []
        self._every = max(1, interval // COPIES_PER_WINDOW)

    def after_step(self, local: int) -> None:
        if local > 0 and local % self._every == 0:
            self._copies.append(copy_seconds(self._arrays))

    def save_stats(self) -> dict[str, Any]:
        copies, self._copies = self._copies, []
        return {"copy_s": copies}


class SaveWeightsSaver(Saver):
    def __init__(self, interval: int, model: tf.keras.Model, directory: Path) -> None:
        super().__init__(interval)
        self.model, self.directory = model, directory

    def after_step(self, local: int) -> None:
        if self.due(local) and hvd.rank() == 0:
            self.model.save_weights(str(self.directory / f"ckpt-{local}"))  # no .h5: TF format


class TfCheckpointSaver(Saver):
    def __init__(self, interval: int, model: tf.keras.Model, directory: Path) -> None:
        super().__init__(interval)
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self.directory = directory

    def after_step(self, local: int) -> None:
        if self.due(local) and hvd.rank() == 0:
            self.checkpoint.write(str(self.directory / f"ckpt-{local}"))


class TransientSaver(Saver):
    """The TransientCallback machinery (``TransientImpl``) on a store of its own."""

    def __init__(self, interval: int, model: tf.keras.Model, store: str, *, asynchronous: bool,
                 check_every_steps: int | None = None, check_interval_s: float = 1.0) -> None:
        super().__init__(interval)
        from hvd_transient.hvd_collectives import HorovodCollectives
        from hvd_transient.keras import state_variables
        from hvd_transient.tf_snapshot import FusedSnapshot
        from hvd_transient.transient import TransientConfig, TransientImpl

        self.model, self.asynchronous = model, asynchronous
        # as TransientCallback: the variables listed once, this rank's share read by one fused call
        self._fused = FusedSnapshot(state_variables(model))
        config = TransientConfig(store=store, save_every_steps=interval if asynchronous else None,
                                 check_every_steps=check_every_steps, check_interval_s=check_interval_s,
                                 watcher="local")
        self.impl = TransientImpl(config, HorovodCollectives())
        self.impl.begin(0)  # a collective: every rank builds the savers in the same order
        self._async_seen = 0  # async_save events already reported

    def _snapshot(self) -> dict[str, Any]:
        return self._fused.specs

    def _share(self, plan: Any, rank: int) -> Any:
        return self._fused(plan, rank)  # a DeferredShare for variables in host memory

    def notice_rounds(self) -> int:
        return self.impl.notice_rounds

    def _metadata(self, step: int) -> dict[str, Any]:
        # as TransientCallback's: the step its caller read, the world size, the learning rate read
        from hvd_transient.keras import learning_rate_of

        meta: dict[str, Any] = {"step": step, "world_size": hvd.size()}
        lr = learning_rate_of(self.model.optimizer)
        if lr is not None:
            meta["lr"] = lr
        return meta

    def _start_async_save(self, step: int) -> None:
        """One async save of every rank at ``step``, as a periodic save makes it (the caller times it)."""
        self.impl.manager.save_async(step, self._snapshot(), self._metadata(step), rank=hvd.rank(),
                                     world_size=hvd.size(), coordinator=self.impl.run.master,
                                     snapshot=self._share)

    def after_step(self, local: int) -> None:
        # TransientCallback reads the optimizer's step after every batch and hands it to the metadata
        step = int(self.model.optimizer.iterations.numpy())
        self.impl.after_step(local, self._snapshot, partial(self._metadata, step), self._share)
        if not self.asynchronous and self.due(local):
            self.impl.save_now(local, self._snapshot(), self._metadata(step), coordinator=self.impl.run.master,
                               deadline=None, kind="periodic", share_snapshot=self._share)

    def busy(self) -> bool:
        return self.impl.manager.save_in_flight

    def finish_window(self) -> None:
        self.impl.manager.wait()

    def save_stats(self) -> dict[str, Any]:
        stats = self.impl.manager.last_stats
        if stats is None:
            return {}
        # The periodic save's own blocked time, as TransientImpl reports it in its async_save event
        # (after the notice collective, so it leaves out waiting for the other rank there).
        started = [e for e in self.impl.events.events if e["event"] == "async_save"]
        own, self._async_seen = started[self._async_seen:], len(started)
        return {"save_step": stats.step, "bytes_written": stats.bytes_written, "snapshot_or_save_s": stats.stall_s,
                "write_s": stats.write_s, "committed": stats.committed,
                "own_stall_s": [e["stall_ms"] / 1000 for e in own]}

    def background_cpu(self) -> dict[str, Any]:
        """CPU time of an async save's background part (write, checksums, commit), training paused.

        Every rank saves at once, as at a periodic save. On a machine whose cores training keeps
        busy, each CPU-second of this work can take a second from training, so it bounds the
        contention that the blocked-time estimate leaves out. The process's CPU rate with
        nothing running (Horovod's background thread) is taken off.
        """
        manager = self.impl.manager
        barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(IDLE_PROBE_S)  # a measurement interval, not a wait for anything
        idle_rate = (time.process_time() - c0) / (time.perf_counter() - t0)
        arrays = host_arrays(self.model)
        samples, stalls, copies = [], [], []
        for i in range(BACKGROUND_REPEATS):
            # the copy, like the save, right after a collective: a copy in a tight loop runs on warm
            # caches and awake threads, which neither a save nor a copy in training gets
            barrier()
            copies.append(copy_seconds(arrays))
            barrier()
            t0 = time.perf_counter()
            self._start_async_save(BACKGROUND_FIRST_STEP + i)
            c1, t1 = time.process_time(), time.perf_counter()  # the caller's part, the stall, is over
            stalls.append(t1 - t0)
            manager.wait()
            samples.append(max(0.0, time.process_time() - c1 - idle_rate * (time.perf_counter() - t1)))
        # stalls and copies with no training going on, each right after a collective
        return {"background_cpu_samples": samples, "idle_cpu_rate": idle_rate, "idle_stall_samples": stalls,
                "idle_copy_samples": copies}

    def paired_in_training(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        """Async saves and np.copy timings alternating step by step while training goes on.

        Each training step is followed by a collective (as the notice collective precedes a
        periodic save), then either a save or a copy of the state, so both meet the same load;
        a save's background write is waited for before the next step, outside the timings.
        """
        manager = self.impl.manager
        arrays = host_arrays(self.model)
        stalls, copies = [], []
        for i in range(2 * PAIRED_REPEATS):
            self.model.train_on_batch(*batches[i % len(batches)])
            manager.wait()
            barrier()
            if i % 2:
                copies.append(copy_seconds(arrays))
                continue
            t0 = time.perf_counter()
            self._start_async_save(PAIRED_FIRST_STEP + i)
            stalls.append(time.perf_counter() - t0)
        manager.wait()
        return {"paired_stall_samples": stalls, "paired_copy_samples": copies}

    def close(self) -> None:
        self.impl.end(0)
        self.impl.close()
        self.impl.manager.close()


def make_saver(config: str, interval: int, model: tf.keras.Model, plan: dict[str, Any]) -> Saver:
    name = f"{config}-{interval}"
    if config == "none":
        return NoSaver(interval, model)
    if config in ("save_weights", "tf_checkpoint"):
        directory = Path(plan["baseline_dir"]) / name
        directory.mkdir(parents=True, exist_ok=True)
        cls = SaveWeightsSaver if config == "save_weights" else TfCheckpointSaver
        return cls(interval, model, directory)
    if config in ("ours_sync", "ours_async"):
        return TransientSaver(interval, model, plan["stores"][name], asynchronous=config == "ours_async",
                              check_every_steps=plan.get("check_every_steps"),
                              check_interval_s=plan.get("check_interval_s", 1.0))
    raise WorkerError(f"unknown configuration {config!r}")


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Window:
    config: str
    interval: int
    steps: int
    index: int          # -1 for the warm-up window of this configuration
    start_step: int     # the saver's step count at the first step (a multiple of interval)


def barrier() -> None:
    hvd_tf.allreduce(tf.constant(0.0), name="bench.barrier")


def run_window(model: tf.keras.Model, batches: Sequence[tuple[np.ndarray, np.ndarray]], saver: Saver,
               window: Window) -> dict[str, Any]:
    train_s, hook_s, saves, rounds = [], [], [], []
    persisted_at: int | None = None  # first step after which no background save was in flight
    barrier()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(window.steps):
        local = window.start_step + i
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        model.train_on_batch(x, y)  # returns host values: the step has finished
        t1 = time.perf_counter()
        before = saver.notice_rounds()
        saver.after_step(local)
        t2 = time.perf_counter()
        if saver.notice_rounds() > before:
            rounds.append(i)
        train_s.append(t1 - t0)
        hook_s.append(t2 - t1)
        if saver.due(local) and not isinstance(saver, NoSaver):
            saves.append(i)
        if saves and persisted_at is None and not saver.busy():
            persisted_at = i
    t_steps = time.perf_counter()
    saver.finish_window()
    t_finish, cpu_end = time.perf_counter(), time.process_time()
    barrier()
    t_end = time.perf_counter()
    return {"config": window.config, "interval": window.interval, "index": window.index, "steps": window.steps,
            "train_s": train_s, "hook_s": hook_s, "save_steps": saves, "round_steps": rounds,
            "persisted_at": persisted_at,
            "window_s": t_end - t_start,
            "finish_s": t_finish - t_steps, "cpu_s": cpu_end - cpu_start, **saver.save_stats()}


def copy_timings(model: tf.keras.Model) -> dict[str, Any]:
    """Host-memory reference points for the snapshot: read every variable, and np.copy the arrays."""
    from hvd_transient.keras import state_variables

    variables = list(state_variables(model).values())
    reads, copies = [], []
    arrays = host_arrays(model)
    for _ in range(COPY_REPEATS):
        t0 = time.perf_counter()
        fresh = [np.asarray(v) for v in variables]
        reads.append(time.perf_counter() - t0)
        del fresh
        copies.append(copy_seconds(arrays))
    return {"state_bytes": int(sum(a.nbytes for a in arrays)), "tensors": len(arrays),
            "memcpy_s": statistics.median(copies), "memcpy_samples": copies,
            "host_read_s": statistics.median(reads), "host_read_samples": reads}


def notice_collective_timings() -> dict[str, Any]:
    """The per-step notice allreduce of TransientCallback on its own, every rank arriving together.

    Inside training the same call also absorbs waiting for a slower rank; this is its own cost.
    """
    from hvd_transient.election import encode_notice
    from hvd_transient.hvd_collectives import HorovodCollectives

    comm = HorovodCollectives()
    vector = encode_notice(comm.rank(), comm.size(), None)
    comm.allreduce_sum(vector)
    samples = []
    for _ in range(COPY_REPEATS):
        barrier()
        t0 = time.perf_counter()
        comm.allreduce_sum(vector)
        samples.append(time.perf_counter() - t0)
    return {"notice_collective_s": statistics.median(samples), "notice_collective_samples": samples}


def run(plan: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    hvd.init()
    rank = hvd.rank()
    tf.random.set_seed(plan["seed"])  # identical initial weights on every rank
    model = load_model(plan["model"])
    loss_name = compile_distributed(model)
    batches = synthetic_batches(model, loss_name, plan["batch_size"], plan["seed"] + 1000 * rank)
    started = time.perf_counter()
    for i in range(plan["warmup_steps"]):
        model.train_on_batch(*batches[i % len(batches)])
    from hvd_transient.keras import state_variables

    hvd_tf.broadcast_variables(list(state_variables(model).values()), root_rank=0)
    warmup_s = time.perf_counter() - started

    savers: dict[tuple[str, int], Saver] = {}
    windows = [Window(**w) for w in plan["windows"]]
    for w in windows:  # same order on every rank: TransientSaver's begin() is a collective
        if (w.config, w.interval) not in savers:
            savers[(w.config, w.interval)] = make_saver(w.config, w.interval, model, plan)
    results = []
    background: dict[str, Any] = {}
    try:
        for n, w in enumerate(windows):
            result = run_window(model, batches, savers[(w.config, w.interval)], w)
            results.append(result)
            if rank == 0:
                kind = "warm-up" if w.index < 0 else f"window {w.index}"
                print(f"[{n + 1}/{len(windows)}] {w.config:<13} every {w.interval:>4} {kind:<9} "
                      f"{w.steps} steps in {result['window_s']:.1f} s", file=sys.stderr, flush=True)
        async_saver = next((s for (c, _), s in savers.items() if c == "ours_async"), None)
        if isinstance(async_saver, TransientSaver):  # the same on every rank: it runs collectives
            background = {**async_saver.paired_in_training(batches), **async_saver.background_cpu()}
    finally:
        for saver in savers.values():
            saver.close()
    doc = {"rank": rank, "size": hvd.size(), "warmup_s": warmup_s, "params": int(model.count_params()),
           "model_name": model.name, "loss": loss_name, "windows": results, **copy_timings(model),
           **notice_collective_timings(), **background}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, out_dir / f"rank-{rank}.json")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of bench/ckpt_overhead.py (run under horovodrun)")
    p.add_argument("--plan", type=Path, required=True, help="the plan JSON written by ckpt_overhead.py")
    p.add_argument("--out", type=Path, required=True, help="directory for rank-<r>.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    run(json.loads(args.plan.read_text()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
