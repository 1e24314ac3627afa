"""How the protocol's costs extrapolate to more workers, and the first limit a job meets (pure).

Each cost measured at a few ring sizes N is fitted as ``a + b*N`` or ``a + b*log2 N`` (the better by
residual); :func:`predict` evaluates the fits at any N against four limits:

- the bucket's write rate: an emergency commit's writes (per rank plus fixed) land within its commit time;
  above ``bucket_writes_per_s`` (GCS's initial rate per bucket; it ramps up under sustained load) the store
  throttles and the commit stretches;
- the commit: notice agreed -> checkpoint committed must end inside the notice window, less a margin;
- discovery: Horovod runs the discovery script about once a second, so a call (its CPU, plus one listing and
  the leaving records' reads, ``records_read_parallel`` at a time, each a round trip to the store) must
  take less than that;
- the notice allreduce: a round runs about once a second on every rank, and may take ``round_budget`` of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

BASES = ("linear", "log2")


@dataclass(frozen=True)
class Fit:
    """``a + b * x`` with ``x = N`` (linear) or ``x = log2 N``."""

    a: float
    b: float
    basis: str
    rms: float = 0.0

    def at(self, n: float) -> float:
        return self.a + self.b * (n if self.basis == "linear" else math.log2(n))


def fit(ns: Sequence[float], ys: Sequence[float], basis: str) -> Fit:
    """Least squares of ``ys`` against N or log2 N (one point: a constant)."""
    if basis not in BASES or not ns or len(ns) != len(ys):
        raise ValueError(f"need as many values as sizes and a basis in {BASES}")
    xs = [float(n) if basis == "linear" else math.log2(n) for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, ys)) / len(xs))
    return Fit(a, b, basis, rms)


def best_fit(ns: Sequence[float], ys: Sequence[float]) -> Fit:
    """The basis with the smaller residual (log2 on a tie: the slower growth); a cost that falls with N
    (noise, over a few sizes) is taken as flat, at its mean."""
    best = min((fit(ns, ys, b) for b in reversed(BASES)), key=lambda f: f.rms)
    return best if best.b >= 0 else Fit(sum(ys) / len(ys), 0.0, "linear")


@dataclass(frozen=True)
class ScalingInputs:
    """What the scale benchmark measured, as fits against N, and the limits to hold them to."""

    writes_per_rank: float        # store writes per rank of an emergency commit
    fixed_writes: float           # writes per commit besides those (manifest, marker, lease)
    commit_s: Fit                 # notice agreed -> emergency checkpoint committed
    discovery_cpu_s: Fit          # a discovery call's CPU at N hosts and N leaving records
    round_s: Fit                  # a notice round's own cost per rank (its allreduce included; not the wait for
                                  # a slower rank, which the step's gradient allreduce would pay anyway)
    store_rtt_s: float = 0.02     # a real bucket's round trip (the emulator's is about 1 ms)
    bucket_writes_per_s: float = 1000.0
    discovery_interval_s: float = 1.0
    records_read_parallel: int = 8  # hvd_transient.core.membership.READ_PARALLEL
    round_interval_s: float = 1.0
    round_budget: float = 0.01
    notice_window_s: float = 30.0
    commit_margin_s: float = 5.0


@dataclass(frozen=True)
class Prediction:
    n: int
    commit_writes: float
    commit_s: float
    write_rate: float             # writes per second while the commit runs
    discovery_s: float
    round_s: float
    #: each limit's use (>= 1: reached): bucket write rate, commit window, discovery interval, round budget
    use: dict[str, float]

    @property
    def reached(self) -> list[str]:
        return [name for name, u in self.use.items() if u >= 1.0]


def predict(inp: ScalingInputs, n: int) -> Prediction:
    writes = inp.writes_per_rank * n + inp.fixed_writes
    commit = max(inp.commit_s.at(n), 1e-3)
    reads = math.ceil(n / max(1, inp.records_read_parallel))  # a listing, then n records read in parallel
    discovery = max(inp.discovery_cpu_s.at(n), 0.0) + (1 + reads) * inp.store_rtt_s
    round_s = max(inp.round_s.at(n), 0.0)
    use = {"bucket write rate": writes / commit / inp.bucket_writes_per_s,
           "commit window": commit / (inp.notice_window_s - inp.commit_margin_s),
           "discovery": discovery / inp.discovery_interval_s,
           "notice allreduce": round_s / inp.round_interval_s / inp.round_budget}
    return Prediction(n, writes, commit, writes / commit, discovery, round_s, use)


def first_limits(inp: ScalingInputs, up_to: int = 1 << 16) -> dict[str, int | None]:
    """Per limit, the smallest N that reaches it (None: not up to ``up_to``), earliest first."""
    found: dict[str, int | None] = {}
    for n in range(2, up_to + 1):
        for name in predict(inp, n).reached:
            found.setdefault(name, n)
    names = predict(inp, 2).use
    return dict(sorted(((k, found.get(k)) for k in names), key=lambda kv: kv[1] or math.inf))


__all__ = ["Fit", "Prediction", "ScalingInputs", "best_fit", "first_limits", "fit", "predict"]
