"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os

# Nothing in the tests may probe the real GCE metadata address.
os.environ.setdefault("NO_GCE_CHECK", "true")

from gcs_emulator import gcs_emulator_session  # noqa: E402,F401  (session fixture for every module)
