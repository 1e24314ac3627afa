"""The `hvd-transient` console script.

Each subcommand lives in its own module with a ``main(argv) -> int`` and is
imported only when used, so fast paths (host discovery runs every second under
``horovodrun``) never pay for TensorFlow, zarr or cloud clients.
"""
from __future__ import annotations

import importlib
import logging
import sys
from typing import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "ckpt": ("ckpt_service.cli", "inspect, verify, garbage-collect and export checkpoints"),
    "metadata-emulator": ("hvd_transient.metadata_emulator", "run a GCE metadata-server emulator"),
    "discover": ("hvd_transient.discovery.cli", "print host:slots lines for horovodrun --host-discovery-script"),
    "cluster": ("hvd_transient.cluster.cli", "create, inspect and delete a GCE spot training cluster"),
    "demo": ("hvd_transient.demo", "run the local transient-cluster demo"),
    "report": ("hvd_transient.report", "timeline, cost and checkpoint report of a run"),
    "stop": ("hvd_transient.control", "ask a running job to checkpoint and stop cleanly"),
    "bench": ("hvd_transient.bench_cli", "run the benchmarks in bench/"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: hvd-transient COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, (_m, text) in SUBCOMMANDS.items()]
    lines += ["", "Run 'hvd-transient COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"hvd-transient: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
