"""``hvd-transient stop RUN_URL``: ask a running job to checkpoint and stop (:mod:`hvd_transient.core.control`)."""
from __future__ import annotations

import sys
from typing import Sequence

from ckpt_service.stores import open_store
from hvd_transient.commandline import ArgumentParser, command, existing_store_url
from hvd_transient.core.control import request_stop

PROG = "hvd-transient stop"


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description="Ask a running job to checkpoint and stop cleanly.")
    # an existing store only: writing the request to a mistyped path would create it and stop nothing
    p.add_argument("url", type=existing_store_url,
                   help="the run's store URL (what the job was given as --store)")
    p.add_argument("--reason", default="operator request", help="recorded with the request")
    args = p.parse_args(argv)
    request_stop(open_store(args.url), args.reason)
    print(f"stop requested for {args.url}; the job stops at its next check", file=sys.stderr)
    return 0
