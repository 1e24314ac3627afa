"""Benchmarks of hvd-transient and ckpt_service: ``python -m bench.<name>`` from the repository root.

:mod:`bench.common` is the harness; every other module without a leading underscore or a
``_worker`` suffix is one benchmark (``hvd-transient bench list``).
"""
