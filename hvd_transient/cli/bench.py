"""``hvd-transient bench NAME [ARGS...]``: run a benchmark of ``bench/`` in the source checkout.

``NAME`` is the module's name with dashes for underscores (``ckpt-io`` runs ``python -m
bench.ckpt_io``); ``ARGS`` are passed to it unchanged. ``bench all`` runs every benchmark in
:data:`BENCHES` with its defaults, ``bench list`` lists them.

The benchmarks are not part of the installed package: they are found relative to this
module, which works for an editable install (``pip install -e .``, ``make setup``). Each runs
in its own interpreter (the same one as this command), from the checkout's root so that
``bench`` is importable, and can spawn worker processes of its own.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from hvd_transient.commandline import UsageError, command

log = logging.getLogger(__name__)

PROG = "hvd-transient bench"

#: what ``bench all`` runs, in this order (names as typed on the command line)
BENCHES: tuple[str, ...] = ("ckpt-io", "ckpt-overhead", "commit-scaling", "emergency-save", "preemption-cost",
                            "restore", "scale", "goodput")


class BenchNotFoundError(LookupError):
    """The benchmark (or the bench/ directory itself) does not exist."""
    cli_exit_status = 2  # the command line or configuration must change


def checkout() -> Path:
    """The root of the checkout this package was installed from (editable install)."""
    return Path(__file__).resolve().parents[2]  # hvd_transient/cli/bench.py -> the checkout


def is_benchmark(stem: str) -> bool:
    """Modules of ``bench/`` that are benchmarks: not the harness, nor what the benchmarks launch."""
    return stem != "common" and not stem.startswith("_") and not stem.endswith("_worker")


def available(root: Path | None = None) -> list[str]:
    """Every benchmark present in ``bench/``, as command-line names."""
    return sorted(p.stem.replace("_", "-") for p in ((root or checkout()) / "bench").glob("*.py")
                  if is_benchmark(p.stem))


def find_module(name: str, root: Path | None = None) -> str:
    """``ckpt-io`` -> ``bench.ckpt_io``, once its file is found in ``root/bench``."""
    bench = (root or checkout()) / "bench"
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise BenchNotFoundError(f"{name!r} is not a benchmark name (letters, digits, '-' or '_')")
    if not (bench / "__init__.py").is_file():
        raise BenchNotFoundError(
            f"no bench/ package at {bench}: the benchmarks live in the source checkout, not in the "
            "installed package. Clone the repository and install it editable (`make setup`, or "
            "`pip install -e '.[gcs,dev]'`), then run `hvd-transient bench` from there.")
    stem = name.replace("-", "_")
    if not is_benchmark(stem) or not (bench / f"{stem}.py").is_file():
        names = ", ".join(available(bench.parent)) or "none"
        raise BenchNotFoundError(f"no benchmark named {name!r} in {bench} (available: {names})")
    return f"bench.{stem}"


def run_module(module: str, args: Sequence[str], root: Path | None = None) -> int:
    """``python -m MODULE ARGS`` with this interpreter from the checkout's root; its exit code."""
    cmd = [sys.executable, "-m", module, *args]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=root or checkout(), check=False).returncode


USAGE = f"""usage: hvd-transient bench NAME [ARGS...]
       hvd-transient bench all     run every benchmark ({", ".join(BENCHES)}) with its defaults
       hvd-transient bench list    list the benchmarks

Runs `python -m bench.<NAME>` (dashes for underscores) from the source checkout; ARGS go to
the benchmark, e.g. `hvd-transient bench ckpt-io --sizes-mb 10 --repeats 1`. Results are
written to bench/results/. See `hvd-transient bench NAME --help` for a benchmark's options."""


def _no_arguments(what: str, args: Sequence[str], hint: str = "") -> None:
    if args:
        raise UsageError(f"'{what}' takes no arguments, not {' '.join(args)!r}{hint}")


def _list(args: Sequence[str] = ()) -> int:
    _no_arguments("list", args)
    find_module(BENCHES[0])  # raises the "no bench/ package" error
    present = set(available())
    for name in BENCHES:
        print(name if name in present else f"{name}  (missing)")
    for name in sorted(present - set(BENCHES)):
        print(f"{name}  (not run by 'all')")
    return 0


def _all(args: Sequence[str]) -> int:
    _no_arguments("all", args, "; it runs every benchmark with its defaults: run one by name to pass options")
    modules = [(name, find_module(name)) for name in BENCHES]  # all found before any runs
    failed = [name for name, module in modules if run_module(module, []) != 0]
    if failed:
        print(f"{PROG} all: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    """BenchNotFoundError and UsageError become one line and exit 2 in :func:`hvd_transient.commandline.run`."""
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
    return run_module(find_module(name), rest)
