"""Helpers shared by every benchmark in ``bench/``.

A benchmark script measures some samples, then calls:

* :func:`spread` to reduce repeats to a median and a min/max range;
* :func:`print_table` to show a table (``rich`` if it is installed, plain text otherwise)
  and :func:`markdown_table` for the README;
* :func:`write_results` to write ``bench/results/<name>.json`` with ``summary``,
  ``machine``, ``params`` and ``rows`` objects;
* :func:`plot_panels` to draw grouped bar charts into a PNG (matplotlib, Agg backend).

Scripts are run as files (``python bench/<name>.py`` or ``hvd-transient bench <name>``),
so they import this module as ``common``.

Units: 1 MB = 10**6 bytes everywhere in the benchmarks.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
MB = 1_000_000


class BenchError(RuntimeError):
    """A benchmark could not run as asked (bad arguments, a missing tool, a failed measurement)."""


# --------------------------------------------------------------------------- command-line values


def csv_list(kind: type, allowed: Sequence[Any] | None = None) -> Callable[[str], tuple[Any, ...]]:
    """An argparse type: a comma-separated list of ``kind`` (numbers must be positive), duplicates dropped."""
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        if allowed is not None and (bad := [v for v in values if v not in allowed]):
            raise argparse.ArgumentTypeError(f"unknown value(s) {bad}; choose from {', '.join(map(str, allowed))}")
        if kind in (int, float) and any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: values must be positive")
        return tuple(dict.fromkeys(values))
    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of seconds")
    return value


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    n: int
    samples: tuple[float, ...] = field(default=(), repr=False)

    def scaled(self, factor: float) -> "Spread":
        return Spread(self.median * factor, self.min * factor, self.max * factor, self.n,
                      tuple(s * factor for s in self.samples))

    def rate(self, amount: float) -> "Spread":
        """``amount / x`` for every sample (e.g. MB per second from seconds); min and max swap."""
        rates = tuple(amount / s if s > 0 else float("inf") for s in self.samples)
        return spread(rates)

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n,
                "samples": list(self.samples)}


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


def mb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / MB / seconds if seconds > 0 else float("inf")


def fmt_seconds(value: float) -> str:
    if value < 0.01:
        return f"{value * 1000:.2f} ms"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s"


def fmt_spread_s(s: Spread) -> str:
    """``"1.23 s (1.10-1.40)"``; a single sample shows no range."""
    if s.n < 2:
        return f"{fmt_seconds(s.median)} (n=1)"
    return f"{fmt_seconds(s.median)} ({fmt_seconds(s.min)}-{fmt_seconds(s.max)})"


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(*dists: str) -> str | None:
    """Installed version of the first distribution found, without importing it (TF is slow)."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "tensorflow": _version("tensorflow-cpu", "tensorflow"),
        "zarr": _version("zarr"),
        "google_cloud_storage": _version("google-cloud-storage"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": _load_average(),
    }


def _load_average() -> list[float] | None:
    """1/5/15-minute load averages: on a shared machine they say how noisy a run was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_line(info: Mapping[str, Any] | None = None) -> str:
    info = info or machine_info()
    return (f"{info['cpu_model']}, {info['cores']} cores, {info['memory_gib']} GiB RAM, "
            f"Python {info['python']}, numpy {info['numpy']}, TensorFlow {info['tensorflow']}, "
            f"{info['date'][:10]}")


# --------------------------------------------------------------------------- tables


def _plain_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None) -> str:
    cells = [[str(c) for c in columns]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    line = "  ".join("-" * w for w in widths)
    out = [title, ""] if title else []
    out.append("  ".join(c.ljust(w) for c, w in zip(cells[0], widths)))
    out.append(line)
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    return "\n".join(out)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(_plain_table(columns, rows, title), flush=True)
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(str(column))
    for row in rows:
        table.add_row(*(str(v) for v in row))
    Console().print(table)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|")

    out = ["| " + " | ".join(cell(c) for c in columns) + " |",
           "|" + "|".join(" --- " for _ in columns) + "|"]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------- results


def _jsonable(value: Any) -> Any:
    if isinstance(value, Spread):
        return value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None  # JSON has no NaN/inf
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that produced a result, relative to the repo root when possible."""
    args = list(sys.argv if argv is None else argv)
    if args:
        try:
            args[0] = os.path.relpath(Path(args[0]).resolve(), BENCH_DIR.parent)
        except ValueError:
            pass
    return "python " + shlex.join(args)


def write_results(
    path: str | os.PathLike[str],
    *,
    name: str,
    summary: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    params: Mapping[str, Any],
    notes: Sequence[str] = (),
    machine: Mapping[str, Any] | None = None,
) -> Path:
    """Write the results JSON atomically (temporary file + rename) and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "command": command_line(),
        "machine": dict(machine or machine_info()),
        "params": params,
        "summary": summary,
        "notes": list(notes),
        "rows": list(rows),
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(doc), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out)
    return out


def finish_report(out: Path, markdown: str, plot: Callable[[Path], Path | None] | None, elapsed: float) -> int:
    """Write the markdown tables beside the results JSON, draw the plot (None: skipped), say where they went."""
    md = out.with_suffix(".md")
    md.write_text(markdown)
    print(f"\nresults: {out}\ntables:  {md}")
    if plot is not None:
        png = plot(out.with_suffix(".png"))
        if png is not None:
            print(f"plot:    {png}")
    print(f"elapsed: {elapsed:.0f} s", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Panel:
    """One grouped bar chart: ``series[label][i]`` is the bar of that series in ``categories[i]``.

    ``None`` leaves a gap (not measured); ``errors[label][i]`` is an optional ``(low, high)``
    range drawn as an error bar (e.g. the min and max over repeats).
    """

    title: str
    ylabel: str
    categories: tuple[str, ...]
    series: Mapping[str, Sequence[float | None]]
    errors: Mapping[str, Sequence[tuple[float, float] | None]] = field(default_factory=dict)
    log_y: bool = False


def plot_panels(path: str | os.PathLike[str], panels: Sequence[Panel], *, title: str | None = None,
                columns: int = 2) -> Path | None:
    """Draw the panels side by side into a PNG. Returns None (and says so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
        return None
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw_panel(ax: Any, panel: Panel) -> None:
    labels = list(panel.series)
    n = max(1, len(labels))
    width = 0.8 / n
    for i, label in enumerate(labels):
        values = panel.series[label]
        xs = [c + (i - (n - 1) / 2) * width for c in range(len(panel.categories))]
        heights = [v if v is not None else 0.0 for v in values]
        yerr = None
        ranges = panel.errors.get(label)
        if ranges:
            low = [max(0.0, h - r[0]) if r else 0.0 for h, r in zip(heights, ranges)]
            high = [max(0.0, r[1] - h) if r else 0.0 for h, r in zip(heights, ranges)]
            yerr = [low, high]
        ax.bar(xs, heights, width, label=label, yerr=yerr, capsize=2)
    ax.set_xticks(range(len(panel.categories)))
    ax.set_xticklabels(panel.categories)
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    if panel.log_y:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def install_interrupt_handlers() -> None:
    """Turn SIGINT and SIGTERM into KeyboardInterrupt, so a benchmark cleans up its workers,
    emulator and temporary data also when started in the background (where SIGINT is ignored)."""
    import signal

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
