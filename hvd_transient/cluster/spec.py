"""The cluster description and the per-VM plan derived from it. Pure.

One :class:`ClusterSpec` becomes ``workers + 1`` :class:`InstancePlan` s: the
driver (on demand, no GPU, where ``horovodrun`` runs - it must survive every
preemption) and the Spot GPU workers, spread round-robin over the zones.
Every VM carries the labels ``hvdt-cluster=<name>`` and ``hvdt-role=driver|worker``,
which is how ``status``/``down`` find them and how discovery selects workers
(``--label hvdt-cluster=<name> --label hvdt-role=worker``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

CLUSTER_LABEL = "hvdt-cluster"
ROLE_LABEL = "hvdt-role"
DRIVER, WORKER = "driver", "worker"
TERMINATION_ACTIONS = ("STOP", "DELETE")
# Machine families whose GPUs come with the machine type (no guestAccelerators in the request).
BUILT_IN_GPU_FAMILIES = frozenset({"a2", "a3", "a4", "g2", "g4"})

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035, as Compute requires
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")


class ClusterSpecError(ValueError):
    """The cluster description is invalid; the message says which option to fix."""
    cli_exit_status = 2  # the command line or configuration must change


def parse_label_items(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``["team=ml", "a=b,c=d"]`` -> (("a", "b"), ("c", "d"), ("team", "ml"))."""
    labels: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.strip().partition("=")
            if not sep:
                raise ClusterSpecError(f"--label {part!r} must be key=value")
            labels[key] = value
    return tuple(sorted(labels.items()))


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    project: str
    zones: tuple[str, ...]
    workers: int
    machine_type: str = "n1-standard-8"
    gpu_type: str | None = "nvidia-tesla-t4"
    gpus_per_worker: int = 1
    image_family: str = "debian-12"
    image_project: str = "debian-cloud"
    boot_disk_gb: int = 100
    labels: tuple[tuple[str, str], ...] = ()
    termination_action: str = "STOP"
    #: seconds of preemption notice for the Spot workers (GCE ``scheduling.preemptionNoticeDuration``,
    #: a beta field); None: the default 30 s
    preemption_notice_s: int | None = None
    driver_machine_type: str = "n1-standard-4"
    driver_zone: str | None = None  # default: the first zone
    network: str = "global/networks/default"
    subnetwork: str | None = None
    external_ip: bool = True  # the startup script pip-installs from PyPI
    service_account: str = "default"
    scopes: tuple[str, ...] = ("https://www.googleapis.com/auth/cloud-platform",)
    package: str = "hvd-transient"  # pip requirement the startup script installs
    store: str | None = None  # run store URL handed to every VM as metadata
    ssh_user: str = "hvdt"
    ssh_public_key: str | None = None  # "ssh-ed25519 AAAA... comment"
    startup_script: str = field(default="", repr=False)
    startup_script_path: str | None = None  # shown in the gcloud equivalent
    #: the training script and its arguments, as the job runs them (``--standby``): each worker's
    #: startup script starts a standby of it at boot, so a VM that joins a running job is warm
    standby: str | None = None
    #: the job's working directory on every VM, where the standby runs (default the ssh user's home)
    job_dir: str | None = None

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name) or len(self.name) > 40:
            raise ClusterSpecError(
                f"--name {self.name!r}: use lowercase letters, digits and '-', starting with a letter, at most "
                "40 characters (it prefixes the VM names)"
            )
        if not self.project:
            raise ClusterSpecError("--project is required")
        if not self.zones or any(not z for z in self.zones):
            raise ClusterSpecError("--zones needs at least one zone, e.g. --zones us-central1-a,us-central1-b")
        if self.workers < 0:
            raise ClusterSpecError(f"--workers must be >= 0, not {self.workers}")
        if self.gpus_per_worker < 0:
            raise ClusterSpecError(f"--gpus-per-worker must be >= 0, not {self.gpus_per_worker}")
        if self.termination_action not in TERMINATION_ACTIONS:
            raise ClusterSpecError(
                f"--termination-action must be one of {', '.join(TERMINATION_ACTIONS)}, not {self.termination_action!r}"
            )
        if self.preemption_notice_s is not None and self.preemption_notice_s < 1:
            raise ClusterSpecError(
                f"--preemption-notice-duration must be a positive number of seconds, not {self.preemption_notice_s}")
        if self.boot_disk_gb < 10:
            raise ClusterSpecError(f"--boot-disk-gb must be at least 10, not {self.boot_disk_gb}")
        for key, value in self.labels:
            if key in (CLUSTER_LABEL, ROLE_LABEL):
                raise ClusterSpecError(f"label {key!r} is set by the cluster command itself")
            if not _LABEL_KEY_RE.match(key) or not _LABEL_VALUE_RE.match(value):
                raise ClusterSpecError(
                    f"label {key}={value}: keys start with a lowercase letter; keys and values use lowercase "
                    "letters, digits, '_' and '-' (at most 63 characters)"
                )
        if self.standby is not None and not self.standby.strip():
            raise ClusterSpecError("--standby needs the training script and its arguments, e.g. 'train.py --epochs 90'")
        if self.standby and not self.store:
            raise ClusterSpecError("--standby needs --store: a standby publishes its readiness in the run store, "
                                   "where discovery reads it")
        if self.job_dir is not None and not self.job_dir.startswith("/"):
            raise ClusterSpecError(f"--job-dir must be an absolute path, not {self.job_dir!r}")
        if self.driver_zone is not None and not self.driver_zone:
            raise ClusterSpecError("--driver-zone must not be empty")

    @property
    def family(self) -> str:
        return self.machine_type.split("-", 1)[0]

    @property
    def attaches_gpus(self) -> bool:
        """Whether GPUs are requested as guestAccelerators (N1) rather than built into the machine type."""
        return bool(self.gpu_type) and self.gpus_per_worker > 0 and self.family not in BUILT_IN_GPU_FAMILIES

    def all_labels(self, role: str) -> dict[str, str]:
        return {**dict(self.labels), CLUSTER_LABEL: self.name, ROLE_LABEL: role}

    @property
    def worker_labels(self) -> tuple[str, ...]:
        """What to pass to ``hvd-transient discover --label`` to select this cluster's workers."""
        return (f"{CLUSTER_LABEL}={self.name}", f"{ROLE_LABEL}={WORKER}")


@dataclass(frozen=True)
class InstancePlan:
    name: str
    zone: str
    role: str  # DRIVER or WORKER
    machine_type: str
    spot: bool
    gpu_type: str | None
    gpu_count: int


def driver_name(spec: ClusterSpec) -> str:
    return f"{spec.name}-driver"


def worker_name(spec: ClusterSpec, index: int) -> str:
    return f"{spec.name}-worker-{index}"


def plan_instances(spec: ClusterSpec) -> tuple[InstancePlan, ...]:
    """The driver first, then the workers round-robin over the zones."""
    driver = InstancePlan(
        name=driver_name(spec), zone=spec.driver_zone or spec.zones[0], role=DRIVER,
        machine_type=spec.driver_machine_type, spot=False, gpu_type=None, gpu_count=0,
    )
    gpus = spec.gpus_per_worker if spec.gpu_type else 0
    workers = tuple(
        InstancePlan(
            name=worker_name(spec, i), zone=spec.zones[i % len(spec.zones)], role=WORKER,
            machine_type=spec.machine_type, spot=True, gpu_type=spec.gpu_type if gpus else None, gpu_count=gpus,
        )
        for i in range(spec.workers)
    )
    return (driver,) + workers
