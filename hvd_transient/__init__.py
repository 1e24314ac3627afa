"""hvd-transient: preemption-safe Horovod elastic training on transient (spot) VMs.

The packages, from the commands down (each imports only those below it; the layers are
import-linter contracts in ``pyproject.toml``, walked through in ``docs/architecture.md``):

* ``cli`` - the ``hvd-transient`` console script; ``worker`` and ``mpi_collectives`` keep
  documented paths;
* ``testing`` - the local transient cluster, the metadata emulator, schedules, traces, the demo;
* ``cluster`` (GCE spot clusters and the keeper) and ``report`` (a run's analysis);
* ``keras`` - the Keras integration (imports TensorFlow and Horovod);
* ``join`` - a new VM's way into the ring: standby worker, launcher hand-off;
* ``discovery`` (host discovery for ``horovodrun``) and ``collectives`` (Horovod, mpi4py);
* ``core`` - the framework-free per-step protocol: notices, agreement, emergency save,
  election, leaving records, stop control;
* ``telemetry`` (typed events and the event log) and ``watchers`` (cloud preemption notices);
* ``gcp`` (Compute REST client, GCE constants, prices), ``store_keys``, ``commandline``.

Importing this package, its CLI or ``core`` imports neither TensorFlow nor Horovod.
"""
__version__ = "0.1.0"
