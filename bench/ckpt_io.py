"""Checkpoint save and restore throughput: ckpt_service (N writer / M reader processes) against np.savez,
tf.train.Checkpoint and the disk, on a local directory and fake-gcs-server, and the ``save_async`` stall
against ``np.copy``; the state is one shared-memory block (``emergency_save`` and ``restore`` reuse it).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import glob
import io
import itertools
import logging
import math
import os
import shutil
import sys
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

import bench.common as bc

log = logging.getLogger(__name__)
# google-api-core warns about the Python version on import, in every worker: noise here.
warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")

DTYPE = np.dtype("float32")
STORE_NAMES = {"local": "local dir", "gcs": "GCS emulator", "mem": "in memory", "url": "--store"}
SAVEZ = {"local": ("np.savez", "np.load"), "gcs": ("np.savez + 1 upload", "1 download + np.load")}
TF = ("tf.train.Checkpoint.write", "tf.train.Checkpoint.read")
FLOOR = ("1 file, fsynced (disk floor)", "1 file, cold read (disk floor)")
FILES = ("4 MiB files, 8 threads, fsynced", "4 MiB files, 8 threads, cold read")
OURS = ("ckpt_service save", "ckpt_service restore")
BASELINES = ("savez", "tf", "floor")  # np.savez / np.load, tf.train.Checkpoint, the disk (FLOOR and FILES)
Layout = tuple[tuple[str, tuple[int, ...]], ...]


def state_layout(total_bytes: int) -> Layout:
    """A float32 state of about ``total_bytes`` like a CNN's: <= 320 vectors, 4 dense matrices, 16 conv kernels."""
    blocks = min(64, max(4, total_bytes // 150_000))
    widths, kinds = (64, 128, 256, 512, 1024, 2048), ("bias", "bn_gamma", "bn_beta", "bn_mean", "bn_variance")
    shapes = [(f"block{b:02d}/{kind}", (widths[b % len(widths)],)) for b in range(blocks) for kind in kinds]
    rest = max(0, total_bytes - sum(math.prod(s) for _, s in shapes) * DTYPE.itemsize) // DTYPE.itemsize
    shapes += [(f"dense{i}/kernel", (max(1, int(rest * 0.15) // 1024), 1024)) for i in range(4)]
    shapes += [(f"block{i:02d}/conv/kernel", (3, 3, max(1, int(rest * 0.025) // (9 * 256)), 256)) for i in range(16)]
    return tuple(shapes)


@dataclass(frozen=True)
class StateRef:
    """A state in shared memory: the block's name and the arrays laid out in it, in order."""

    shm_name: str
    layout: Layout

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) for _, shape in self.layout) * DTYPE.itemsize


@contextlib.contextmanager
def shared_state(total_bytes: int, seed: int) -> Iterator[StateRef]:
    """A random (incompressible, like trained weights) state in a new shared-memory block."""
    ref = StateRef("", state_layout(total_bytes))
    shm = shared_memory.SharedMemory(create=True, size=max(1, ref.nbytes))
    np.random.default_rng(seed).random(out=np.ndarray((ref.nbytes // DTYPE.itemsize,), DTYPE, buffer=shm.buf),
                                       dtype=DTYPE)
    try:
        yield StateRef(shm.name, ref.layout)
    finally:
        shm.close()
        shm.unlink()


def drop_caches(*roots: str | Path) -> str:
    """Evict cached file data (all of it if allowed, else the files under ``roots``): the next read hits the disk."""
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3")
        return "drop_caches"
    for name in (f for root in roots for d, _, fs in os.walk(root) for f in (os.path.join(d, f) for f in fs)):
        with contextlib.suppress(OSError), open(name, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return "posix_fadvise(DONTNEED)"


_HELD: dict[str, Any] = {}  # this process's mapping of the state, and TensorFlow's copy of it


def state_arrays(ref: StateRef) -> dict[str, np.ndarray]:
    """The state's arrays in this process, mapped once; a new state replaces the previous one."""
    held = _HELD.get("state")
    if held is None or held[0] != ref:
        _HELD.clear()
        if held is not None:
            held[2].clear()
            gc.collect()  # no view may outlive the mapping
            held[1].close()
        shm = shared_memory.SharedMemory(name=ref.shm_name)
        offsets = itertools.accumulate((math.prod(shape) * DTYPE.itemsize for _, shape in ref.layout), initial=0)
        arrays = {name: np.ndarray(shape, DTYPE, buffer=shm.buf, offset=offset)
                  for (name, shape), offset in zip(ref.layout, offsets)}
        _HELD["state"] = held = (ref, shm, arrays)
    return held[2]


@functools.cache
def manager(url: str, io_threads: int = 8) -> Any:
    """One CheckpointManager per store and process, kept open (no retention: the parent deletes steps)."""
    from ckpt_service.manager import CheckpointManager
    return CheckpointManager(url, max_to_keep=None, io_threads=io_threads)


def warm_up(rank: int, url: str, io_threads: int) -> None:
    """Open the store's client and connections before anything is timed."""
    store, key = manager(url, io_threads).store, f"warmup/{uuid.uuid4().hex}"
    store.put(key, b"warm"), store.get(key), store.delete(key)


@dataclass(frozen=True)
class QueueGather:
    """Shard records to rank 0 through the pool's queue (a stand-in for hvd_transient's Horovod allgather)."""

    rank: int
    world: int
    step: int

    def __call__(self, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        if self.rank:
            bc.pool_queue().put((self.step, self.rank, record))
            return None
        got = {0: record}
        while len(got) < self.world:
            step, rank, other = bc.pool_queue().get(timeout=600)
            if step == self.step:  # anything else is left over from an interrupted round
                got[rank] = other
        return [got[r] for r in range(self.world)]


def save(rank: int, url: str, step: int, world: int, state: StateRef, io_threads: int,
         gather: str = "store", asynchronous: bool = False) -> tuple[float, float, int, float]:
    """(barrier, end, bytes written, seconds the call blocked) of this rank's share of one save."""
    mgr, arrays, meta = manager(url, io_threads), state_arrays(state), {"bench": "ckpt_io"}
    records = QueueGather(rank, world, step) if gather == "queue" and world > 1 else None
    attempt = f"bench-{step}"  # each timed save has a step of its own
    start = bc.sync(world)
    if asynchronous:
        if not mgr.save_async(step, arrays, meta, rank=rank, world_size=world, if_busy="wait", attempt=attempt):
            raise bc.BenchError(f"save_async of step {step} was skipped")
        blocked = time.perf_counter() - start
        mgr.wait()
    elif mgr.save(step, arrays, meta, rank=rank, world_size=world, gather=records,
                  attempt=attempt) is None and rank == 0:
        raise bc.BenchError(f"step {step} did not commit")
    end = time.perf_counter()
    return start, end, mgr.last_stats.bytes_written, blocked if asynchronous else end - start


def restore(rank: int, url: str, step: int, world: int, state: StateRef, io_threads: int) -> tuple[float, float, list]:
    """(barrier, end, tensor names) of this rank's ``partition=(rank, world)``, checked bit-exact."""
    mgr = manager(url, io_threads)
    start = bc.sync(world)
    tensors = mgr.restore(step, partition=(rank, world)).tensors
    end, arrays = time.perf_counter(), state_arrays(state)
    if not all(np.array_equal(a, arrays[name]) for name, a in tensors.items()):
        raise bc.BenchError(f"restore of step {step} on rank {rank}: the arrays differ from the state")
    return start, end, sorted(tensors)


def copy_state(rank: int, state: StateRef) -> float:
    arrays, start = list(state_arrays(state).values()), time.perf_counter()
    _copies = [np.copy(a) for a in arrays]
    return time.perf_counter() - start


def savez_baseline(rank: int, url: str, state: StateRef, load: bool = True) -> tuple[float, float, int]:
    """(save s, load s, bytes) of ``np.savez`` of the state as one object: locally a file (temporary name, fsync,
    rename) read back cold; on GCS one upload with the plain client, read back by one download."""
    store, key, arrays = manager(url, 8).store, f"baseline/{uuid.uuid4().hex}.npz", state_arrays(state)
    local = Path(store.root) / key if hasattr(store, "root") else None
    start = time.perf_counter()
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp := local.with_name(".bench-" + local.name), "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush(), os.fsync(fh.fileno())
            size = fh.tell()
        os.replace(tmp, local)
        drop_caches(local.parent)
    else:
        np.savez(buf := io.BytesIO(), **arrays)
        size = buf.tell()
        buf.seek(0)
        blob = store.client.bucket(store.bucket_name).blob(f"{store.prefix}/{key}".lstrip("/"))
        blob.upload_from_file(buf, size=size)
    save_s, start = time.perf_counter() - start, time.perf_counter()
    if load:
        with np.load(local or io.BytesIO(store.get(key))) as npz:
            if npz.files != list(arrays) or not all(np.array_equal(npz[n], a) for n, a in arrays.items()):
                raise bc.BenchError(f"np.load from {url}: the arrays differ from the state")
    load_s = time.perf_counter() - start
    store.delete(key)
    return save_s, load_s, size


def tf_baseline(rank: int, prefix: str, state: StateRef) -> tuple[float, float, int]:
    """(save s, load s, bytes) of ``tf.train.Checkpoint`` write (fsynced) and read of the state."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    arrays = state_arrays(state)
    if _HELD.get("tf", (None,))[0] != state:
        variables = [tf.Variable(a, name=n.replace("/", "_")) for n, a in arrays.items()]
        _HELD["tf"] = (state, tf.train.Checkpoint(variables=variables), variables)
    _, checkpoint, variables = _HELD["tf"]
    start = time.perf_counter()
    for name in (files := glob.glob(glob.escape(path := checkpoint.write(prefix)) + "*")):
        with open(name, "rb") as fh:
            os.fsync(fh.fileno())
    save_s = time.perf_counter() - start
    for v in variables:  # so that the read really restores something
        v.assign(tf.zeros_like(v))
    drop_caches(os.path.dirname(prefix))
    start = time.perf_counter()
    checkpoint.read(path).assert_existing_objects_matched()
    load_s = time.perf_counter() - start
    if not all(np.array_equal(v.numpy(), a) for v, a in zip(variables, arrays.values())):
        raise bc.BenchError("tf.train.Checkpoint.read: the variables differ from the state")
    size = sum(os.path.getsize(f) for f in files)
    for name in files:
        os.remove(name)
    return save_s, load_s, size


def disk_floor(rank: int, url: str, state: StateRef, file_mib: int = 0) -> tuple[float, float, str]:
    """(write s, cold read s, how caches were dropped) of the state's bytes as one fsynced file, or 8 threads'
    ``file_mib`` MiB files (the service's pattern), through the local store; read into newly allocated memory."""
    from ckpt_service.stores.local import LocalStore
    step, store = file_mib * 2**20 or state.nbytes, LocalStore(Path(url) / f"floor-{uuid.uuid4().hex}")
    state_arrays(state)  # maps the state's block in this process
    blob = _HELD["state"][1].buf[:state.nbytes]
    spans = [(str(i), slice(i, i + step)) for i in range(0, state.nbytes, step)]
    with ThreadPoolExecutor(8) as pool:
        start = time.perf_counter()
        list(pool.map(lambda ks: store.put_parts(ks[0], (blob[ks[1]],)), spans))
        save_s, how, start = time.perf_counter() - start, drop_caches(store.root), time.perf_counter()
        # into new memory, as a restore returns new arrays: the read faults its pages in (a buffer
        # zero-filled before the clock starts would leave that cost out of the floor only)
        buf = np.empty(state.nbytes, np.uint8).data
        got = list(pool.map(lambda ks: store.get_into(ks[0], buf[ks[1]]), spans))
        load_s = time.perf_counter() - start
    shutil.rmtree(store.root)
    if sum(g[0] for g in got if g) == state.nbytes:
        return save_s, load_s, how
    raise bc.BenchError(f"{store.root}: short read")


@dataclass(frozen=True)
class Config:
    sizes_mb: tuple[float, ...]
    writers: tuple[int, ...]
    readers: tuple[int, ...]  # none: no restores
    stores: tuple[str, ...]
    baselines: tuple[str, ...]  # savez, tf
    repeats: int
    large_repeats: int
    large_mb: float
    io_threads: int = 8
    async_stall: bool = True
    seed: int = 0
    save_repeats: int | None = None  # None: as many as restores
    gather: str = "store"  # how shard records reach rank 0: through the store, or the pool's queue

    def repeats_for(self, size_mb: float) -> int:
        return self.large_repeats if size_mb >= self.large_mb else self.repeats


@dataclass(frozen=True)
class Row:
    store: str  # local | gcs | url (--store) | mem
    size: str  # nominal, e.g. "100MB"
    state_bytes: int
    op: str  # save | restore | stall | memcpy
    method: str
    seconds: bc.Spread
    writers: int = 1
    readers: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> bc.Spread:
        return self.seconds.rate(self.state_bytes / bc.MB)

    @property
    def procs(self) -> str:
        return f"{self.writers}w -> {self.readers}r" if self.readers else f"{self.writers} writer(s)"

    def as_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {**fields, "procs": self.procs, "mb_per_s": self.mb_per_s, **self.extra}


def _elapsed(answers: Sequence[Sequence[Any]]) -> float:
    """From the barrier to the last rank done: answers begin with (start, end)."""
    return max(a[1] for a in answers) - min(a[0] for a in answers)


def measure(cfg: Config, pool: bc.RankPool, urls: Mapping[str, str], tmp: Path) -> list[Row]:
    """Every measurement of ``cfg``, size by size, store by store."""
    from ckpt_service.manager import CheckpointManager
    from ckpt_service.plan import TensorSpec, make_save_plan
    rows: list[Row] = []
    steps = itertools.count(1)

    def add(**fields: Any) -> None:
        rows.append(row := Row(**fields))
        print(f"  {row.store:5} {row.size:>7} {row.method:<26} {row.procs:<10} {row.seconds.text('{:.3f}')} s",
              file=sys.stderr, flush=True)

    def baselines(url: str, state: StateRef, repeats: int, **row: Any) -> None:
        methods = [(savez_baseline, SAVEZ["gcs" if url.startswith("gs://") else "local"],
                    {"url": url, "load": bool(cfg.readers)})] * ("savez" in cfg.baselines)
        if "tf" in cfg.baselines and not url.startswith("gs://"):
            methods.append((tf_baseline, TF, {"prefix": str(tmp / f"tf-{row['size']}" / "ckpt")}))
        if "floor" in cfg.baselines and not url.startswith("gs://"):
            methods += [(disk_floor, FLOOR, {"url": url}), (disk_floor, FILES, {"url": url, "file_mib": 4})]
        for fn, (save_name, load_name), kwargs in methods:
            got = [pool.run(fn, 1, state=state, **kwargs)[0] for _ in range(repeats)]
            add(**row, op="save", method=save_name, seconds=bc.spread([g[0] for g in got]),
                extra={"caches_dropped_by" if fn is disk_floor else "file_bytes": got[0][2]})
            if cfg.readers:
                add(**row, op="restore", method=load_name, seconds=bc.spread([g[1] for g in got]))

    def checkpoints(parent: Any, state: StateRef, repeats: int, where: Mapping[str, Any], **row: Any) -> None:
        for w in cfg.writers:
            samples, step = [], 0
            for _ in range(cfg.save_repeats or repeats):
                if step:
                    parent.delete(step)  # one checkpoint at a time, outside the timed region
                answers = pool.run(save, w, step=(step := next(steps)), world=w, gather=cfg.gather, **where)
                if sum(a[2] for a in answers) != state.nbytes:
                    raise bc.BenchError(f"save of step {step} by {w} writers did not write every byte")
                samples.append(_elapsed(answers))
            add(**row, op="save", method=OURS[0], seconds=bc.spread(samples), writers=w)
            for r in cfg.readers:
                samples = []
                for _ in range(repeats):
                    if row["store"] == "local":
                        drop_caches(where["url"])  # read from the disk, as after a restart
                    answers = pool.run(restore, r, step=step, world=r, **where)
                    if sorted(n for a in answers for n in a[2]) != sorted(n for n, _ in state.layout):
                        raise bc.BenchError(f"restore by {r} readers did not return each tensor once")
                    samples.append(_elapsed(answers))
                add(**row, op="restore", method=OURS[1], seconds=bc.spread(samples), writers=w, readers=r)
            parent.delete(step)
            if cfg.async_stall and row["store"] == "local":
                samples = []
                for _ in range(repeats):
                    answers = pool.run(save, w, step=(step := next(steps)), world=w, asynchronous=True, **where)
                    samples.append(max(a[3] for a in answers))
                    parent.delete(step)
                # the largest share of the state one rank copies: exactly its planned pieces
                plan = make_save_plan([TensorSpec(n, shape, DTYPE.name) for n, shape in state.layout], w)
                add(**row, op="stall", method="save_async", seconds=bc.spread(samples), writers=w,
                    extra={"snapshot_share_max": max(plan.bytes_per_rank()) / plan.total_bytes})

    for size_mb in cfg.sizes_mb:
        label, repeats = bc.size_label(size_mb), cfg.repeats_for(size_mb)
        with shared_state(int(size_mb * bc.MB), cfg.seed) as state:
            print(f"state {label}: {len(state.layout)} float32 tensors, {state.nbytes / bc.MB:.1f} MB, "
                  f"{repeats} repeat(s)", file=sys.stderr, flush=True)
            for store in cfg.stores:
                row = {"store": store, "size": label, "state_bytes": state.nbytes}
                url = f"{urls[store]}/{label}"
                pool.run(warm_up, url=url, io_threads=cfg.io_threads)
                baselines(url, state, repeats, **row)
                with CheckpointManager(url, max_to_keep=None) as parent:
                    checkpoints(parent, state, repeats, {"url": url, "state": state, "io_threads": cfg.io_threads},
                                **row)
                    parent.store.delete_prefix("")  # frees the emulator's memory
            if cfg.async_stall:
                add(store="mem", size=label, state_bytes=state.nbytes, op="memcpy", method="np.copy of every array",
                    seconds=bc.spread([pool.run(copy_state, 1, state=state)[0] for _ in range(repeats)]))
    return rows


@contextlib.contextmanager
def store_urls(stores: Sequence[str], tmp: Path, user_store: str | None = None) -> Iterator[dict[str, str]]:
    """A URL prefix per store: a directory, an emulator bucket, or a run prefix under ``user_store`` (removed)."""
    if user_store:
        url = user_store.rstrip("/") + f"/bench-{uuid.uuid4().hex[:8]}"
        try:
            yield {"url": url}
        finally:
            from ckpt_service.stores import open_store
            with contextlib.suppress(Exception):  # clean-up must not hide the results
                open_store(url).delete_prefix("")
            shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
    elif "gcs" in stores:
        with bc.gcs_bucket("bench") as url:
            yield {"local": str(tmp / "store"), "gcs": url}
    else:
        yield {"local": str(tmp / "store")}


def run(cfg: Config, tmp: Path, user_store: str | None = None) -> list[Row]:
    with store_urls(cfg.stores, tmp, user_store) as urls, \
            contextlib.closing(bc.RankPool(max((*cfg.writers, *cfg.readers)))) as pool:
        return measure(cfg, pool, urls, tmp)


def find(rows: Sequence[Row], **match: Any) -> Row | None:
    return next((r for r in rows if all(getattr(r, k) == v for k, v in match.items())), None)


def summarize(rows: Sequence[Row], cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {"units": "MB = 10**6 bytes; medians over repeats",
                           "state_bytes": {r.size: r.state_bytes for r in rows}}
    for key in ("save_mb_per_s", "restore_mb_per_s", "baseline_save_mb_per_s", "baseline_restore_mb_per_s",
                "speedup_vs_savez", "speedup_vs_tf_checkpoint", "restore_speedup_vs_np_load", "save_vs_best_baseline",
                "save_vs_disk_floor", "restore_vs_tf_read", "restore_vs_disk_floor", "restore_vs_best_cold_read",
                "async_stall_ms", "memcpy_ms", "stall_vs_memcpy"):
        out[key] = {}
    for store, size in itertools.product(cfg.stores, map(bc.size_label, cfg.sizes_mb)):
        def put(key: str, value: Any) -> None:
            out[key].setdefault(store, {})[size] = value

        mine = [r for r in rows if (r.store, r.size) == (store, size)]
        for r in (r for r in mine if r.method not in OURS and r.op in ("save", "restore")):
            put(f"baseline_{r.op}_mb_per_s", {**out[f"baseline_{r.op}_mb_per_s"].get(store, {}).get(size, {}),
                                              r.method: r.mb_per_s.median})
        if saves := [r for r in mine if r.method == OURS[0]]:
            best = min(saves, key=lambda r: r.seconds.median)
            put("save_mb_per_s", {**{str(r.writers): r.mb_per_s.median for r in saves},
                                  "best": best.mb_per_s.median, "best_writers": best.writers})
            for key, method in (("speedup_vs_savez", SAVEZ.get(store, ("",))[0]), ("speedup_vs_tf_checkpoint", TF[0])):
                if base := find(mine, method=method):
                    put(key, base.seconds.median / best.seconds.median)
        if restores := [r for r in mine if r.method == OURS[1]]:
            put("restore_mb_per_s", {f"{r.writers}->{r.readers}": r.mb_per_s.median for r in restores})
        if store == "local" and saves and restores:  # ratios of medians, > 1: ckpt_service is faster
            base = {r.method: r.seconds.median for r in mine}
            for key, methods, ours in (("save_vs_best_baseline", (SAVEZ["local"][0], TF[0]), best),
                                       ("save_vs_disk_floor", FLOOR[:1], best), ("restore_vs_tf_read", TF[1:], None),
                                       ("restore_vs_disk_floor", FLOOR[1:], None),
                                       ("restore_vs_best_cold_read", (FLOOR[1], FILES[1]), None)):
                if times := [base[m] for m in methods if m in base]:
                    put(key, min(times) / (ours or min(restores, key=lambda r: r.seconds.median)).seconds.median)
            if base := find(mine, method=SAVEZ.get(store, ("", ""))[1]):
                put("restore_speedup_vs_np_load", base.seconds.median / min(r.seconds.median for r in restores))
    for size in map(bc.size_label, cfg.sizes_mb):
        if memcpy := find(rows, size=size, op="memcpy"):
            out["memcpy_ms"][size] = memcpy.seconds.median * 1000
        for r in (r for r in rows if r.size == size and r.op == "stall"):
            out["async_stall_ms"].setdefault(size, {})[str(r.writers)] = r.seconds.median * 1000
            if memcpy:
                out["stall_vs_memcpy"].setdefault(size, {})[str(r.writers)] = r.seconds.median / memcpy.seconds.median
    return out


def _rate(row: Row | None) -> str:
    return "-" if row is None else row.mb_per_s.text("{:,.0f}")


def restore_table(rows: Sequence[Row], cfg: Config) -> str:
    """Restore MB/s per N writers -> M readers, and the baselines' reads where they ran (TF, disk: local only)."""
    combos = [(w, r) for w in cfg.writers for r in cfg.readers]
    base = {"np.load": None, "tf read": TF[1], "1 file (disk, cold)": FLOOR[1], "4 MiB files (cold)": FILES[1]}
    body = []
    for size, store in itertools.product(map(bc.size_label, cfg.sizes_mb), cfg.stores):
        mine = [r for r in rows if (r.store, r.size) == (store, size)]
        body.append([size, STORE_NAMES[store], *(_rate(find(mine, method=OURS[1], writers=w, readers=r))
                                                 for w, r in combos),
                     *(_rate(find(mine, method=m or SAVEZ[store][1])) if store == "local" or m is None else "n/a"
                       for m in base.values() if cfg.baselines)])
    return bc.markdown_table(["state", "store", *(f"{w}->{r}" for w, r in combos), *(base if cfg.baselines else ())],
                             body)


def readme_tables(rows: Sequence[Row], cfg: Config) -> str:
    """Save MB/s, restore MB/s (N writers -> M readers) and the async stall, as markdown."""
    def ms(row: Row | None) -> str:
        return "-" if row is None else bc.spread([s * 1000 for s in row.seconds.samples]).text("{:,.0f}")

    sizes = list(map(bc.size_label, cfg.sizes_mb))
    plural = {w: f"{w} writer{'s' * (w > 1)}" for w in cfg.writers}
    save_body, stall_body = [], []
    for size, store in itertools.product(sizes, cfg.stores):
        mine = [r for r in rows if (r.store, r.size) == (store, size)]
        ours = [find(mine, method=OURS[0], writers=w) for w in cfg.writers]
        base, best = find(mine, method=SAVEZ[store][0]), min(filter(None, ours), key=lambda r: r.seconds.median)
        save_body.append([size, STORE_NAMES[store], *map(_rate, ours), _rate(base),
                          _rate(find(mine, method=TF[0])) if store == "local" else "n/a (1)",
                          *(_rate(find(mine, method=m[0])) for m in (FLOOR, FILES)),
                          f"x{base.seconds.median / best.seconds.median:.2f}" if base else "-"])
    for size in sizes:
        memcpy, stalls = find(rows, size=size, op="memcpy"), [find(rows, size=size, op="stall", writers=w)
                                                              for w in cfg.writers]
        stall_body.append([size, ms(memcpy), *map(ms, stalls),
                           f"{stalls[0].seconds.median / memcpy.seconds.median:.2f}" if stalls[0] and memcpy else "-",
                           *(f"{r.extra['snapshot_share_max']:.0%}" if r else "-" for r in stalls[1:])])
    out = ["**Save** (MB/s, median (min-max) over repeats; time from a barrier to the commit being visible)", "",
           bc.markdown_table(["state", "store", *(f"ckpt_service, {plural[w]}" for w in cfg.writers), "np.savez",
                              "tf.train.Checkpoint", "1 file (disk)", "4 MiB files", "best vs np.savez"],
                             save_body), "",
           "For GCS, np.savez means np.savez into memory plus one upload with the plain client. "
           "(1) tf.train.Checkpoint cannot write gs:// on the emulator. Disk floors: the same bytes as one fsynced "
           "file, and as fsynced 4 MiB files by 8 threads (the service's file pattern), through the local store.", "",
           "**Restore** (MB/s; N writers -> M reader processes, each reading its share with "
           "`partition=(rank, M)`; checked bit-exact)", "", restore_table(rows, cfg), ""]
    if cfg.async_stall:
        out += ["**Async stall** (ms the caller is blocked by `save_async`, the snapshot; slowest rank) against "
                "`np.copy` of the whole state", "",
                bc.markdown_table(["state", "np.copy", *(f"stall, {plural[w]}" for w in cfg.writers),
                                   f"stall / np.copy ({plural[cfg.writers[0]]})",
                                   *(f"share copied, {plural[w]}" for w in cfg.writers[1:])], stall_body), ""]
    return "\n".join(out)


def state_parser(name: str, description: str, *, sizes: tuple[float, ...], readers: bool = True,
                 large_repeats: int = 2, large_mb: float = 1000.0, **options: bool) -> argparse.ArgumentParser:
    """:func:`bench.common.parser` with the options of a benchmark of states in shared memory."""
    p = bc.parser(name, description, **options)
    p.add_argument("--sizes-mb", type=bc.csv_list(float), default=sizes, help="state sizes in MB (10**6 bytes)")
    p.add_argument("--writers", type=bc.csv_list(int), default=(1, 2, 4), help="writer process counts")
    if readers:
        p.add_argument("--readers", type=bc.csv_list(int), default=(1, 2, 4), help="reader process counts")
    p.add_argument("--stores", type=bc.csv_list(str, ("local", "gcs")), default=("local", "gcs"))
    p.add_argument("--repeats", type=bc.positive_int, default=3, help="repeats per measurement")
    p.add_argument("--large-repeats", type=bc.positive_int, default=large_repeats, help="... of a large state")
    p.add_argument("--large-mb", type=float, default=large_mb, help="what counts as a large state")
    p.add_argument("--io-threads", type=bc.positive_int, default=8, help="CheckpointManager io_threads per process")
    return p


def config(args: argparse.Namespace, **fields: Any) -> Config:
    """The Config of :func:`state_parser`'s arguments; ``fields`` set the rest."""
    return Config(args.sizes_mb, tuple(sorted(args.writers)), tuple(sorted(getattr(args, "readers", ()))),
                  fields.pop("stores", args.stores), fields.pop("baselines", ()), args.repeats, args.large_repeats,
                  args.large_mb, args.io_threads, seed=args.seed, **fields)


def main(argv: Sequence[str] | None = None) -> int:
    p = state_parser("ckpt_io", __doc__, sizes=(10.0, 100.0, 1000.0), plot=False)
    p.add_argument("--baselines", type=bc.csv_list(str, BASELINES), default=BASELINES, help="tf, floor: local only")
    p.add_argument("--no-async", dest="async_stall", action="store_false", help="skip the save_async stall runs")
    args = p.parse_args(argv)
    cfg = config(args, baselines=args.baselines, async_stall=args.async_stall)
    rows, elapsed, machine = bc.measured("ckpt_io", lambda tmp: run(cfg, tmp), args.tmpdir)
    print(f"\n{(tables := readme_tables(rows, cfg))}")
    notes = ["save: from a barrier to the commit marker written; restores checked bit-exact, local reads cold; the "
             "local store fsyncs every object, so do the baselines; the async stall (the snapshot) is measured locally",
             "tf.train.Checkpoint cannot write gs:// on the emulator (TensorFlow's GCS filesystem ignores it)"]
    return bc.publish(args.out, name="ckpt_io", summary=summarize(rows, cfg), rows=[r.as_dict() for r in rows],
                      params=asdict(cfg), notes=notes, machine=machine, elapsed=elapsed, markdown=tables, plot=None)


if __name__ == "__main__":
    sys.exit(main())
