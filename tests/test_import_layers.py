"""Importing the package, its console script and every subcommand loads neither TensorFlow nor Horovod.

Host discovery runs every second under horovodrun and the keeper's commands run on machines
without a training stack, so only the Keras integration and the collectives may pull them in.
The import layers themselves are import-linter contracts (pyproject.toml, run by ``make test``).
"""
from __future__ import annotations

import json
import subprocess
import sys

from hvd_transient.cli import SUBCOMMANDS

FRAMEWORKS = ("tensorflow", "horovod", "mpi4py", "keras")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from hvd_transient.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""

LIGHT = ("hvd_transient", "hvd_transient.cli", "hvd_transient.worker", "hvd_transient.core.transient",
         "hvd_transient.join.standby", "hvd_transient.discovery.cli", "hvd_transient.cluster.keeper")


def loaded_top_level(modules: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_package_cli_and_protocol_load_no_training_framework() -> None:
    modules = [*LIGHT, *sorted({module for module, _help in SUBCOMMANDS.values()})]
    loaded = loaded_top_level(modules)
    assert "hvd_transient" in loaded and "ckpt_service" in loaded  # the probe did import them
    assert not loaded & set(FRAMEWORKS), f"importing {modules} loaded {sorted(loaded & set(FRAMEWORKS))}"


def test_the_probe_sees_a_framework_when_one_is_imported() -> None:
    # the same probe on a module that does need TensorFlow: the check above can fail
    assert "tensorflow" in loaded_top_level(["hvd_transient.keras.snapshot"])
