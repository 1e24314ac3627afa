"""One rank of :mod:`bench.ckpt_overhead` under ``horovodrun``: trains the plan's windows, times every step
(a window ends with its background save and a barrier) and writes ``rank-<r>.json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pkgutil
import runpy
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench.ckpt_overhead import Window  # noqa: E402
from hvd_transient.keras import learning_rate_of, state_variables  # noqa: E402
from hvd_transient.keras.state import optimizer_step  # noqa: E402

log = logging.getLogger(__name__)

COPIES_PER_WINDOW = 10  # np.copy timings per no-checkpoint window
NOTICE_REPEATS = 21  # timings of the notice allreduce alone, at the end


def load_model(spec: str) -> tf.keras.Model:
    """A built-in model, or what ``package.module:function`` / ``path/to/file.py:function`` returns."""
    from hvd_transient.testing.workloads import MODELS
    path, _, func = spec.rpartition(":")
    model = (MODELS[spec]() if spec in MODELS else runpy.run_path(path)[func]() if path.endswith(".py")
             else pkgutil.resolve_name(spec)())
    if not isinstance(model, tf.keras.Model):
        raise ValueError(f"--model {spec!r} gave a {type(model).__name__}, not a Keras model")
    return model


def compile_distributed(model: tf.keras.Model) -> str:
    """Re-compile with the model's own optimizer and loss (if any) under DistributedOptimizer; the loss's name."""
    loss, optimizer = getattr(model, "loss", None), getattr(model, "optimizer", None)
    if loss is None or optimizer is None:
        classes = model.outputs[0].shape[-1] if len(model.outputs[0].shape) == 2 else None
        loss = (tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True) if classes and classes > 1
                else tf.keras.losses.MeanSquaredError())
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError("models with several losses are not supported: give a model with one output")
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss=loss)
    return str(loss if isinstance(loss, str) else getattr(loss, "name", None) or type(loss).__name__).lower()


def synthetic_batches(model: tf.keras.Model, loss: str, batch_size: int, seed: int,
                      count: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random inputs and targets shaped for the model: class ids, one-hot rows or values, as the loss wants."""
    x_shape, y_shape = tuple(model.inputs[0].shape)[1:], tuple(model.outputs[-1].shape)[1:]
    if len(model.inputs) != 1 or len(model.outputs) != 1 or None in x_shape + y_shape:
        raise ValueError(f"the model needs one input and one output of fixed shapes, not {model.inputs} -> "
                         f"{model.outputs} (build it with tf.keras.Input(shape=...))")
    rng = np.random.default_rng(seed)
    labels = [rng.integers(0, y_shape[-1], (batch_size, *y_shape[:-1])) for _ in range(count)]
    targets = ([y.astype(np.int64) for y in labels] if "sparse" in loss
               else [np.eye(y_shape[-1], dtype=np.float32)[y] for y in labels] if "categorical" in loss
               else [rng.random((batch_size, *y_shape), dtype=np.float32) for _ in labels])
    return [(rng.standard_normal((batch_size, *x_shape)).astype(np.float32), y) for y in targets]


def barrier() -> None:
    hvd_tf.allreduce(tf.constant(0.0), name="bench.barrier")


class Saver:
    """What one configuration runs after each training step (``local``: its own step count), see
    :meth:`after_step`; ``ours_async`` runs exactly what ``TransientCallback`` does."""

    def __init__(self, config: str, interval: int, model: tf.keras.Model, plan: dict[str, Any]) -> None:
        self.config, self.interval, self.model = config, interval, model
        self.impl: Any = None
        self.samples: dict[str, list[float]] = {}
        name = f"{config}-{interval}"
        if config == "none":
            self.arrays = [np.asarray(v) for v in state_variables(model).values()]
        elif config == "save_weights":
            self.directory = Path(plan["baseline_dir"]) / name
            self.directory.mkdir(parents=True, exist_ok=True)
        else:
            from hvd_transient.collectives.horovod import HorovodCollectives
            from hvd_transient.core.transient import TransientConfig, TransientImpl
            from hvd_transient.keras.snapshot import FusedSnapshot
            # as TransientCallback: the variables listed once, this rank's share read by one fused call
            self.fused = FusedSnapshot(state_variables(model))
            self.impl = TransientImpl(TransientConfig(
                store=plan["stores"][name], save_every_steps=interval if config == "ours_async" else None,
                check_every_steps=plan["check_every_steps"], check_interval_s=plan["check_interval_s"],
                watcher="local"), HorovodCollectives())
            self.impl.begin(0)  # a collective: every rank builds the savers in the same order
            self._async_seen = 0

    def saves(self, local: int) -> bool:
        return self.config != "none" and local > 0 and local % self.interval == 0

    def notice_rounds(self) -> int:
        return self.impl.notice_rounds if self.impl else 0

    def _metadata(self, step: int) -> dict[str, Any]:
        lr = learning_rate_of(self.model.optimizer)  # as TransientCallback's metadata
        return {"step": step, "world_size": hvd.size(), **({"lr": lr} if lr is not None else {})}

    def begin_window(self) -> None:
        if self.impl is not None:  # as TransientCallback.on_epoch_begin: the other windows' time is no step
            self.impl.before_step()

    def after_step(self, local: int) -> None:
        if self.config == "none":  # np.copy of the state ten times a window: the stall's reference
            if local % max(1, self.interval // COPIES_PER_WINDOW) == 0:
                t0 = time.perf_counter()
                _copies = [np.copy(a) for a in self.arrays]
                self.samples.setdefault("copy_s", []).append(time.perf_counter() - t0)
        elif self.config == "save_weights":
            if self.saves(local) and hvd.rank() == 0:
                self.model.save_weights(str(self.directory / f"ckpt-{local}"))  # no .h5: TensorFlow format
        else:
            # as TransientCallback: the optimizer's step is read (one TensorFlow op) only at the steps at which
            # the protocol does more than the plain path, and counted at the others (frontend/step_counter.py)
            step = optimizer_step(self.model.optimizer) if not self.impl.plain_step(local) else local
            self.impl.after_step(local, lambda: self.fused.specs, partial(self._metadata, step), self.fused)
            if self.config == "ours_sync" and self.saves(local):
                self.impl.save_now(local, self.fused.specs, self._metadata(step), coordinator=self.impl.run.master,
                                   deadline=None, kind="periodic", share_snapshot=self.fused)

    def finish_window(self) -> dict[str, list[float]]:
        """Wait for a background save of this window; the window's samples."""
        if self.impl is not None:
            self.impl.manager.wait()
            # the periodic save's own blocked time, as TransientImpl reports it (after the notice collective)
            started = [e for e in self.impl.events.events if e["event"] == "async_save"]
            self.samples["own_stall_s"] = [e["stall_ms"] / 1000 for e in started[self._async_seen:]]
            self._async_seen = len(started)
        samples, self.samples = self.samples, {}
        return samples

    def close(self) -> None:
        if self.impl is not None:
            self.impl.end(0)
            self.impl.close()
            self.impl.manager.close()


def run_window(model: tf.keras.Model, batches: Sequence[tuple[np.ndarray, np.ndarray]], saver: Saver,
               window: Window) -> dict[str, Any]:
    train_s, hook_s, hook_cpu_s, saves, rounds = [], [], [], [], []
    barrier()
    saver.begin_window()
    t_start = time.perf_counter()
    for i in range(window.steps):
        local = window.start_step + i
        t0 = time.perf_counter()
        model.train_on_batch(*batches[i % len(batches)])  # returns host values: the step has finished
        t1 = time.perf_counter()
        before = saver.notice_rounds()
        c1 = time.thread_time()  # the call's own CPU: what it costs whatever else shares the cores
        saver.after_step(local)
        hook_s.append(time.perf_counter() - t1)
        hook_cpu_s.append(time.thread_time() - c1)
        train_s.append(t1 - t0)
        if saver.notice_rounds() > before:
            rounds.append(i)
        if saver.saves(local):
            saves.append(i)
    samples = saver.finish_window()
    barrier()
    return {"config": window.config, "interval": window.interval, "index": window.index, "train_s": train_s,
            "hook_s": hook_s, "hook_cpu_s": hook_cpu_s, "save_steps": saves, "round_steps": rounds,
            "window_s": time.perf_counter() - t_start, **samples}


def notice_collective_s() -> list[float]:
    """The per-step notice allreduce of TransientCallback alone, every rank arriving together."""
    from hvd_transient.collectives.horovod import HorovodCollectives
    from hvd_transient.core.election import encode_notice
    comm = HorovodCollectives()
    vector = encode_notice(comm.rank(), comm.size(), None)
    comm.allreduce_sum(vector)
    samples = []
    for _ in range(NOTICE_REPEATS):
        barrier()
        t0 = time.perf_counter()
        comm.allreduce_sum(vector)
        samples.append(time.perf_counter() - t0)
    return samples


def run(plan: dict[str, Any], out_dir: Path) -> None:
    hvd.init()
    rank = hvd.rank()
    tf.random.set_seed(plan["seed"])  # identical initial weights on every rank
    model = load_model(plan["model"])
    loss = compile_distributed(model)
    batches = synthetic_batches(model, loss, plan["batch_size"], plan["seed"] + 1000 * rank)
    for i in range(plan["warmup_steps"]):
        model.train_on_batch(*batches[i % len(batches)])
    variables = list(state_variables(model).values())
    hvd_tf.broadcast_variables(variables, root_rank=0)
    windows = [Window(**w) for w in plan["windows"]]
    savers: dict[tuple[str, int], Saver] = {}
    for w in windows:  # the same order on every rank: a TransientImpl's begin() is a collective
        if (w.config, w.interval) not in savers:
            savers[(w.config, w.interval)] = Saver(w.config, w.interval, model, plan)
    results = []
    try:
        for n, w in enumerate(windows):
            results.append(run_window(model, batches, savers[(w.config, w.interval)], w))
            if rank == 0:
                print(f"[{n + 1}/{len(windows)}] {w.config:<13} every {w.interval:>4} "
                      f"{'warm-up' if w.index < 0 else f'window {w.index}':<9} {w.steps} steps in "
                      f"{results[-1]['window_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        for saver in savers.values():
            saver.close()
    doc = {"rank": rank, "size": hvd.size(), "params": int(model.count_params()), "model_name": model.name,
           "loss": loss, "state_bytes": int(sum(np.asarray(v).nbytes for v in variables)), "tensors": len(variables),
           "notice_collective_samples": notice_collective_s(), "windows": results}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(doc))  # read once horovodrun exited cleanly


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of python -m bench.ckpt_overhead (run under horovodrun)")
    p.add_argument("--plan", type=Path, required=True, help="the plan JSON written by bench.ckpt_overhead")
    p.add_argument("--out", type=Path, required=True, help="directory for rank-<r>.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    run(json.loads(args.plan.read_text()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
