"""The framework-free per-step protocol: what every rank does at a step boundary, over whatever
collectives it is given (Horovod, mpi4py, or the tests' in-process fakes).

``transient`` (the step loop, a ring's start) uses ``notice_round`` (one agreement across ranks),
``emergency`` (the emergency save and the election), ``leaving`` (how a VM leaves), ``saves`` and
``background``; below them ``interfaces``, ``ring`` and ``config``, and the pure rules:
``election``, ``membership`` (leaving records), ``control`` (stop requests), ``lr_scaling``,
``data_position``, ``checksums``, ``hostname``. Nothing here imports TensorFlow, Horovod or MPI.
"""
