"""``hvd-transient report RUN_URL``: timeline, preemptions, checkpoint cost and money of a run.

RUN_URL is the ``--store`` the run wrote to (a directory, ``file://``, ``gs://``);
the report reads the event log every worker wrote under ``events/`` there::

    hvd-transient report gs://bucket/runs/r1 --json report.json --plot report.png \\
        --instance-type n1-standard-8+nvidia-tesla-t4

The analysis (:mod:`.analysis`) and the cost model (:mod:`.costs`) are pure; this
module only reads the store and writes the outputs.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlparse

from hvd_transient.commandline import ArgumentParser, command, output_file
from hvd_transient.report.analysis import analyze
from hvd_transient.report.costs import DEFAULT_INSTANCE_TYPE, CostEstimate, estimate_costs
from hvd_transient.report.run_analysis import NoEventsError, RunAnalysis
from hvd_transient.telemetry.parsing import ParsedLog
from hvd_transient.telemetry.schema import EventBody, Record

log = logging.getLogger(__name__)

PROG = "hvd-transient report"


class ReportError(RuntimeError):
    """The report cannot be made (no event log, bad price file, unknown instance type...)."""
    cli_exit_status = 2  # the command line or configuration must change


def no_events_message(url: str) -> str:
    return f"no event log under {url}: is this the --store of a run?"


def load_events(url: str) -> ParsedLog:
    """Every event of the run at ``url``, typed, and those skipped as unreadable; ReportError if there
    are none at all."""
    from ckpt_service.errors import CheckpointError
    from ckpt_service.stores import open_store
    from hvd_transient.telemetry.events import read_log

    parsed = urlparse(url)
    if parsed.scheme in ("", "file") and not Path(parsed.path if parsed.scheme else url).expanduser().is_dir():
        raise ReportError(no_events_message(url))  # never create a directory for a mistyped path
    try:
        events = read_log(open_store(url))
    except (CheckpointError, OSError) as exc:
        raise ReportError(f"cannot read the event log under {url}: {exc}") from None
    if not events.records and not events.skipped:
        raise ReportError(no_events_message(url))
    return events


def build(events: ParsedLog | Sequence[Record[EventBody] | Mapping[str, Any]], *,
          instance_type: str = DEFAULT_INSTANCE_TYPE, prices: str | None = None,
          driver_instance_type: str | None = None) -> tuple[RunAnalysis, CostEstimate]:
    from hvd_transient.gcp.pricing import PriceTableError, load_price_table

    try:
        analysis = analyze(events)
    except NoEventsError as exc:
        raise ReportError(str(exc)) from None
    try:
        cost = estimate_costs(analysis, load_price_table(prices), instance_type, driver_instance_type)
    except PriceTableError as exc:
        raise ReportError(str(exc)) from None
    return analysis, cost


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Timeline, preemptions, checkpoint cost and money of a run, read from the event log "
                    "its workers wrote under RUN_URL/events/.",
        epilog="The cost compares this run on spot VMs with the same VM-seconds on demand and with one "
               "on-demand VM doing the whole job in the sum of the workers' seconds.")
    p.add_argument("url", metavar="RUN_URL", help="the run's --store: directory, file:///dir or gs://bucket/prefix")
    # output paths are checked before the (possibly remote) event log is read
    p.add_argument("--json", metavar="PATH", type=output_file, help="also write a machine-readable report here")
    p.add_argument("--plot", metavar="PATH", type=output_file,
                   help="also draw the run (worker lifetimes, steps) into this PNG")
    p.add_argument("--instance-type", metavar="NAME", default=DEFAULT_INSTANCE_TYPE,
                   help=f"price-table name of each worker VM (default {DEFAULT_INSTANCE_TYPE}; "
                        "e.g. icac19/K80, g2-standard-8, n1-standard-8+2xnvidia-tesla-v100)")
    p.add_argument("--driver-instance-type", metavar="NAME",
                   help="also bill an on-demand driver VM of this type for the wall time (e.g. n1-standard-4)")
    p.add_argument("--prices", metavar="FILE",
                   help="price JSON that adds to / overrides the packaged table (default: $HVDT_PRICES)")
    return p


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    """ReportError (and PlotUnavailableError) become one line and exit 2 in :func:`hvd_transient.commandline.run`."""
    args = parser().parse_args(argv)
    analysis, cost = build(load_events(args.url), instance_type=args.instance_type, prices=args.prices,
                           driver_instance_type=args.driver_instance_type)
    from hvd_transient.report.render import render_text, to_json

    sys.stdout.write(render_text(analysis, cost))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(analysis, cost), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from hvd_transient.report.plot import plot_run

        plot_run(analysis, args.plot)
        print(f"wrote {args.plot}")
    return 0


__all__ = ["ReportError", "build", "load_events", "main", "no_events_message", "parser"]
