#!/usr/bin/env bash
# Startup script of every hvd-transient cluster VM (the driver and the workers).
# `hvd-transient cluster up` passes it as the instance metadata key
# `startup-script`; GCE runs it as root on every boot, so every step is
# idempotent: a Spot worker restarted after a preemption (termination action
# STOP) comes straight back ready without reinstalling anything.
#
# What it does:
#   1. reads its settings from instance metadata (the hvdt-* keys that
#      `cluster up` sets);
#   2. installs OS packages: python3-venv, openssh-server, and the build tools
#      Horovod's source build needs (cmake, g++, make);
#   3. creates /opt/hvdt/venv and pip-installs TensorFlow, then Horovod (Gloo,
#      built against that TensorFlow), then hvd-transient (hvdt-package);
#   4. makes sure the ssh user exists (its key comes from the `ssh-keys`
#      metadata, installed by the guest agent), puts the venv first on its PATH,
#      also for the non-interactive sessions horovodrun opens, and that sshd runs;
#   5. writes /etc/hvdt/env (HVDT_CLUSTER, HVDT_ROLE, HVDT_STORE) and touches
#      /var/lib/hvdt/ready when the VM is ready for horovodrun;
#   6. on workers given hvdt-standby, starts a standby of the job (systemd unit
#      hvdt-standby): it imports, builds the model and rehearses a step now, and
#      publishes the VM as ready in the store; horovodrun's worker on this VM
#      (`python -m hvd_transient.worker SCRIPT ARGS`) then only hands it the job.
#      Workers without one publish themselves as ready at the end of step 5
#      (`hvd-transient ready`), so that discovery and `cluster keep --job` do not
#      offer Horovod a VM that is still booting (its worker would fail, and
#      Horovod would blacklist the host).
#
# What it assumes:
#   - a Debian or Ubuntu image with apt, curl and systemd. The default image
#     (debian-12) has python3 3.11, inside hvd-transient's supported 3.10-3.11;
#   - on GPU workers, an NVIDIA driver and CUDA that TensorFlow 2.15 can use
#     (CUDA 12.2, cuDNN 8.9), e.g. a Deep Learning VM image (it honours the
#     install-nvidia-driver=True key that `cluster up` sets) or your own image.
#     This script installs no GPU driver;
#   - outbound access to PyPI (the VMs get an external IP unless
#     --no-external-ip, in which case use Cloud NAT);
#   - cluster VMs reach each other on all TCP ports (Gloo picks ports at run
#     time; the default network's default-allow-internal rule allows it) and
#     the driver reaches workers on port 22;
#   - the venv (/opt/hvdt/venv) and the training script sit at the same path on
#     every VM, because horovodrun runs the driver's command line on each
#     worker: run `/opt/hvdt/venv/bin/python train.py` from the same directory.
#
# Metadata keys (all optional):
#   hvdt-role         driver | worker (default worker)
#   hvdt-cluster      cluster name
#   hvdt-package      pip requirement for hvd-transient (default hvd-transient);
#                     any pip form: name==version, https URL of a wheel, git+https
#   hvdt-store        run store URL, exported as HVDT_STORE
#   hvdt-ssh-user     the user horovodrun connects as (default hvdt)
#   hvdt-tensorflow   pip requirement for TensorFlow (default tensorflow==2.15.1 on
#                     workers, tensorflow-cpu==2.15.1 on the driver)
#   hvdt-horovod      pip requirement for Horovod (default horovod==0.28.1)
#   hvdt-horovod-env  extra Horovod build variables, space-separated, e.g.
#                     "HOROVOD_GPU_OPERATIONS=NCCL" (needs NCCL's dev package)
#   hvdt-standby      workers: the training script and its arguments, as the job
#                     runs them (`cluster up --standby`); parsed as a shell would
#   hvdt-job-dir      the job's working directory (default: the ssh user's home)
#
# HVDT_ROOT (default /) and HVDT_METADATA_URL relocate what the script writes and
# where it reads metadata, so it can be exercised off a VM.
set -euo pipefail

INSTANCE=${HVDT_METADATA_URL:-http://metadata.google.internal}/computeMetadata/v1/instance
ROOT=${HVDT_ROOT:-}
instance() {  # instance KEY [DEFAULT]: an instance metadata value, or DEFAULT when it is not set
  curl -fsS --retry 5 -H 'Metadata-Flavor: Google' "$INSTANCE/$1" 2>/dev/null || printf '%s' "${2:-}"
}
meta() { instance "attributes/$1" "${2:-}"; }  # meta KEY [DEFAULT]: a custom attribute
log() { echo "hvdt-startup: $*"; logger -t hvdt-startup -- "$*" 2>/dev/null || true; }

ROLE=$(meta hvdt-role worker)
CLUSTER=$(meta hvdt-cluster "")
PACKAGE=$(meta hvdt-package hvd-transient)
STORE=$(meta hvdt-store "")
SSH_USER=$(meta hvdt-ssh-user hvdt)
if [[ "$ROLE" == driver ]]; then default_tf=tensorflow-cpu==2.15.1; else default_tf=tensorflow==2.15.1; fi
TENSORFLOW=$(meta hvdt-tensorflow "$default_tf")
HOROVOD=$(meta hvdt-horovod horovod==0.28.1)
HOROVOD_ENV=$(meta hvdt-horovod-env "")
STANDBY=$(meta hvdt-standby "")
JOB_DIR=$(meta hvdt-job-dir "")

VENV=$ROOT/opt/hvdt/venv
STATE=$ROOT/var/lib/hvdt
ETC=$ROOT/etc/hvdt
mkdir -p "$STATE" "$ETC"
rm -f "$STATE/ready"
log "role=$ROLE cluster=$CLUSTER package=$PACKAGE"

# 1. OS packages (skipped once installed).
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null || ! command -v sshd >/dev/null \
    || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq python3-venv python3-dev openssh-server cmake g++ make curl
fi

# 2. Python environment. TensorFlow must be importable before Horovod's sdist
#    builds against it; numpy<2 and protobuf<5 keep TensorFlow 2.15 working.
wanted="$TENSORFLOW|$HOROVOD|$HOROVOD_ENV|$PACKAGE"
if [[ ! -x "$VENV/bin/python" || "$(cat "$STATE/installed" 2>/dev/null)" != "$wanted" ]]; then
  python3 -m venv "$VENV"
  printf 'numpy<2\nprotobuf<5\n' > "$ROOT/opt/hvdt/constraints.txt"
  pip=("$VENV/bin/pip" install --disable-pip-version-check -q -c "$ROOT/opt/hvdt/constraints.txt")
  "${pip[@]}" --upgrade pip setuptools wheel
  "${pip[@]}" "$TENSORFLOW"
  # shellcheck disable=SC2086  # HOROVOD_ENV is a list of VAR=value words
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
    HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" $HOROVOD_ENV \
    "${pip[@]}" --no-build-isolation "$HOROVOD"
  "${pip[@]}" "$PACKAGE"
  "$VENV/bin/python" -c "import horovod.tensorflow, hvd_transient" # fail the boot loudly, not the job later
  printf '%s' "$wanted" > "$STATE/installed"
  log "installed $wanted"
fi

# 3. The ssh user horovodrun connects as, with the venv on PATH even for
#    non-interactive sessions (Debian's .bashrc returns early for those, so
#    the line goes first).
if ! id -u "$SSH_USER" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$SSH_USER"
fi
home=$(getent passwd "$SSH_USER" | cut -d: -f6)
path_line="export PATH=$VENV/bin:\$PATH  # hvd-transient"
if ! grep -qF "$path_line" "$home/.bashrc" 2>/dev/null; then
  { echo "$path_line"; echo "[ -f $ETC/env ] && set -a && . $ETC/env && set +a"; \
    cat "$home/.bashrc" 2>/dev/null || true; } > "$home/.bashrc.hvdt"
  mv "$home/.bashrc.hvdt" "$home/.bashrc"
  chown "$SSH_USER:" "$home/.bashrc"
fi
systemctl enable --now ssh 2>/dev/null || systemctl enable --now sshd

# 4. Settings for training processes, and the readiness marker.
cat > "$ETC/env" <<ENV
HVDT_CLUSTER=$CLUSTER
HVDT_ROLE=$ROLE
HVDT_STORE=$STORE
ENV
touch "$STATE/ready"
log "ready for horovodrun"
# a ready record names this boot's VM: one recreated under the same name waits for its own
INSTANCE_ID=$(instance id)
NAME=$(instance name "$(hostname -s)")
if [[ "$ROLE" == worker && -n "$STORE" && -z "$STANDBY" ]]; then
  # under the instance's name, as discovery lists it (the host name may be the FQDN on some images)
  "$VENV/bin/hvd-transient" ready --store "$STORE" --host "$NAME" ${INSTANCE_ID:+--instance-id "$INSTANCE_ID"} \
    || log "could not publish this VM as ready: discovery lists it once its join timeout has passed"
fi

# 5. The job's standby on workers (every boot: a restarted Spot VM rejoins warm). It runs as
#    the ssh user in the job's directory, as horovodrun's worker will, so the worker finds it.
if [[ "$ROLE" == worker && -n "$STANDBY" ]]; then
  if [[ -z "$STORE" ]]; then
    log "hvdt-standby is set but hvdt-store is not: no standby (it publishes its readiness there)"
  else
    systemctl stop hvdt-standby 2>/dev/null || true
    systemd-run --unit hvdt-standby --collect --uid "$SSH_USER" --working-directory "${JOB_DIR:-$home}" \
      --property=EnvironmentFile="$ETC/env" --setenv=PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" \
      /bin/bash -c "exec \"\$0\" -m hvd_transient.worker --standby --store \"\$1\" \${2:+--instance-id \"\$2\"} $STANDBY" \
      "$VENV/bin/python" "$STORE" "$INSTANCE_ID"
    log "standby of '$STANDBY' started in ${JOB_DIR:-$home}"
  fi
fi
