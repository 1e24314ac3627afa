"""Benchmarks: ``python -m bench.<name>``; :mod:`bench.common` is the harness, ``*_worker`` modules run under them."""
