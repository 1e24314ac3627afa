"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os

import pytest

# The store suite ships in the package; its asserts still get pytest's detailed messages.
pytest.register_assert_rewrite("ckpt_service.testing.store_conformance")

# Nothing in the tests may probe the real GCE metadata address.
os.environ.setdefault("NO_GCE_CHECK", "true")

from gcs_emulator import gcs_emulator_session  # noqa: E402,F401  (session fixture for every module)
