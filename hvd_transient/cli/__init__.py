"""The ``hvd-transient`` console script: one dispatcher over the subcommands.

Each subcommand lives beside what it drives, with a ``main(argv) -> int``, and is
imported only when used, so fast paths (host discovery runs every second under
``horovodrun``) never pay for TensorFlow, zarr or cloud clients. The conventions
they share (one-line errors, exit statuses, argument types) are
:mod:`hvd_transient.commandline`.
"""
from __future__ import annotations

import importlib
import logging
import sys
import warnings
from typing import Sequence

from hvd_transient.commandline import EXIT_USAGE, PROG, run

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "ckpt": ("hvd_transient.cli.ckpt", "inspect, verify, garbage-collect and export checkpoints"),
    "metadata-emulator": ("hvd_transient.testing.metadata_emulator", "run a GCE metadata-server emulator"),
    "discover": ("hvd_transient.discovery.cli", "print host:slots lines for horovodrun --host-discovery-script"),
    "cluster": ("hvd_transient.cluster.cli", "create, inspect and delete a GCE spot training cluster"),
    "demo": ("hvd_transient.testing.demo", "run the local transient-cluster demo"),
    "report": ("hvd_transient.report", "timeline, cost and checkpoint report of a run"),
    "stop": ("hvd_transient.cli.stop", "ask a running job to checkpoint and stop cleanly"),
    "ready": ("hvd_transient.cli.ready", "publish this VM as ready to join (its startup script runs it)"),
    "bench": ("hvd_transient.cli.bench", "run the benchmarks in bench/"),
}


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
