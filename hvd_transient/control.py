"""Operator control of a running job through its store: ask it to stop cleanly.

``hvd-transient stop RUN_URL`` writes ``control/stop``; the checkpoint master
looks for it at most every ``STOP_POLL_S`` seconds and folds the answer into
the per-step notice collective, so every rank stops at the same step, after
a final checkpoint, and the job exits with success.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Sequence

from ckpt_service.layout import STOP_KEY
from ckpt_service.stores import open_store
from ckpt_service.stores.base import ObjectStore
from hvd_transient.cli import ArgumentParser, command, existing_store_url

PROG = "hvd-transient stop"

STOP_POLL_S = 2.0


def request_stop(store: ObjectStore, reason: str = "operator request") -> None:
    store.put(STOP_KEY, json.dumps({"requested_at": time.time(), "reason": reason}).encode())


def stop_requested(store: ObjectStore) -> bool:
    return store.exists(STOP_KEY)


def clear_stop(store: ObjectStore) -> None:
    store.delete(STOP_KEY)


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
