"""Where this machine's keeper notes its training job's process (a keeper restarted after it was killed
ends the job its predecessor left running), and the lock that keeps a second keeper of the cluster off it."""
from __future__ import annotations

import logging
from pathlib import Path

from hvd_transient.cluster.spec import ClusterSpec, ClusterSpecError

log = logging.getLogger(__name__)


def job_pidfile(spec: ClusterSpec) -> Path:
    """Where this machine's keeper of ``spec`` notes its job's process (a keeper restarted after it was
    killed ends the job it left running before launching its own): ``$HVDT_KEEPER_DIR``, by default
    ``<tmp>/hvdt-keeper-<uid>``."""
    import os

    from hvd_transient.join.user_dirs import user_dir

    return user_dir(os.environ.get("HVDT_KEEPER_DIR"), "hvdt-keeper") / f"{spec.project}.{spec.name}.job"


def claim_job(pidfile: Path, cluster: str) -> int | None:
    """This machine's lock on the cluster's job, held while the keeper runs: a second keeper of the cluster
    would end the first one's job as one left behind. None if it cannot be taken here (no lock, as before)."""
    from hvd_transient.join.user_dirs import ensure_dir, try_lock

    path = pidfile.with_suffix(".lock")
    try:
        ensure_dir(path.parent)
        fd = try_lock(path)
    except OSError as exc:
        log.warning("could not take %s (%s): nothing stops a second keeper of %s here", path, exc, cluster)
        return None
    if fd is None:
        raise ClusterSpecError(f"another 'cluster keep --job' of {cluster} runs on this machine (it holds {path}): "
                               "stop it first, or give this one another --name")
    return fd


__all__ = ["claim_job", "job_pidfile"]
