"""``horovodrun`` (Horovod's launcher), started from a main module that imports nothing at its top, and
asking Horovod's build probe once per install instead of at every launch.

Horovod runs each command of a job through a middleman process that it starts with multiprocessing's *spawn*:
in an elastic job, the host-discovery script every second, and each worker. A spawned child runs its parent's
main module again, and the ``horovodrun`` console script imports Horovod's launcher at its top: 0.15-0.25
CPU-s per child on these machines. And at every launch, horovodrun asks whether Horovod was built with Gloo
(or MPI) in a forked process that imports TensorFlow: about 3 CPU-s, which a local cluster pays again at every
relaunch, though the answer cannot change until Horovod is installed again. Together they were a fifth of
the CPU that the end-to-end tests spent (docs/reliability.md, "The suite's time").
"""
import os
import sys
from typing import Any, Callable

#: how to start ``horovodrun``: append its arguments
HOROVODRUN = (sys.executable, os.path.abspath(__file__))


def _probe_once() -> None:
    """Horovod's own build probes (``gloo_built``, ``mpi_built``), each run at the first launch that asks it
    after Horovod was installed; later launches read the answer from a file among the machine's temporary
    files."""
    import hashlib
    import json
    import tempfile

    import horovod
    from horovod.runner import launch

    package = os.path.dirname(horovod.__file__)
    where = hashlib.sha256(package.encode()).hexdigest()[:12]
    cache = os.path.join(tempfile.gettempdir(),
                         f"hvdt-horovod-build-{horovod.__version__}-{os.stat(package).st_mtime_ns}-{where}.json")

    def answers() -> dict[str, bool]:
        try:
            with open(cache) as f:
                said = json.load(f)
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in said.items() if isinstance(v, bool)} if isinstance(said, dict) else {}

    def cached(name: str, probe: Callable[..., Any]) -> Callable[..., bool]:
        def built(verbose: bool = False) -> bool:
            known = answers()
            if name not in known:
                known[name] = bool(probe(verbose=verbose))
                tmp = f"{cache}.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(known, f)
                os.replace(tmp, cache)  # a launch beside this one reads one whole file or none
            return known[name]
        return built

    launch.gloo_built = cached("gloo", launch.gloo_built)
    launch.mpi_built = cached("mpi", launch.mpi_built)


if __name__ == "__main__":
    _probe_once()
    from horovod.runner.launch import run_commandline

    sys.exit(run_commandline())
