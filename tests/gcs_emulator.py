"""The fake-gcs-server session fixture; the server itself lives in ckpt_service.testing.gcs_emulator."""
from __future__ import annotations

from typing import Iterator

import pytest

from ckpt_service.testing.gcs_emulator import (  # noqa: F401  (re-exported for the tests)
    EmulatorError,
    GCSEmulator,
    fake_gcs_server_binary,
    free_port,
    gcs_emulator,
)


@pytest.fixture(scope="session")
def gcs_emulator_session() -> Iterator[GCSEmulator]:
    """One fake-gcs-server for the whole test session."""
    with gcs_emulator() as emu:
        yield emu
