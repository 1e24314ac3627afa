"""Benchmarks: ``python -m bench.<name>``; :mod:`bench.common` is the harness, ``*_worker`` run under them."""
