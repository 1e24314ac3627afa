"""The command-line conventions every subcommand shares.

Bad input is answered the same way everywhere: one line on stderr,
``PROG: error: WHAT WAS WRONG AND WHAT TO DO``, no traceback, and exit status 2
when the command line or configuration has to change (as argparse does) or 1
when the command ran and failed (a corrupt checkpoint, an API that keeps
failing). Three pieces do it:

* :class:`ArgumentParser`, whose usage errors are that one line;
* the argument types below (:func:`non_negative_int`, :func:`existing_store_url`...),
  so a malformed value is refused while parsing, naming the option;
* :func:`run` (and the :func:`command` decorator on each subcommand's ``main``),
  which turns the project's typed errors (any exception whose class sets
  ``cli_exit_status``) into the line and the status. Any other exception is a bug
  and keeps its traceback.

It sits below every package of ``hvd_transient`` (the subcommands' mains live beside
what they drive), and imports nothing heavy: host discovery runs every second.
"""
from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Protocol, Sequence
from urllib.parse import urlparse

log = logging.getLogger(__name__)

PROG = "hvd-transient"
EXIT_FAILURE = 1  # the command ran and failed
EXIT_USAGE = 2  # fix the command line or the configuration (argparse's status)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class MainFn(Protocol):
    """A subcommand's ``main``: its arguments (None: ``sys.argv[1:]``) -> exit status."""

    def __call__(self, argv: Sequence[str] | None = None) -> int: ...


class UsageError(ValueError):
    """A bad argument that only shows once it is used (a missing directory, a port in use): exit 2."""

    cli_exit_status = EXIT_USAGE


def exit_status(exc: BaseException) -> int | None:
    """The exit status for one of the project's typed errors; None for anything else (a bug).

    A typed error's class says its status (``cli_exit_status``: 2 when the command line or
    configuration must change, 1 when the command ran and failed), so this module names no
    error class and imports no module to handle one.
    """
    status = getattr(type(exc), "cli_exit_status", None)
    return status if isinstance(status, int) else None


def one_line(text: object) -> str:
    # an API error body or a nested message may span lines; the contract is one line
    return " ".join(str(text).split())


def run(prog: str, main: MainFn, argv: Sequence[str] | None) -> int:
    """Call a subcommand's ``main``, answering the project's typed errors with one line and a status."""
    try:
        return int(main(argv) or 0)
    except Exception as exc:
        status = exit_status(exc)
        if status is None:
            raise  # not a typed error: a bug, which keeps its traceback
        log.debug("%s failed", prog, exc_info=True)  # the traceback stays available at DEBUG
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return status
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
