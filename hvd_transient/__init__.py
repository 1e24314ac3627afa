"""hvd-transient: preemption-safe Horovod elastic training on transient (spot) VMs.

The training side: notice watchers (``watchers``), the per-step protocol
(``transient``), the Keras integration (``keras``, which imports TensorFlow and
Horovod), host discovery and cluster launch, the event log and the run report.
Importing this package imports neither TensorFlow nor Horovod.
"""
__version__ = "0.1.0"
