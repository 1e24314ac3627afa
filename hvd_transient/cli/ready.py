"""``hvd-transient ready``: publish this VM as ready to join the job (the end of its boot).

A worker VM's startup script runs it once the VM can run the job (packages installed, sshd
and the ssh user set up), when the VM starts no standby (a standby publishes its own record
once warm). Discovery's join gate (:mod:`hvd_transient.discovery.ready`) and ``cluster keep
--job`` then offer the VM to Horovod only from that moment, instead of as soon as it is
RUNNING: a worker started on a VM that is still booting fails, and Horovod blacklists its host.
"""
from __future__ import annotations

import socket
import sys
from typing import Sequence

from hvd_transient.commandline import EXIT_FAILURE, ArgumentParser, command, store_url

PROG = "hvd-transient ready"


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description="Publish this VM as ready to join the job "
                       "(hosts/ready/<host>.json in the run store); a worker's startup script runs it.")
    p.add_argument("--store", type=store_url, required=True, help="the run's store URL (the VM's HVDT_STORE)")
    p.add_argument("--host", default=None, help="the VM's host name (default: the machine's)")
    p.add_argument("--instance-id", default=None, help="the cloud's id of this VM (GCE metadata instance/id)")
    args = p.parse_args(argv)
    from ckpt_service.errors import MissingCredentialsError, StoreUnavailableError
    from ckpt_service.stores import open_store
    from hvd_transient.discovery.ready import publish_ready

    host = args.host or socket.gethostname()
    try:
        record = publish_ready(open_store(args.store), host, instance_id=args.instance_id or None)
    except (StoreUnavailableError, MissingCredentialsError, OSError) as exc:
        # the VM boots on: discovery lists it anyway once its join timeout has passed
        print(f"{PROG}: error: could not publish {host} in {args.store}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"{host} is ready to join (at {record.ready_at:.3f}, in {args.store})", file=sys.stderr)
    return 0
