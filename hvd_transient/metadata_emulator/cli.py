"""``hvd-transient metadata-emulator``: run the emulator until SIGINT or SIGTERM."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Sequence

from .server import MetadataEmulator

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-transient metadata-emulator",
        description="Serve GCE metadata, AWS IMDSv2 and Azure Scheduled Events for several "
                    "virtual instances, with a JSON control API under /control/ to preempt them, "
                    "set maintenance events and inject faults.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; keep it on loopback)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    parser.add_argument("--instances", default="instance-1",
                        help="comma-separated instance names, e.g. localhost,127.0.0.1,127.1; "
                             "the first is the default instance")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.instances.split(",") if n.strip()]
    if not names:
        print("metadata-emulator: --instances needs at least one name", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with MetadataEmulator(instances=names, port=args.port, host=args.host) as emu:
        print(emu.url, flush=True)
        for name in names:
            print(f"  {name}: GCE_METADATA_HOST={emu.metadata_host(name)}", flush=True)
        print(f"  control: {emu.url}/control/instances", flush=True)
        stop.wait()
    return 0
