"""What every framework frontend (:mod:`hvd_transient.keras`, :mod:`hvd_transient.torch`) does alike,
framework-free: the collectives' JSON framing over a Horovod binding, the data position a state carries,
the global sample stream, the snapshot of a rank's share of named host tensors, where a loop resumes, a
run's checkpoint metadata and cold restore, and the session that drives the per-step protocol
(:mod:`hvd_transient.core.transient`) for a frontend.

A frontend keeps only what its framework needs: how its tensors reach host memory, its optimizer's
state, its learning rate, and the hooks of its training loop.
"""
