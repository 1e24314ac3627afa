"""Start a Horovod worker, or hand its job to a standby that has already started it on this host.

Horovod's elastic driver starts a joining host's worker only after every current worker has
reset (``HostsUpdatedInterrupt``, ``hvd.shutdown(); hvd.init()``); the survivors' ``hvd.init()``
then waits in the rendezvous for the newcomer, so its whole start-up (interpreter, TensorFlow and
Horovod imports, data, model build and compile, the first step's tracing) stalls the job. Here a
new VM starts a **standby** when it boots, which does all of that *before* the VM is offered to
Horovod, and the job's command, run by ``horovodrun`` on that host, only hands it the job:

``python -m hvd_transient.worker SCRIPT [ARGS...]`` (the launcher, the job's command)
    If a standby of this command waits for this host and slot (a unix socket
    ``$HVDT_STANDBY_DIR/<HOROVOD_HOSTNAME>.<HOROVOD_LOCAL_RANK>.<command key>.sock``, or under the
    machine's host name if Horovod knows the host by IP, the directory defaulting to
    ``<tmp>/hvdt-standby-<uid>``), the launcher sends it its whole
    environment (Horovod's rendezvous variables, rank, ...), its working directory and its
    stdin/stdout/stderr (``socket.send_fds``), forwards SIGTERM, SIGINT and SIGHUP to it, and
    exits as the standby's worker exits (its code, or killed by its signal). Otherwise it runs
    SCRIPT in this process as ``python SCRIPT`` would (``runpy``: ``sys.argv``, ``__main__``).
    The launcher (:mod:`hvd_transient.join.launcher`) imports only the standard library, so it
    costs nothing when no standby exists.

``python -m hvd_transient.worker --standby [--host H] SCRIPT [ARGS...]`` (started at boot)
    Runs SCRIPT with Horovod's initialisation deferred (:mod:`hvd_transient.join.standby`): imports,
    data, model build, compile, ``hvdt.elastic_state`` and a rehearsal of the train step (run
    once in a one-process Horovod world, then undone) all happen now; ``hvd.size()``, ``rank()``
    and ``local_rank()`` answer 1, 0 and ``--local-rank`` meanwhile. The call of the
    ``@hvd.elastic.run`` function publishes the host as ready
    (``hosts/ready/<host>.json`` in ``--store``, read by discovery's join gate,
    :mod:`hvd_transient.discovery.ready`) and blocks until a launcher hands over. Then it takes
    the launcher's environment, working directory and stdio, runs the real ``hvd.init()`` and goes
    on into Horovod's elastic wrapper (notification service, ``state.sync()``, training).

The standby is two processes: a small supervisor that owns the socket
(:mod:`hvd_transient.join.supervisor`), and the worker it forks before anything is imported
(:mod:`hvd_transient.join.standby`). The socket's name carries a digest of the absolute script
path and arguments, so only the job's own command is handed to a standby; a standby that is
still warming up when its launcher arrives is waited for (it is ahead of a cold start), one that
exits before the handoff makes the launcher run the script itself. The messages on the socket
are in :mod:`hvd_transient.join.wire`.

On GCE, ``hvd-transient cluster up --standby 'train.py ARGS' --store gs://...`` makes every
worker's startup script start the standby at boot (a systemd unit, as the user ``horovodrun``
connects as, in ``--job-dir``), and ``cluster keep --job`` with the same options sets
``HVDT_STANDBY_SINCE`` for discovery at each launch; run the job as
``horovodrun ... python -m hvd_transient.worker train.py ARGS``.

This module is the command line; ``python -m hvd_transient.worker`` (:mod:`hvd_transient.worker`) runs its
:func:`main`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn, Sequence

from hvd_transient.core.hostname import default_host
from hvd_transient.join.launcher import launch
from hvd_transient.join.options import StandbyOptions
from hvd_transient.join.supervisor import serve_standby
from hvd_transient.join.wire import StandbyError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hvd_transient.worker",
        description="Run a Horovod worker's script, handing it to this host's pre-warmed standby if one waits; "
        "with --standby, be that standby.")
    parser.add_argument("--standby", action="store_true",
                        help="run SCRIPT up to its @hvd.elastic.run call now, then wait for the job's launcher")
    parser.add_argument("--host", default=None,
                        help="standby: the host name Horovod knows this host by (default $HOROVOD_HOSTNAME, "
                        "else the machine's host name)")
    parser.add_argument("--local-rank", type=int, default=0, help="standby: the slot on the host (default 0)")
    parser.add_argument("--store", default=None,
                        help="standby: run store URL to publish readiness in (default $HVDT_STORE)")
    parser.add_argument("--instance-id", default=None, help="standby: the cloud's id of this VM, for the record")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="standby: do not trace the train step before offering the host")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    return parser


def _standby_main(ns: argparse.Namespace) -> NoReturn:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standby[%(process)d] %(name)s: %(message)s")
    options = StandbyOptions(
        script=ns.script, args=tuple(ns.args),
        host=ns.host or default_host(),
        local_rank=ns.local_rank, store=ns.store or os.environ.get("HVDT_STORE") or None,
        instance_id=ns.instance_id, warmup=ns.warmup)
    try:
        status = serve_standby(options)
    except StandbyError as exc:
        print(f"python -m hvd_transient.worker: error: {exc}", file=sys.stderr)
        sys.exit(2)
    status.end_this_process()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the launcher takes no options of its own: everything from SCRIPT on is the job's
    if not argv or argv[0].startswith("-"):
        ns = build_parser().parse_args(argv)
        if not ns.standby:
            build_parser().error("options are for --standby; the launcher's form is SCRIPT [ARGS...]")
        _standby_main(ns)
    launch(argv[0], argv[1:])


if __name__ == "__main__":
    main()
