"""The protocol's collectives over Horovod (``horovod``) or mpi4py (``mpi``), independent of each other."""
