"""The harness around the plugin, not the plugin: what the demo, the tests and the benchmarks run.

- ``metadata_emulator``: an HTTP GCE/AWS/Azure metadata server that can announce preemptions.
- ``local_cluster``: a transient cluster simulated on one machine (host aliases, a VM state file).
- ``schedule``: preemption/return/join schedules for that simulator.
- ``trace_formats``, ``traces``: public spot traces read, and mapped onto that simulator's schedules.
- ``workloads``: the small Keras models and datasets the demo, examples and benchmarks train.
- ``demo``: the local transient-cluster demo (``hvd-transient demo``).

Nothing in the plugin's core (``transient``, ``keras``, ``watchers``, ``discovery``) imports it.
"""
