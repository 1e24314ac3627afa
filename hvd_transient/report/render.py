"""Text and JSON renderings of a run analysis (pure: strings and dicts, no I/O)."""
from __future__ import annotations

from typing import Any

from hvd_transient.report.costs import CostEstimate
from hvd_transient.report.keeper_summary import JobAttempt, KeeperSummary
from hvd_transient.report.run_analysis import Preemption, RunAnalysis

JSON_SCHEMA_VERSION = 1


def _rel(analysis: RunAnalysis, t: float | None) -> float | None:
    return None if t is None else t - analysis.started_at


def _num(value: float | None, fmt: str = "{:.0f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def render_timeline(analysis: RunAnalysis) -> str:
    host_width = max((len(e.host) for e in analysis.timeline), default=4)
    return "\n".join(f"{e.t - analysis.started_at:9.2f}s  {e.host.ljust(host_width)}  {e.text}"
                     for e in analysis.timeline)


def render_preemptions(analysis: RunAnalysis) -> str:
    if not analysis.preemptions:
        return "no preemptions or lost workers"
    headers = ["t (s)", "host", "master", "notice", "step", "committed", "notice->commit ms", "deadline met",
               "new master", "rolled back", "resume ms", "reset->step ms"]
    rows = [[_num(_rel(analysis, p.departed_at), "{:.2f}"), p.host, _yes(p.was_master), _yes(p.notice),
             _num(p.step), _yes(p.checkpoint_committed), _num(p.notice_to_commit_ms), _yes(p.deadline_met),
             p.new_master or "-", str(p.steps_rolled_back),
             _num(p.resume_ms) + (" (cold restart)" if p.cold_restart else ""),
             _num(p.reset_to_first_step_ms)] for p in analysis.preemptions]
    return table(headers, rows)


def render_workers(analysis: RunAnalysis) -> str:
    headers = ["worker", "from (s)", "to (s)", "seconds", "steps", "outcome", "ckpt stall s"]
    rows = [[w.label, f"{_rel(analysis, w.started_at):.2f}", f"{_rel(analysis, w.ended_at):.2f}",
             f"{w.seconds:.1f}", f"{_num(w.first_step)}..{_num(w.last_step)}", w.outcome,
             f"{analysis.stall_s_by_worker.get(w.label, 0.0):.3f}"] for w in analysis.workers]
    return table(headers, rows)


def render_summary(analysis: RunAnalysis) -> str:
    a = analysis
    sizes = " -> ".join(str(r.size) for r in a.rings) or "-"
    kinds: dict[str, int] = {}
    for c in a.commits:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    notices = sum(p.notice for p in a.preemptions)
    stalls = [j.stall_s for j in a.joins if j.stall_s is not None]
    lines = [
        f"completed:            {_yes(a.completed)} ({a.ended_by})",
        f"final step:           {_num(a.final_step)}   last committed step: {_num(a.last_committed_step)}",
        f"wall time:            {a.wall_s:.1f} s   worker-seconds: {a.worker_seconds:.1f}",
        f"workers:              {len(a.workers)} processes; ring sizes {sizes}",
        f"preemptions:          {len(a.preemptions)} ({notices} with notice, "
        f"{len(a.preemptions) - notices} without); joins: {len(a.joins)}"
        + (f" (survivors stalled {', '.join(f'{s:.2f}' for s in stalls)} s)" if stalls else ""),
        "commits:              " + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none")
        + (f"; {a.saves_failed} failed saves" if a.saves_failed else ""),
        f"checkpoint stall:     {a.checkpoint_stall_s:.3f} s (largest per worker: async snapshot stalls + "
        "emergency/final saves)",
        f"bytes written:        {a.bytes_written / 1e6:.2f} MB (all committed and attempted saves)",
        "learning rate:        " + (" -> ".join(f"{c.lr:g}" for c in a.lr_changes) or "-"),
        "final weights agree:  " + _yes(a.weights_consistent),
        "driver messages lost: " + (", ".join(f"{n} {change}{'s' if n > 1 else ''}" for change, n
                                              in a.host_updates_announced.items()) + " announced by rank 0"
                                    if a.host_updates_announced else "none"),
        f"events:               {a.event_count} read" + (
            f"; {a.skipped_count} skipped as unreadable ({', '.join(f'{k} {n}' for k, n in a.skipped_events.items())})"
            if a.skipped_events else ""),
    ]
    return "\n".join(lines)


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.4f}"


def render_keeper(analysis: RunAnalysis) -> str:
    """What ``cluster keep`` did: refills, stock-outs, fallback, spend, and the job's launches."""
    k = analysis.keeper
    if k is None:
        return "no keeper events"
    by_zone = ", ".join(f"{zone} {n}" for zone, n in k.refills_by_zone.items())
    lines = [
        f"kept:                 {_num(k.wanted)} worker(s) of {k.cluster or '-'} in {', '.join(k.zones) or '-'}",
        f"refills:              {k.refills} ({k.restarts} started again, {k.creates} created; {k.failovers} after "
        f"a zone failover; {k.on_demand_refills} on demand)" + (f"; by zone: {by_zone}" if by_zone else ""),
        "stock-outs:           " + (", ".join(f"{zone} {n}" for zone, n in k.stockouts_by_zone.items()) or "none")
        + (f" ({k.quota_errors} quota errors)" if k.quota_errors else ""),
        f"on-demand fallback:   {k.fallbacks} ({k.fallback_s:.0f} s ended, {_usd(k.fallback_cost)}); "
        f"{k.releases} stand-in(s) released",
        f"spend (workers):      {_usd(k.spent)} (Spot {_usd(k.spent_spot)}, on demand {_usd(k.spent_on_demand)}); "
        f"on-demand premium {_usd(k.on_demand_premium)}",
        f"job:                  {len(k.jobs)} launch(es), {k.relaunches} relaunch(es)"
        + ("; GAVE UP" if k.gave_up else "") + (f"; {k.budget_holds} budget hold(s)" if k.budget_holds else "")
        + (f"; {k.errors} keeper error(s)" if k.errors else ""),
    ]
    if k.jobs:
        headers = ["attempt", "launched (s)", "workers", "exit", "ended by", "restored step", "first step",
                   "launch->step s", "outage s"]
        rows = [[str(j.attempt), _num(_rel(analysis, j.launched_at), "{:.2f}"), str(len(j.workers)),
                 _num(j.exit_code, "{}"), _ended_by(j), _num(j.restored_step, "{}"), _num(j.resumed_step, "{}"),
                 _num(j.launch_to_step_s, "{:.1f}"), _num(j.outage_s, "{:.1f}")] for j in k.jobs]
        lines += ["", table(headers, rows)]
    return "\n".join(lines)


def _ended_by(j: JobAttempt) -> str:
    if j.ended_at is None:
        return "-"
    return {"no_workers": "keeper (no worker left)", "keeper_stopped": "keeper stopping",
            "launch_failed": "launch failed"}.get(j.reason or "", "itself")


def render_costs(cost: CostEstimate) -> str:
    c = cost.comparison
    cur = cost.currency
    lines = [
        f"instance type: {cost.instance_type}"
        + (f"; driver {cost.driver_instance_type} on demand" if cost.driver_instance_type else ""),
        table(["setup", "VM-seconds billed", f"cost ({cur})"], [
            ["this run, transient (spot)", str(c.transient.vm_seconds), f"{c.transient.total:.4f}"],
            ["same VM-seconds on demand", str(c.same_on_demand.vm_seconds), f"{c.same_on_demand.total:.4f}"],
            ["one on-demand VM, whole job", str(c.single_on_demand.vm_seconds),
             f"{c.single_on_demand.total:.4f}"],
        ]),
        f"savings: {100 * c.savings_vs_same_on_demand:.1f} % vs the same VMs on demand, "
        f"{100 * c.savings_vs_single_on_demand:.1f} % vs one on-demand VM"
        + (f"; speed-up vs one VM {c.speedup_vs_single:.2f}x" if c.speedup_vs_single else ""),
        f"assumption: {cost.assumption}; each worker billed for its first-to-last event (per-second "
        "billing with the price table's minimum)",
    ]
    return "\n".join(lines)


def render_text(analysis: RunAnalysis, cost: CostEstimate | None) -> str:
    parts = ["== timeline (seconds from the first worker start) ==", render_timeline(analysis), "",
             "== workers ==", render_workers(analysis), "",
             "== preemptions ==", render_preemptions(analysis), "",
             "== summary ==", render_summary(analysis)]
    if analysis.keeper is not None:
        parts += ["", "== keeper ==", render_keeper(analysis)]
    if cost is not None:
        parts += ["", "== cost ==", render_costs(cost)]
    return "\n".join(parts) + "\n"


def _preemption_json(a: RunAnalysis, p: Preemption) -> dict[str, Any]:
    return {
        "host": p.host, "pid": p.pid, "t_s": _rel(a, p.departed_at), "step": p.step,
        "was_master": p.was_master, "notice": p.notice, "agreed_step": p.agreed_step,
        "steps_rolled_back": p.steps_rolled_back, "resume_ms": p.resume_ms,
        "reset_to_first_step_ms": p.reset_to_first_step_ms, "cold_restart": p.cold_restart,
        "checkpoint_committed": p.checkpoint_committed, "notice_to_commit_ms": p.notice_to_commit_ms,
        "deadline_met": p.deadline_met, "new_master": p.new_master,
        "agreed_to_left_ms": p.agreed_to_left_ms, "survivor_resets": p.survivor_resets,
        "marks_s": {name: _rel(a, t) for name, t in p.marks.items()},
    }


def _keeper_json(a: RunAnalysis, k: KeeperSummary) -> dict[str, Any]:
    return {
        "t_s": _rel(a, k.started_at), "cluster": k.cluster, "wanted": k.wanted, "zones": list(k.zones),
        "refills": k.refills, "restarts": k.restarts, "creates": k.creates, "failovers": k.failovers,
        "on_demand_refills": k.on_demand_refills, "refills_by_zone": dict(k.refills_by_zone),
        "stockouts_by_zone": dict(k.stockouts_by_zone), "quota_errors": k.quota_errors, "releases": k.releases,
        "errors": k.errors, "budget_holds": k.budget_holds, "fallbacks": k.fallbacks, "fallback_s": k.fallback_s,
        "fallback_cost_usd": k.fallback_cost, "spent_usd": k.spent, "spent_spot_usd": k.spent_spot,
        "spent_on_demand_usd": k.spent_on_demand, "on_demand_premium_usd": k.on_demand_premium,
        "relaunches": k.relaunches, "gave_up": k.gave_up,
        "jobs": [{"attempt": j.attempt, "launched_s": _rel(a, j.launched_at), "workers": list(j.workers),
                  "relaunch": j.relaunch, "waited_s": j.waited_s, "ended_s": _rel(a, j.ended_at),
                  "exit_code": j.exit_code, "reason": j.reason, "restored_step": j.restored_step,
                  "resumed_s": _rel(a, j.resumed_at), "resumed_step": j.resumed_step,
                  "launch_to_step_s": j.launch_to_step_s, "outage_s": j.outage_s} for j in k.jobs],
    }


def to_json(analysis: RunAnalysis, cost: CostEstimate | None) -> dict[str, Any]:
    """The machine-readable report; times are seconds from the first worker start (``started_at``)."""
    a = analysis
    doc: dict[str, Any] = {
        "schema_version": JSON_SCHEMA_VERSION,
        "completed": a.completed,
        "ended_by": a.ended_by,
        "final_step": a.final_step,
        "last_committed_step": a.last_committed_step,
        "started_at": a.started_at,
        "wall_s": a.wall_s,
        "worker_seconds": a.worker_seconds,
        "preemptions": [_preemption_json(a, p) for p in a.preemptions],
        "joins": [{"host": j.host, "pid": j.pid, "t_s": _rel(a, j.t), "step": j.step, "size": j.size,
                   "stall_s": j.stall_s, "steps_rolled_back": j.steps_rolled_back} for j in a.joins],
        "rings": [{"t_s": _rel(a, r.started_at), "step": r.step, "size": r.size, "master_host": r.master_host,
                   "hosts": list(r.hosts), "joined": list(r.joined), "relaunch": r.relaunch,
                   "steps_per_s": r.steps_per_s} for r in a.rings],
        "lr_changes": [{"t_s": _rel(a, c.t), "lr": c.lr, "size": c.size} for c in a.lr_changes],
        "commits": [{"t_s": _rel(a, c.t), "step": c.step, "kind": c.kind, "host": c.host, "size": c.size}
                    for c in a.commits],
        "workers": [{"host": w.host, "pid": w.pid, "start_s": _rel(a, w.started_at), "end_s": _rel(a, w.ended_at),
                     "seconds": w.seconds, "outcome": w.outcome, "first_step": w.first_step,
                     "last_step": w.last_step, "restored_step": w.restored_step} for w in a.workers],
        "checkpoint_stall_s": a.checkpoint_stall_s,
        "checkpoint_stall_s_by_worker": dict(a.stall_s_by_worker),
        "bytes_written": a.bytes_written,
        "saves_failed": a.saves_failed,
        "weights_consistent": a.weights_consistent,
        "host_updates_announced": dict(a.host_updates_announced),
        "event_count": a.event_count,
        "skipped_event_count": a.skipped_count,
        "skipped_events": dict(a.skipped_events),
        "keeper": _keeper_json(a, a.keeper) if a.keeper is not None else None,
        "instance_type": cost.instance_type if cost else None,
        "cost_transient_usd": cost.transient_usd if cost else None,
        "cost_on_demand_usd": cost.on_demand_usd if cost else None,
        "cost_single_on_demand_usd": cost.single_on_demand_usd if cost else None,
    }
    if cost is not None:
        c = cost.comparison
        doc["cost"] = {
            "currency": cost.currency,
            "driver_instance_type": cost.driver_instance_type,
            "vm_seconds_billed": c.transient.vm_seconds,
            "single_seconds": cost.single_seconds,
            "savings_vs_same_on_demand": c.savings_vs_same_on_demand,
            "savings_vs_single_on_demand": c.savings_vs_single_on_demand,
            "speedup_vs_single": c.speedup_vs_single,
            "assumption": cost.assumption,
        }
    return doc


__all__ = ["JSON_SCHEMA_VERSION", "render_costs", "render_keeper", "render_preemptions", "render_summary",
           "render_text", "render_timeline", "render_workers", "to_json"]
