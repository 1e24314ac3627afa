"""The commit-scaling model: fits that recover their line, and limits reached where the arithmetic says."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hvd_transient.report.scaling import Fit, ScalingInputs, best_fit, first_limits, fit, predict

NS = (2, 4, 8, 16)


def test_fits_recover_a_line_in_n_and_in_log2_n() -> None:
    lin = best_fit(NS, [1.0 + 0.5 * n for n in NS])
    assert (lin.basis, lin.a, lin.b) == ("linear", pytest.approx(1.0), pytest.approx(0.5)) and lin.rms < 1e-9
    log = best_fit(NS, [3.0 + 2.0 * math.log2(n) for n in NS])
    assert log.basis == "log2" and log.at(1024) == pytest.approx(23.0)


def test_a_cost_that_falls_with_n_is_taken_as_flat() -> None:
    assert best_fit(NS, [4.0, 3.0, 2.0, 1.0]) == Fit(2.5, 0.0, "linear")
    assert fit([8], [5.0], "linear").at(1024) == 5.0
    with pytest.raises(ValueError):
        fit(NS, [1.0], "cubic")


def flat(value: float) -> Fit:
    return Fit(value, 0.0, "linear")


def test_each_limit_is_reached_where_its_arithmetic_says() -> None:
    inp = ScalingInputs(writes_per_rank=2.0, fixed_writes=4.0, commit_s=flat(1.0), discovery_cpu_s=flat(0.0),
                        round_s=Fit(0.0, 0.001, "log2"), store_rtt_s=0.01)
    p = predict(inp, 1024)
    assert p.commit_writes == 2052 and p.write_rate == pytest.approx(2052.0)
    assert p.discovery_s == pytest.approx(1.29) and p.round_s == pytest.approx(0.010)
    assert set(p.reached) == {"bucket write rate", "discovery", "notice allreduce"}
    # a listing and N/8 rounds of reads, 10 ms each, reach 1 s at N=785 (1 + 99 round trips);
    # 2N+4 writes in 1 s reach 1,000/s at N=498; 1 ms x log2 N 10 ms at 1,024
    assert first_limits(inp) == {"discovery": 785, "bucket write rate": 498, "notice allreduce": 1024,
                                 "commit window": None}
    one_at_a_time = predict(replace(inp, records_read_parallel=1), 1024)
    assert one_at_a_time.discovery_s == pytest.approx(10.25)
