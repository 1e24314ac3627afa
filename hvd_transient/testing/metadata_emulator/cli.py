"""``hvd-transient metadata-emulator``: run the emulator until SIGINT or SIGTERM.

Each instance is reached under ``/i/<name>/``; any other path is answered by the default
instance, the first of ``--instances`` (``default`` in ``GET /control/instances``). The
Host header never selects an instance, so aliases of 127.0.0.1 all reach the default one.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Sequence

from hvd_transient.commandline import ArgumentParser, UsageError, command, port

from .server import MetadataEmulator

log = logging.getLogger(__name__)

PROG = "hvd-transient metadata-emulator"


def instance_names(text: str) -> list[str]:
    """argparse type: a comma-separated list of distinct instance names, at least one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected at least one instance name, not {text!r}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(map(repr, repeated))} more than once")
    return names  # the registry checks each name itself (EmulatorError, exit 2)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Serve GCE metadata, AWS IMDSv2 and Azure Scheduled Events for several "
                    "virtual instances, with a JSON control API under /control/ to preempt them, "
                    "set maintenance events and inject faults.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; keep it on loopback)")
    parser.add_argument("--port", type=port, default=0, help="port (default 0: any free port)")
    parser.add_argument("--instances", type=instance_names, default="instance-1",
                        help="comma-separated instance names, e.g. localhost,127.0.0.1,127.1. "
                             "Requests under /i/<name>/ are answered by that instance; every other "
                             "request by the default instance, the first named here (whatever the Host "
                             "header says; 'default' in GET /control/instances)")
    return parser


def _start(emu: MetadataEmulator, host: str, port_number: int) -> MetadataEmulator:
    try:
        return emu.start()
    except OSError as exc:  # unknown host, address in use, not ours to bind: the arguments must change
        reason = exc.strerror or str(exc)
        raise UsageError(f"cannot listen on {host}:{port_number}: {reason}; pick another --host or --port") from None


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names: list[str] = args.instances
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    emu = _start(MetadataEmulator(instances=names, port=args.port, host=args.host), args.host, args.port)
    try:
        print(emu.url, flush=True)
        for name in names:
            print(f"  {name}: GCE_METADATA_HOST={emu.metadata_host(name)}", flush=True)
        print(f"  default instance {emu.registry.default} (paths without /i/<name>): "
              f"GCE_METADATA_HOST={emu.metadata_host()}", flush=True)
        print(f"  control: {emu.url}/control/instances", flush=True)
        stop.wait()
    finally:
        emu.stop()
    return 0
