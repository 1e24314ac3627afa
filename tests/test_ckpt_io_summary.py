"""ckpt-io's restore ratios come from the rows they name: the best restore against the faster floor."""
from __future__ import annotations

import pytest

import bench.common as bc
from bench.ckpt_io import FILES, FLOOR, OURS, Config, Row, summarize


def rows(one_file_s: float, files_s: float, restores_s: tuple[float, ...]) -> list[Row]:
    common = {"store": "local", "size": "1000MB", "state_bytes": 10**9}
    out = [Row(**common, op="save", method=OURS[0], seconds=bc.spread([2.0]), writers=1),
           Row(**common, op="restore", method=FLOOR[1], seconds=bc.spread([one_file_s])),
           Row(**common, op="restore", method=FILES[1], seconds=bc.spread([files_s]))]
    return out + [Row(**common, op="restore", method=OURS[1], seconds=bc.spread([s]), writers=1, readers=r + 1)
                  for r, s in enumerate(restores_s)]


@pytest.mark.parametrize(("one_file_s", "files_s", "restores_s", "best_cold", "vs_one_file"), [
    (0.5, 0.8, (1.0, 0.6), 0.5 / 0.6, 0.5 / 0.6),  # one file is the faster floor
    (0.9, 0.6, (0.7, 0.8), 0.6 / 0.7, 0.9 / 0.7),  # 4 MiB files are
])
def test_restore_vs_best_cold_read_is_the_faster_floor_over_the_best_restore(
        one_file_s: float, files_s: float, restores_s: tuple[float, ...], best_cold: float, vs_one_file: float) -> None:
    cfg = Config((1000.0,), (1,), (1, 2), ("local",), ("floor",), 1, 1, 1000.0)
    summary = summarize(rows(one_file_s, files_s, restores_s), cfg)
    assert summary["restore_vs_best_cold_read"]["local"]["1000MB"] == pytest.approx(best_cold)
    assert summary["restore_vs_disk_floor"]["local"]["1000MB"] == pytest.approx(vs_one_file)
