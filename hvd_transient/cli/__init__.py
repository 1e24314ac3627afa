"""The `hvd-transient` console script, and the command-line conventions every subcommand shares.

Each subcommand lives in its own module with a ``main(argv) -> int`` and is
imported only when used, so fast paths (host discovery runs every second under
``horovodrun``) never pay for TensorFlow, zarr or cloud clients.

Bad input is answered the same way everywhere: one line on stderr,
``PROG: error: WHAT WAS WRONG AND WHAT TO DO``, no traceback, and exit status 2
when the command line or configuration has to change (as argparse does) or 1
when the command ran and failed (a corrupt checkpoint, an API that keeps
failing). Three pieces do it:

* :class:`ArgumentParser`, whose usage errors are that one line;
* the argument types below (:func:`non_negative_int`, :func:`existing_store_url`...),
  so a malformed value is refused while parsing, naming the option;
* :func:`run` (and the :func:`command` decorator on each subcommand's ``main``),
  which turns the project's typed errors into the line and the status. Any other
  exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, NoReturn, Protocol, Sequence
from urllib.parse import urlparse

log = logging.getLogger(__name__)

PROG = "hvd-transient"
EXIT_FAILURE = 1  # the command ran and failed
EXIT_USAGE = 2  # fix the command line or the configuration (argparse's status)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "ckpt": ("hvd_transient.cli.ckpt", "inspect, verify, garbage-collect and export checkpoints"),
    "metadata-emulator": ("hvd_transient.testing.metadata_emulator", "run a GCE metadata-server emulator"),
    "discover": ("hvd_transient.discovery.cli", "print host:slots lines for horovodrun --host-discovery-script"),
    "cluster": ("hvd_transient.cluster.cli", "create, inspect and delete a GCE spot training cluster"),
    "demo": ("hvd_transient.testing.demo", "run the local transient-cluster demo"),
    "report": ("hvd_transient.report", "timeline, cost and checkpoint report of a run"),
    "stop": ("hvd_transient.core.control", "ask a running job to checkpoint and stop cleanly"),
    "ready": ("hvd_transient.cli.ready", "publish this VM as ready to join (its startup script runs it)"),
    "bench": ("hvd_transient.cli.bench", "run the benchmarks in bench/"),
}

class MainFn(Protocol):
    """A subcommand's ``main``: its arguments (None: ``sys.argv[1:]``) -> exit status."""

    def __call__(self, argv: Sequence[str] | None = None) -> int: ...


class UsageError(ValueError):
    """A bad argument that only shows once it is used (a missing directory, a port in use): exit 2."""


# The project's typed errors and their exit statuses, most specific first. They are
# named rather than imported: an error whose module was never imported cannot have
# been raised, so handling one costs the discovery fast path no imports.
TYPED_ERRORS: tuple[tuple[str, str, int], ...] = (
    ("hvd_transient.cli", "UsageError", EXIT_USAGE),  # not __name__: under `python -m` that is __main__
    ("ckpt_service.errors", "CorruptCheckpointError", EXIT_FAILURE),
    ("ckpt_service.errors", "CheckpointError", EXIT_USAGE),
    ("hvd_transient.discovery.errors", "DiscoveryConfigError", EXIT_USAGE),
    ("hvd_transient.discovery.errors", "DiscoveryError", EXIT_FAILURE),
    ("hvd_transient.cluster.spec", "ClusterSpecError", EXIT_USAGE),
    ("hvd_transient.gcp.compute_api", "ComputeAuthError", EXIT_USAGE),
    ("hvd_transient.gcp.compute_api", "ComputeConfigError", EXIT_USAGE),
    ("hvd_transient.gcp.compute_api", "ComputeAPIError", EXIT_FAILURE),
    ("hvd_transient.report", "ReportError", EXIT_USAGE),
    ("hvd_transient.report.plot", "PlotUnavailableError", EXIT_USAGE),
    ("hvd_transient.gcp.pricing", "PriceTableError", EXIT_USAGE),
    ("hvd_transient.testing.schedule", "ScheduleError", EXIT_USAGE),
    ("hvd_transient.cli.bench", "BenchNotFoundError", EXIT_USAGE),
    ("hvd_transient.testing.metadata_emulator.model", "EmulatorError", EXIT_USAGE),
    ("hvd_transient.testing.local_cluster", "ClusterError", EXIT_FAILURE),
)


def _loaded_error_classes() -> list[tuple[type[BaseException], int]]:
    found = []
    for module_name, class_name, status in TYPED_ERRORS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None:
            found.append((cls, status))
    return found


def typed_errors() -> tuple[type[BaseException], ...]:
    """The typed error classes that can have been raised so far (their modules are imported)."""
    return tuple(cls for cls, _status in _loaded_error_classes())


def exit_status(exc: BaseException) -> int | None:
    """The exit status for one of the project's typed errors; None for anything else (a bug)."""
    return next((status for cls, status in _loaded_error_classes() if isinstance(exc, cls)), None)


def one_line(text: object) -> str:
    # an API error body or a nested message may span lines; the contract is one line
    return " ".join(str(text).split())


def run(prog: str, main: MainFn, argv: Sequence[str] | None) -> int:
    """Call a subcommand's ``main``, answering the project's typed errors with one line and a status."""
    try:
        return int(main(argv) or 0)
    # evaluated only once something was raised, see TYPED_ERRORS
    except typed_errors() as exc:
        log.debug("%s failed", prog, exc_info=True)  # the traceback stays available at DEBUG
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return exit_status(exc) or EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def command(prog: str) -> Callable[[MainFn], MainFn]:
    """Decorate a subcommand's ``main`` so that called directly, too, it answers typed errors via :func:`run`."""

    def decorate(main: MainFn) -> MainFn:
        @functools.wraps(main)
        def wrapped(argv: Sequence[str] | None = None) -> int:
            return run(prog, main, argv)

        return wrapped

    return decorate


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line that says where the usage is; exit 2.

    Subparsers made with ``add_subparsers`` are of this class too (argparse uses the parent's).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")


# ---- argument types: each refuses a bad value while parsing, naming it -------------------------


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, not {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: 0, 1, 2... (a step, a count that may be zero)."""
    return _int_at_least(text, 0)


def positive_int(text: str) -> int:
    """argparse type: 1, 2, 3..."""
    return _int_at_least(text, 1)


def _seconds(text: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds {'>=' if zero_ok else '>'} 0, not {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (a timeout)."""
    return _seconds(text, zero_ok=False)


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0 (a grace that may be none)."""
    return _seconds(text, zero_ok=True)


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    value = _int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, not {text!r}")
    return value


def http_url(text: str) -> str:
    """argparse type: an http:// or https:// URL with a host."""
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, not {text!r}")
    return text


def store_url(text: str) -> str:
    """argparse type: a store URL the checkpoint service can open (checked without contacting it)."""
    from ckpt_service.errors import CheckpointError
    from ckpt_service.stores import open_store

    parsed = urlparse(text)
    if parsed.scheme.lower() == "gs" and parsed.netloc:
        return text  # opening a GCS store needs credentials and the network: the syntax is all we check
    try:
        open_store(text)  # local, file:// and memory:// stores touch nothing when opened
    except CheckpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def existing_store_url(text: str) -> str:
    """argparse type: :func:`store_url` whose directory, for a local store, exists.

    Reading a store at a mistyped path would report it empty, and writing to one would
    create it: refuse it instead.
    """
    store_url(text)
    parsed = urlparse(text)
    if parsed.scheme.lower() in ("", "file"):
        path = Path(parsed.path if parsed.scheme else text).expanduser()
        if not path.is_dir():
            raise argparse.ArgumentTypeError(
                f"no store at {text!r}: no such directory; give an existing store's directory, file:///dir "
                "or gs://bucket/prefix")
    return text


def output_file(text: str) -> str:
    """argparse type: a file this command may create or overwrite (its directory exists)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: give a file name in it")
    directory = path.parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {str(directory)!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {str(directory)!r} is not writable")
    return text


# ---- the dispatcher ----------------------------------------------------------------------------


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"usage: {PROG} COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, (_m, text) in SUBCOMMANDS.items()]
    lines += ["", f"Run '{PROG} COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # discover runs every second under horovodrun, whose log would fill with its INFO lines
    quiet = bool(args) and args[0] == "discover"
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # google-api-core warns on every import about the interpreter's support window: noise to an operator,
    # and it would turn a one-line error about a gs:// store into three lines
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"google\.api_core")
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"{PROG}: error: unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)} "
              f"(see '{PROG} --help')", file=sys.stderr)
        return EXIT_USAGE
    module = importlib.import_module(SUBCOMMANDS[name][0])
    # Most subcommands' mains are already wrapped by @command; this also covers those that are not.
    return run(f"{PROG} {name}", module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
