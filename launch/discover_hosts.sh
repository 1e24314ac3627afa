#!/usr/bin/env bash
# Host discovery for elastic horovodrun (Horovod 0.28 has no --elastic flag: a discovery
# script with --min-np/--max-np is what makes a job elastic):
#
#   horovodrun -np 2 --min-np 1 --max-np 8 --host-discovery-script launch/discover_hosts.sh ...
#
# Prints one "host:slots" line per available host, minus the hosts the run's
# store lists as leaving (a preempted worker publishes itself there). It only
# turns environment variables into `hvd-transient discover` options; arguments
# given to this script are appended after them: a single-valued option given
# as an argument overrides the environment, --zone and --label add to it.
#
# Environment:
#   HVDT_DISCOVERY_BACKEND  gce | file | local                        (--backend; default local)
#   HVDT_STORE              run store URL: dir, file://, gs://, memory:// (--store)
#   HVDT_LEAVING_GRACE_S    seconds a leaving record still excludes its host after its
#                           notice deadline (read by the command itself; default 60)
#   HVDT_STANDBY_SINCE      the job's launch (Unix seconds): VMs started later are listed once
#                           ready (read by the command itself; needs HVDT_STORE)
#   HVDT_JOIN_TIMEOUT_S     ...or this long after their start (read by the command; default 120)
#   HVDT_JOIN_GATHER_S      VMs that started within this many seconds of each other join together,
#                           in one ring change (read by the command; default 10; 0: each when ready)
#   HVDT_SLOTS              slots per host, or "auto" = one per GPU (gce) (--slots)
#   gce backend:
#     HVDT_PROJECT          GCP project id                             (--project)
#     HVDT_ZONES            comma-separated zones                      (--zone)
#     HVDT_MIG              zonal managed instance group               (--mig)
#     HVDT_LABELS           comma-separated key=value labels (AND)     (--label)
#     HVDT_USE_IP=1         print internal IPs instead of names        (--use-ip)
#     HVDT_COMPUTE_API      Compute API base URL (read by the command itself; for stand-ins)
#     HVDT_COMPUTE_ANONYMOUS=1  no credentials (only with HVDT_COMPUTE_API)
#   file backend:
#     HVDT_HOSTS_FILE       file of host[:slots] lines                 (--hosts-file)
#   local backend:
#     HVDT_HOSTS            comma-separated host[:slots] list          (--hosts)
#     HVDT_STATE_FILE       simulator state file                       (--state-file)
#   HVDT_CLI                the command to run (default: hvd-transient),
#                           e.g. "/opt/hvdt/venv/bin/hvd-transient" or "python3 -m hvd_transient.cli"
#
# Exit status: 0 with the hosts (possibly none), 2 on misconfiguration, 1 when
# the hosts could not be determined (Horovod then keeps the hosts it has).
set -euo pipefail

args=(discover --backend "${HVDT_DISCOVERY_BACKEND:-local}")
if [[ -n "${HVDT_STORE:-}" ]]; then args+=(--store "$HVDT_STORE"); fi
if [[ -n "${HVDT_SLOTS:-}" ]]; then args+=(--slots "$HVDT_SLOTS"); fi
if [[ -n "${HVDT_PROJECT:-}" ]]; then args+=(--project "$HVDT_PROJECT"); fi
if [[ -n "${HVDT_ZONES:-}" ]]; then args+=(--zone "$HVDT_ZONES"); fi
if [[ -n "${HVDT_MIG:-}" ]]; then args+=(--mig "$HVDT_MIG"); fi
if [[ -n "${HVDT_LABELS:-}" ]]; then args+=(--label "$HVDT_LABELS"); fi
case "${HVDT_USE_IP:-}" in 1|true|yes) args+=(--use-ip) ;; esac
if [[ -n "${HVDT_HOSTS_FILE:-}" ]]; then args+=(--hosts-file "$HVDT_HOSTS_FILE"); fi
if [[ -n "${HVDT_HOSTS:-}" ]]; then args+=(--hosts "$HVDT_HOSTS"); fi
if [[ -n "${HVDT_STATE_FILE:-}" ]]; then args+=(--state-file "$HVDT_STATE_FILE"); fi

read -r -a cli <<< "${HVDT_CLI:-hvd-transient}"
exec "${cli[@]}" "${args[@]}" "$@"
