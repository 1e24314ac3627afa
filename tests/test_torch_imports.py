"""Each frontend loads only its own framework: hvd_transient.torch no TensorFlow (nor the Keras frontend),
hvd_transient.keras no PyTorch, and the layer they share neither."""
from __future__ import annotations

import subprocess
import sys

import pytest


def loaded_after(module: str, *names: str) -> list[str]:
    code = (f"import sys, {module}; "
            f"print(' '.join(n for n in {names!r} if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_torch_frontend_loads_no_tensorflow_nor_the_keras_frontend() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("horovod.torch")
    assert loaded_after("hvd_transient.torch", "tensorflow", "keras", "hvd_transient.keras") == []


def test_the_keras_frontend_loads_no_torch() -> None:
    pytest.importorskip("tensorflow")
    assert loaded_after("hvd_transient.keras", "torch", "hvd_transient.torch") == []


def test_the_shared_layer_loads_no_framework() -> None:
    modules = ["hvd_transient.frontend." + m
               for m in ("collectives", "position", "stream", "share", "resume", "session", "restore")]
    assert loaded_after(", ".join(modules), "tensorflow", "torch", "horovod", "keras") == []
