"""What ``hvd-transient cluster up|down|keep --dry-run`` print: the exact Compute REST requests and the
equivalent ``gcloud`` commands of ``up`` and ``down``, or the actions one ``keep`` pass would take.
Nothing is sent or changed; ``up`` and ``down`` need neither credentials nor network."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from hvd_transient.cluster.cli_parser import PROG, split_zones
from hvd_transient.cluster.spec import ClusterSpec
from hvd_transient.gcp.compute_api import API_URL_ENV, DEFAULT_API_URL

if TYPE_CHECKING:
    from hvd_transient.cluster.keeper import Keeper


def _api_url(args: argparse.Namespace) -> str:
    import os

    return (args.api_url or os.environ.get(API_URL_ENV) or DEFAULT_API_URL).rstrip("/")


def _print_dry_run(title: str, requests: list[Any], commands: list[list[str]], fmt: str) -> None:
    from hvd_transient.cluster.gcloud import render

    if fmt == "json":
        print(json.dumps({"requests": [r.to_dict() for r in requests], "gcloud": [render(c) for c in commands]},
                         indent=2))
        return
    print(f"# {title} (dry run: nothing was sent)\n")
    print("# Compute REST requests")
    for request in requests:
        print(request.render())
        print()
    print("# equivalent gcloud commands")
    for gcloud_command in commands:
        print(render(gcloud_command))


def up_dry_run(args: argparse.Namespace, spec: ClusterSpec) -> int:
    from hvd_transient.cluster.gcloud import up_commands
    from hvd_transient.cluster.rest_plan import up_requests

    title = f"{PROG} up {spec.name}: 1 on-demand driver + {spec.workers} Spot workers"
    _print_dry_run(title, up_requests(_api_url(args), spec), up_commands(spec), args.format)
    return 0


def down_dry_run(args: argparse.Namespace) -> int:
    from hvd_transient.cluster.gcloud import down_commands, status_command
    from hvd_transient.cluster.rest_plan import down_requests, list_request

    base = _api_url(args)
    requests = [list_request(base, args.project, args.name)]
    commands = [status_command(args.project, args.name)]
    zones = split_zones(args.zones)
    if zones:  # the planned names; a real `down` deletes whatever the list returns
        spec = ClusterSpec(name=args.name, project=args.project, zones=zones, workers=args.workers)
        requests += down_requests(base, spec, keep_driver=args.keep_driver)
        commands += down_commands(spec, keep_driver=args.keep_driver)
    _print_dry_run(f"{PROG} down {args.name}: list the cluster's VMs, then DELETE each",
                   requests, commands, args.format)
    return 0


def keep_dry_run(keeper: "Keeper", spec: ClusterSpec, fmt: str, job: str | None) -> int:
    from dataclasses import asdict

    from hvd_transient.cluster.job_plan import describe_job, job_launch
    from hvd_transient.cluster.keeper_actions import Outcome, Wait, action_dict, describe
    from hvd_transient.cluster.keeper_plan import running_after

    result = keeper.preview()
    # what the job would do after this pass, if its starts and creates all succeed
    ok = tuple(Outcome(a) for a in result.actions if not isinstance(a, Wait))
    running = running_after(result.observation, ok)
    launch = job_launch(keeper.job_state, running, result.observation.now, keeper.job_policy) if job else None
    if fmt == "json":
        doc: dict[str, Any] = {"workers": [asdict(w) for w in result.observation.workers],
                               "actions": [action_dict(a) for a in result.actions],
                               "spent": round(result.state.spend.total, 6)}
        if job:
            doc["job"] = {"command": job, "launch": launch is not None, "workers": list(running),
                          "min_workers": keeper.job_policy.min_workers}
        print(json.dumps(doc, indent=2))
        return 0
    live = sum(1 for w in result.observation.workers if w.live)
    print(f"# {PROG} keep {spec.name}: {live} of {spec.workers} workers live (dry run: nothing was changed)")
    for worker in result.observation.workers:
        print(f"#   {worker.name}  {worker.zone}  {worker.status}  {worker.provisioning}")
    for action in result.actions:
        print(describe(action))
    if not result.actions:
        print("nothing to do")
    if job:
        print(f"launch  job on {', '.join(running)}: {job}" if launch is not None
              else f"wait    {describe_job(keeper.job_state, running, keeper.job_policy)}")
    return 0


__all__ = ["down_dry_run", "keep_dry_run", "up_dry_run"]
