"""``hvd-transient bench NAME [ARGS...]``: run a benchmark script from ``bench/`` in the source checkout.

``NAME`` is the script's file name with dashes for underscores (``ckpt-io`` runs
``bench/ckpt_io.py``); ``ARGS`` are passed to it unchanged. ``bench all`` runs every
benchmark in :data:`BENCHES` with its defaults, ``bench list`` lists them.

The scripts are not part of the installed package: they are found relative to this
module, which works for an editable install (``pip install -e .``, ``make setup``).
Each runs in its own interpreter (the same one as this command), so it can spawn
worker processes of its own.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

from hvd_transient.cli import UsageError, command

PROG = "hvd-transient bench"

#: what ``bench all`` runs, in this order (names as typed on the command line)
BENCHES: tuple[str, ...] = ("ckpt-io", "ckpt-overhead", "emergency-save", "preemption-cost", "restore")

#: modules in bench/ that are not benchmarks
_NOT_BENCHES = frozenset({"common", "conftest"})


class BenchNotFoundError(LookupError):
    """The benchmark (or the bench/ directory itself) does not exist."""


def bench_dir() -> Path:
    """``bench/`` of the checkout this package was installed from (editable install)."""
    return Path(__file__).resolve().parent.parent / "bench"


def script_name(name: str) -> str:
    """``ckpt-io`` -> ``ckpt_io.py``. Rejects anything that is not a plain name."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise BenchNotFoundError(f"{name!r} is not a benchmark name (letters, digits, '-' or '_')")
    return name.replace("-", "_") + ".py"


def available(directory: Path | None = None) -> list[str]:
    """Every benchmark script present in ``bench/``, as command-line names."""
    directory = directory or bench_dir()
    return sorted(p.stem.replace("_", "-") for p in directory.glob("*.py")
                  if p.stem not in _NOT_BENCHES and not p.stem.startswith("_")
                  and not p.stem.endswith("_worker"))  # scripts the benchmarks launch


def find_script(name: str, directory: Path | None = None) -> Path:
    directory = directory or bench_dir()
    if not directory.is_dir():
        raise BenchNotFoundError(
            f"no bench/ directory at {directory}: the benchmarks live in the source checkout, not in the "
            "installed package. Clone the repository and install it editable (`make setup`, or "
            "`pip install -e '.[gcs,dev]'`), then run `hvd-transient bench` from there.")
    script = directory / script_name(name)
    if script.stem in _NOT_BENCHES or script.stem.endswith("_worker") or not script.is_file():
        names = ", ".join(available(directory)) or "none"
        raise BenchNotFoundError(f"no benchmark named {name!r} in {directory} (available: {names})")
    return script


def run_script(script: Path, args: Sequence[str]) -> int:
    """Run one script with this interpreter from the repository root; return its exit code."""
    cmd = [sys.executable, str(script), *args]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=script.parent.parent, check=False).returncode


USAGE = f"""usage: hvd-transient bench NAME [ARGS...]
       hvd-transient bench all     run every benchmark ({", ".join(BENCHES)}) with its defaults
       hvd-transient bench list    list the benchmarks

Runs bench/<NAME>.py (dashes for underscores) from the source checkout; ARGS go to the
script, e.g. `hvd-transient bench ckpt-io --sizes-mb 10 --repeats 1`. Results are written
to bench/results/. See `hvd-transient bench NAME --help` for a benchmark's options."""


def _no_arguments(what: str, args: Sequence[str], hint: str = "") -> None:
    if args:
        raise UsageError(f"'{what}' takes no arguments, not {' '.join(args)!r}{hint}")


def _list(args: Sequence[str] = ()) -> int:
    _no_arguments("list", args)
    directory = bench_dir()
    if not directory.is_dir():
        find_script(BENCHES[0], directory)  # raises the "no bench/ directory" error
    present = set(available(directory))
    for name in BENCHES:
        print(name if name in present else f"{name}  (missing)")
    for name in sorted(present - set(BENCHES)):
        print(f"{name}  (not run by 'all')")
    return 0


def _all(args: Sequence[str]) -> int:
    _no_arguments("all", args, "; it runs every benchmark with its defaults: run one by name to pass options")
    scripts = [(name, find_script(name)) for name in BENCHES]  # all found before any runs
    failed = [name for name, script in scripts if run_script(script, []) != 0]
    if failed:
        print(f"{PROG} all: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    """BenchNotFoundError and UsageError become one line and exit 2 in :func:`hvd_transient.cli.run`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not args:
        raise UsageError(f"name a benchmark, 'all' or 'list' (see '{PROG} --help')")
    name, rest = args[0], args[1:]
    if name == "list":
        return _list(rest)
    if name == "all":
        return _all(rest)
    return run_script(find_script(name), rest)
