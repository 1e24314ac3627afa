"""`hvd-transient demo`: a transient GPU cluster's story, played on this machine.

Real ``horovodrun`` over local host aliases (one per "VM"), a metadata-server
emulator per host that delivers GCE preemption notices, the real discovery
script, ResNet-32 on CIFAR-10-shaped data. By default a worker gets a notice,
later the checkpoint master gets one; the keeper (``cluster keep`` over the
simulator) starts each preempted VM again once its window has ended, and the
VM rejoins through a standby worker that warmed up before it was offered to
Horovod, so the survivors barely pause. ``--schedule`` and ``--lifetimes``
change the preemptions, ``--no-keeper`` and ``--no-standby`` switch those off.

``--trace FILE`` plays a window of a public spot trace instead (:mod:`hvd_transient.testing.traces`:
``--trace-start``, ``--trace-hours``, ``--time-scale``, ``--max-nodes``, ``--cloud``): the trace
decides which VMs exist, so the keeper is off; removals are notices with the cloud's window,
additions are VMs that join through a standby, and training stops when the window ends.
Ends with the run report (time, cost, keeper, timeline).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Sequence

from hvd_transient.commandline import ArgumentParser, UsageError, command, positive_int, positive_seconds, store_url
from hvd_transient.report.costs import DEFAULT_INSTANCE_TYPE
from hvd_transient.testing.local_cluster import HOST_ALIASES, LocalCluster, LocalClusterSpec, of
from hvd_transient.testing.schedule import Action, default_schedule, lifetime_schedule, load_schedule
from hvd_transient.testing.traces import TracePlan, add_trace_arguments, load_plan

log = logging.getLogger(__name__)

#: the PyTorch example's synthetic data set for the demo (the Keras example's size)
DEMO_SAMPLES = 2048
#: the training script of each frontend: the same story, model, data and protocol
EXAMPLES = {framework: Path(__file__).resolve().parents[2] / "examples" / f"{framework}_elastic.py"
            for framework in ("keras", "torch")}
SHOWN = {"notice": "notice", "notice_agreed": "all ranks agreed", "election": "new checkpoint master",
         "commit": "checkpoint committed", "leave_published": "leaving the ring", "reset": "ring reset",
         "save_failed": "checkpoint FAILED", "stop_requested": "stop"}


PROG = "hvd-transient demo"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=_workers, default=3,
                   help=f"VMs at the start (local host aliases, 1 to {len(HOST_ALIASES) - 1})")
    p.add_argument("--store", type=store_url, help="checkpoint store URL (default: a new directory under --workdir)")
    p.add_argument("--gcs-emulator", action="store_true",
                   help="start a local fake-gcs-server and use gs://demo/<run> as the store")
    p.add_argument("--workdir", default="hvdt-demo", help="where runs, logs and reports go")
    p.add_argument("--framework", choices=sorted(EXAMPLES), default="keras",
                   help="the training script: examples/keras_elastic.py or examples/torch_elastic.py")
    p.add_argument("--model", choices=("resnet32", "small_cnn"), default="resnet32")
    p.add_argument("--epochs", type=positive_int, default=16)
    p.add_argument("--steps-per-epoch", type=positive_int, default=25)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--save-every", type=positive_int, default=50, help="periodic checkpoint interval (steps)")
    p.add_argument("--window", type=positive_seconds, default=None,
                   help="preemption notice window (s; default 30, with --trace the --cloud's)")
    p.add_argument("--schedule", help="JSON schedule file (see hvd_transient/testing/schedule.py)")
    p.add_argument("--lifetimes", type=int, metavar="SEED",
                   help="draw preemption times from ICAC'19-like VM lifetimes with this seed")
    p.add_argument("--day-seconds", type=float, default=600.0,
                   help="with --lifetimes: 24 hours of VM lifetime compressed into this many seconds")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="extra time per step (stretches a small model's run over the schedule)")
    p.add_argument("--cifar10-npz", help="real CIFAR-10 (.npz with x_train, y_train); synthetic if absent")
    p.add_argument("--instance-type", help="price-table entry for the cost comparison")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--timeout", type=positive_seconds, default=1800.0, help="give up after this many seconds")
    p.add_argument("--no-keeper", dest="keeper", action="store_false",
                   help="no keeper: preempted VMs stay down, a new VM joins instead (schedule action join)")
    p.add_argument("--no-standby", dest="standby", action="store_false",
                   help="VMs that join start their worker cold when Horovod asks (stock Horovod's join)")
    add_trace_arguments(p.add_argument_group("trace", "play a public spot trace (replaces the schedule)"))
    return p


def _workers(text: str) -> int:
    count = positive_int(text)
    if count > len(HOST_ALIASES) - 1:
        raise argparse.ArgumentTypeError(f"at most {len(HOST_ALIASES) - 1} (one local alias stays spare for a "
                                         f"joining VM), not {text!r}")
    return count


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    total_steps = args.epochs * args.steps_per_epoch
    # a ScheduleError (a TraceError too) is answered as one line by the command wrapper
    plan: TracePlan | None = None
    if args.trace:
        if args.schedule or args.lifetimes is not None:
            raise UsageError("--trace decides the preemptions: give it without --schedule or --lifetimes")
        plan = load_plan(args, HOST_ALIASES, window_s=args.window)
        args.window, args.keeper, args.workers = plan.options.notice_s, False, len(plan.hosts)
        args.epochs = max(args.epochs, 100000)  # the window's end stops training
    args.window = 30.0 if args.window is None else args.window
    schedule = (plan.actions if plan is not None else load_schedule(args.schedule) if args.schedule else
                lifetime_schedule(HOST_ALIASES[:args.workers], seed=args.lifetimes,
                                  run_s=args.timeout, day_s=args.day_seconds)
                if args.lifetimes is not None else default_schedule(total_steps, join=not args.keeper))

    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=workdir))
    with ExitStack() as stack:
        store = args.store
        extra_env: tuple[tuple[str, str], ...] = ()
        if args.gcs_emulator:
            from ckpt_service.testing.gcs_emulator import gcs_emulator

            emu = stack.enter_context(gcs_emulator())
            bucket = emu.new_bucket("demo")
            store = f"gs://{bucket}/{run_dir.name}"
            extra_env = tuple(emu.env.items())
        store = store or str(run_dir / "store")
        command: tuple[str, ...] = (sys.executable, str(EXAMPLES[args.framework]), "--store", store,
                                    "--model", args.model,
                   "--epochs", str(args.epochs), "--steps-per-epoch", str(args.steps_per_epoch),
                   "--batch-size", str(args.batch_size), "--save-every", str(args.save_every))
        if args.cifar10_npz:
            if args.framework != "keras":
                raise UsageError("--cifar10-npz is read by the Keras example only; the PyTorch one uses "
                                 "synthetic CIFAR-10-shaped data")
            command += ("--cifar10-npz", str(Path(args.cifar10_npz).absolute()))
        if args.step_seconds:
            command += ("--step-seconds", str(args.step_seconds))
        if args.framework == "torch":
            command += ("--samples", str(DEMO_SAMPLES))  # as many as the Keras example's synthetic set
        hosts = HOST_ALIASES[:args.workers]
        spec = LocalClusterSpec(store=store, hosts=hosts, command=command, workdir=run_dir,
                                max_np=len(HOST_ALIASES), instances=HOST_ALIASES, extra_env=extra_env,
                                notice_s=args.window,  # the workers' watchers read it from their VM's metadata
                                standby=args.standby)
        print(f"hvd-transient demo: {args.workers} VMs ({', '.join(hosts)}), {args.framework} {args.model}, "
              + (f"until the trace's window ends ({plan.duration_s:.0f} s)" if plan else f"{total_steps} steps")
              + f", store {store}")
        if plan is not None:
            print(f"trace: {plan.describe()}")
        print("schedule: " + "; ".join(a.describe() for a in schedule))
        print(f"horovodrun log: {run_dir / 'horovodrun.log'}\n")
        cluster = stack.enter_context(LocalCluster(spec))
        if args.keeper:
            stack.callback(_start_keeper(cluster, store, args.workers, args.instance_type or DEFAULT_INSTANCE_TYPE))
        rc = _play(cluster, schedule, args.window, args.timeout, stop_at_s=plan.duration_s if plan else None)
        print(f"\nhorovodrun exited with {rc}\n")
        return _report(store, args, rc, run_dir)  # while the store (maybe an emulator) is up


def _play(cluster: LocalCluster, schedule: Sequence[Action], window: float, timeout: float,
          stop_at_s: float | None = None) -> int:
    """Run the schedule against the live cluster, printing progress as it goes; ``stop_at_s`` seconds
    after the first step, ask the job to stop (checkpoint and finish)."""
    pending = list(schedule)
    spares = [h for h in HOST_ALIASES if h not in cluster.spec.hosts]
    shown: set[tuple[Any, ...]] = set()  # files flush at different times: events arrive out of order
    first_step_t: float | None = None
    last_status = 0.0
    deadline = time.time() + timeout
    assert cluster.process is not None
    while cluster.process.poll() is None:
        if time.time() > deadline:
            print(f"giving up after {timeout:.0f} s", file=sys.stderr)
            cluster.stop()
            break
        events = cluster.events()
        state = _state(events)
        if first_step_t is None and of(events, "first_step"):
            first_step_t = of(events, "first_step")[0]["t"]
        _print_new(events, shown, cluster.started_at)
        elapsed = time.time() - first_step_t if first_step_t else 0.0
        if stop_at_s is not None and first_step_t is not None and elapsed >= stop_at_s:
            print(f"  >>> the trace's window ends ({stop_at_s:.0f} s): stop")
            cluster.request_stop()
            stop_at_s = None
        for action in list(pending):
            if first_step_t is not None and action.due(state["step"], elapsed):
                if _fire(cluster, action, state, spares, window):
                    pending.remove(action)
        if time.time() - last_status > 5:
            last_status = time.time()
            print(f"[{time.time() - cluster.started_at:7.1f}s] step {state['step']:>5}  "
                  f"workers {state['size']}  master {state['master']}")
        time.sleep(0.5)
    _print_new(cluster.events(), shown, cluster.started_at)
    return cluster.process.returncode if cluster.process.returncode is not None else -1


def _start_keeper(cluster: LocalCluster, store: str, workers: int, instance_type: str) -> Callable[[], None]:
    """The keeper on the "driver VM": it keeps ``workers`` VMs running; returns how to stop it."""
    from ckpt_service.stores import open_store
    from hvd_transient.cluster.keeper import Keeper
    from hvd_transient.gcp.pricing import load_price_table
    from hvd_transient.telemetry.events import EventLog
    from hvd_transient.testing.local_fleet import LocalFleet

    fleet = LocalFleet(cluster)
    price = load_price_table().price(instance_type)
    keeper = Keeper(fleet, fleet.policy(workers, spot_per_hour=price.spot_per_hour,
                                        on_demand_per_hour=price.on_demand_per_hour),
                    cluster="demo", instance_type=instance_type,
                    events=EventLog(open_store(store), "driver"), interval_s=2.0,
                    out=lambda line: print(f"  >>> keeper: {line}", flush=True))
    runner = threading.Thread(target=keeper.run, name="keeper", daemon=True)
    runner.start()

    def stop() -> None:
        keeper.stop()
        runner.join(timeout=30)
        keeper.close()

    return stop


def _print_new(events: list[dict[str, Any]], shown: set[tuple[Any, ...]], t0: float) -> None:
    for e in events:
        key = (e["t"], e["host"], e.get("pid"), e["event"])
        if e["event"] in SHOWN and key not in shown:
            shown.add(key)
            print(_line(e, t0))


def _state(events: list[dict[str, Any]]) -> dict[str, Any]:
    rings = of(events, "ring")
    steps = [e["step"] for e in events if "step" in e and e["event"] in ("progress", "first_step", "ring")]
    size = rings[-1]["size"] if rings else 0
    return {"step": max(steps, default=0), "size": size,
            "master": rings[-1]["master_host"] if rings else "?",
            # every rank of the latest ring wrote one ring event
            "live": sorted({e["host"] for e in rings[-size:]}) if rings else []}


def _fire(cluster: LocalCluster, action: Action, state: dict[str, Any], spares: list[str], window: float) -> bool:
    target = action.target
    if action.action == "join":
        host = spares.pop(0) if target == "new" and spares else target
        print(f"  >>> a new VM appears: {host}")
        cluster.add_host(host)
        return True
    live = [h for h in state["live"] if h in cluster.worker_pids()]
    if target == "master":
        target = state["master"]
    elif target == "worker":
        others = [h for h in live if h != state["master"]]
        if not others:
            return False  # wait until there is a worker that is not the master
        target = others[-1]
    if target not in cluster.worker_pids():
        return False
    if action.action == "notice":
        print(f"  >>> preemption notice to {target} ({window:.0f} s window)")
        cluster.preempt(target, window_s=window)
    else:
        print(f"  >>> {target} vanishes without notice")
        cluster.kill(target)
    return True


def _line(e: dict[str, Any], t0: float) -> str:
    detail = {k: e[k] for k in ("step", "size", "leaving", "new_master_host", "kind", "rolled_back", "error")
              if k in e}
    return f"[{e['t'] - t0:7.1f}s] {e['host']:>10}  {SHOWN[e['event']]:<22} {json.dumps(detail)}"


def _report(store: str, args: argparse.Namespace, rc: int, run_dir: Path) -> int:
    from hvd_transient import report

    argv = [store, "--plot", str(run_dir / "timeline.png")]
    if args.json:
        argv += ["--json", args.json]
    if args.instance_type:
        argv += ["--instance-type", args.instance_type]
    status = report.main(argv)
    return rc if rc != 0 else status
