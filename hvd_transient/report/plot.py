"""A picture of the run in the spirit of Figure 1 of the ICAC'19 paper (matplotlib, Agg backend).

Bottom panel: one horizontal bar per worker lifetime, coloured by how it ended,
with markers for notices, departures, joins and commits. Top panel: the step
reached over time and the ring size, on the same time axis, with each join's
survivors' stall shaded and labelled, and what ``cluster keep`` did: its refills
(ticks at the bottom) and the job's exits and relaunches (vertical lines).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from hvd_transient.report.run_analysis import FINISHED, KILLED, LOST, PREEMPTED, RunAnalysis

log = logging.getLogger(__name__)

OUTCOME_COLOURS = {FINISHED: "#4c9f70", PREEMPTED: "#e6a23c", KILLED: "#d1495b", LOST: "#8d8d8d"}
COMMIT_STYLE = {  # kind -> (marker, colour, size)
    "emergency": ("*", "#b2182b", 150),
    "periodic": ("|", "#2166ac", 90),
    "final": ("D", "#1b7837", 50),
}


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""
    cli_exit_status = 2  # the command line or configuration must change


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError("--plot needs matplotlib: pip install 'hvd-transient[plot]' "
                                   "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _progress_segments(a: RunAnalysis) -> list[list[Any]]:
    """Step points split at each relaunch: no line is drawn across a time with no cluster."""
    cuts = [r.started_at for r in a.rings[1:] if r.relaunch]
    segments: list[list[Any]] = [[]]
    for point in a.progress:
        while cuts and point.t >= cuts[0]:
            cuts.pop(0)
            if segments[-1]:
                segments.append([])
        segments[-1].append(point)
    return [s for s in segments if s]


def _ring_size_series(a: RunAnalysis) -> tuple[list[float], list[int]]:
    """(time, workers) steps: each ring's size from its start, 0 while no ring runs."""
    xs: list[float] = []
    ys: list[int] = []
    for i, ring in enumerate(a.rings):
        xs.append(ring.started_at)
        ys.append(ring.size)
        next_start = a.rings[i + 1].started_at if i + 1 < len(a.rings) else None
        if next_start is None or ring.ended_at < next_start:
            xs.append(ring.ended_at)
            ys.append(0 if next_start is not None or not a.completed else ring.size)
    return xs, ys


def _draw_keeper(ax: Any, a: RunAnalysis, rel: Callable[[float], float]) -> list[Any]:
    """The keeper's refills and the job's exits and relaunches; their legend entries."""
    from matplotlib.lines import Line2D

    k = a.keeper
    assert k is not None
    refills = [rel(e.t) for e in a.timeline if e.kind == "keeper_refill"]
    handles: list[Any] = []
    if refills:
        # at the bottom of the panel, whatever the step scale
        ax.scatter(refills, [0.02] * len(refills), marker="^", color="#1b7837", s=40, zorder=5,
                   transform=ax.get_xaxis_transform())
        handles.append(Line2D([], [], ls="", marker="^", color="#1b7837", label="keeper refill"))
    for job in k.jobs:
        if job.relaunch:
            ax.axvline(rel(job.launched_at), color="#1b7837", ls="--", lw=1.0)
            ax.annotate(f"relaunch {job.attempt}", (rel(job.launched_at), 0.95), xycoords=("data", "axes fraction"),
                        xytext=(3, 0), textcoords="offset points", fontsize=7, color="#1b7837")
        if job.ended_at is not None and job.exit_code:
            ax.axvline(rel(job.ended_at), color="#b2182b", ls=":", lw=1.0)
    if any(j.relaunch for j in k.jobs):
        handles.append(Line2D([], [], color="#1b7837", ls="--", lw=1.0, label="job relaunched"))
    if any(j.ended_at is not None and j.exit_code for j in k.jobs):
        handles.append(Line2D([], [], color="#b2182b", ls=":", lw=1.0, label="job exited non-zero"))
    return handles


def plot_run(analysis: RunAnalysis, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Write the figure to ``path`` (PNG, or whatever its suffix names)."""
    plt = _pyplot()
    fig = run_figure(analysis, title=title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    log.debug("wrote %s", path)


def run_figure(analysis: RunAnalysis, *, title: str | None = None) -> Any:
    """The run's matplotlib figure. Its artists carry gids (``worker``, ``notice``, ``departure``,
    ``join``, ``commit:<kind>``, ``ring_size``), so what it shows can be checked without pixels."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    a = analysis

    def rel(t: float) -> float:
        return t - a.started_at

    workers = list(a.workers)
    height = 2.2 + 0.42 * max(1, len(workers))
    fig, (ax_steps, ax_bars) = plt.subplots(
        2, 1, sharex=True, figsize=(11, height + 2.4),
        gridspec_kw={"height_ratios": [2.4, height], "hspace": 0.08})

    # ---- top: steps and ring size
    for segment in _progress_segments(a):
        ax_steps.plot([rel(p.t) for p in segment], [p.step for p in segment], color="#333333",
                      lw=1.6, marker=".", ms=3)
    ax_steps.set_ylabel("step")
    ax_steps.grid(alpha=0.3)
    ax_size = ax_steps.twinx()
    if a.rings:
        xs, ys = _ring_size_series(a)
        ax_size.step([rel(x) for x in xs], ys, where="post", color="#7b3294", lw=1.2, alpha=0.8, gid="ring_size")
        ax_size.set_ylim(0, max(ys) + 1)
        ax_size.yaxis.get_major_locator().set_params(integer=True)
    ax_size.set_ylabel("workers in ring", color="#7b3294")
    for c in a.commits:
        marker, colour, size = COMMIT_STYLE.get(c.kind, ("o", "black", 30))
        ax_steps.scatter([rel(c.t)], [c.step], marker=marker, color=colour, s=size * 0.6, zorder=4)
    for j in a.joins:
        if j.stalled_from is not None and j.resumed_at is not None and j.stall_s is not None:
            # the survivors trained on no ring from their last step to their first on the bigger one
            ax_steps.axvspan(rel(j.stalled_from), rel(j.resumed_at), color="#2166ac", alpha=0.12, lw=0)
            ax_steps.annotate(f"join {j.host}: stall {j.stall_s:.1f} s", (rel(j.resumed_at), j.step),
                              xytext=(4, -14), textcoords="offset points", fontsize=7, color="#2166ac")
    ax_steps.legend(handles=[Line2D([], [], color="#333333", lw=1.6, label="step"),
                             Line2D([], [], color="#7b3294", lw=1.2, label="workers in ring")],
                    loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=8, frameon=False)
    keeper_handles = _draw_keeper(ax_steps, a, rel) if a.keeper is not None else []
    if keeper_handles:  # a legend of its own, inside the panel (the twin axis holds it: one legend per axis)
        ax_size.legend(handles=keeper_handles, loc="upper left", fontsize=7, framealpha=0.8)

    # ---- bottom: one bar per worker lifetime
    index = {(w.host, w.pid): i for i, w in enumerate(workers)}
    for i, w in enumerate(workers):
        ax_bars.barh(i, max(w.seconds, 0.05), left=rel(w.started_at), height=0.55,
                     color=OUTCOME_COLOURS.get(w.outcome, "grey"), alpha=0.85, edgecolor="black", lw=0.5,
                     gid="worker")
        if w.notice_at is not None:
            # above the bar, pointing at it: the departure marker sits on the bar a moment later
            ax_bars.scatter([rel(w.notice_at)], [i - 0.42], marker="v", color="black", s=60, zorder=5,
                            clip_on=False, gid="notice")
    for p in a.preemptions:
        row = index.get((p.host, p.pid))
        if row is not None:
            ax_bars.scatter([rel(p.departed_at)], [row], marker="X" if not p.notice else "P",
                            color="#b2182b" if not p.notice else "#8c510a", s=70, zorder=5, gid="departure")
    for j in a.joins:
        row = index.get((j.host, j.pid))
        if row is not None:
            ax_bars.scatter([rel(j.t)], [row], marker=">", color="#2166ac", s=60, zorder=5, gid="join")
    label_of = {w.host: i for i, w in enumerate(workers)}
    for c in a.commits:
        marker, colour, size = COMMIT_STYLE.get(c.kind, ("o", "black", 30))
        row = next((index[k] for k in index if k[0] == c.host
                    and workers[index[k]].started_at <= c.t <= workers[index[k]].ended_at),
                   label_of.get(c.host))
        if row is not None:
            ax_bars.scatter([rel(c.t)], [row], marker=marker, color=colour, s=size, zorder=6, gid=f"commit:{c.kind}")
    ax_bars.set_yticks(range(len(workers)))
    ax_bars.set_yticklabels([f"{w.label}" for w in workers], fontsize=8)
    ax_bars.invert_yaxis()
    ax_bars.set_xlabel("seconds since the first worker started")
    ax_bars.grid(axis="x", alpha=0.3)
    # the keeper may act before the first worker starts (it brings the VMs up) and after the last ends
    keeper_times = [rel(e.t) for e in a.timeline if e.kind.startswith("keeper_")]
    ax_bars.set_xlim(left=min(0.0, *(rel(w.started_at) for w in workers), *keeper_times) - 0.5,
                     right=max(rel(a.ended_at), *(rel(w.ended_at) for w in workers), *keeper_times) * 1.02 + 0.5)

    handles: list[Any] = [Patch(color=colour, label=outcome) for outcome, colour in OUTCOME_COLOURS.items()
               if any(w.outcome == outcome for w in workers)]
    handles += [
        Line2D([], [], ls="", marker="v", color="black", label="notice"),
        Line2D([], [], ls="", marker="P", color="#8c510a", label="left (with notice)"),
        Line2D([], [], ls="", marker="X", color="#b2182b", label="vanished (no notice)"),
        Line2D([], [], ls="", marker=">", color="#2166ac", label="joined"),
    ]
    handles += [Line2D([], [], ls="", marker=m, color=col, label=f"{kind} commit")
                for kind, (m, col, _s) in COMMIT_STYLE.items() if any(c.kind == kind for c in a.commits)]
    ax_bars.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22 * 3 / height),
                   ncol=min(5, len(handles)), fontsize=8, frameon=False)

    done = "completed" if a.completed else "did not complete"
    ax_steps.set_title(title or (f"{len(workers)} workers, {len(a.preemptions)} departures, "
                                 f"{len(a.joins)} joins; {done} at step {a.final_step} in {a.wall_s:.0f} s"),
                       fontsize=10, loc="right")
    return fig


__all__ = ["PlotUnavailableError", "plot_run", "run_figure"]
