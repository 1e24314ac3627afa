"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os
import signal

import pytest

# The store suite ships in the package; its asserts still get pytest's detailed messages.
pytest.register_assert_rewrite("ckpt_service.testing.store_conformance")

# Nothing in the tests may probe the real GCE metadata address.
os.environ.setdefault("NO_GCE_CHECK", "true")

# Horovod's background loop wakes every HOROVOD_CYCLE_TIME ms (default 1) and, over Gloo, talks to
# every rank even when idle: three or four ranks on a 2-core machine spend half a core in syscalls.
# A 10 ms cycle gives that CPU back to the work the end-to-end tests wait for.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "10")

# A suite started in the background by a shell without job control (`make test &`) inherits
# SIGINT ignored, and so would every process it starts; the tests that send SIGINT need its
# default action in those processes (a handler, unlike SIG_IGN, is reset by exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def hvd():
    """Horovod's Keras API in a world of one (this test process, rank 0), for tests that compile with it."""
    import horovod.tensorflow.keras as hvd

    hvd.init()
    return hvd


from gcs_emulator import gcs_emulator_session  # noqa: E402,F401  (session fixture for every module)
