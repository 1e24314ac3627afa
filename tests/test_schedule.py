"""Preemption schedules (pure)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hvd_transient.testing.schedule import (
    Action,
    ScheduleError,
    default_schedule,
    lifetime_schedule,
    load_schedule,
    sample_lifetime_h,
)


def test_default_schedule_tells_the_story() -> None:
    actions = default_schedule(300)
    assert [(a.action, a.target) for a in actions] == [("notice", "worker"), ("notice", "master"), ("join", "new")]
    assert [a.at_step for a in actions] == [60, 120, 180]
    # with the keeper refilling preempted VMs, the story needs no scripted join
    assert [a.action for a in default_schedule(300, join=False)] == ["notice", "notice"]


def test_due() -> None:
    assert Action("notice", "worker", at_step=10).due(10, 0.0)
    assert not Action("notice", "worker", at_step=10).due(9, 999.0)
    assert Action("kill", "master", at_s=5.0).due(0, 5.0)


def test_load_schedule(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"at_step": 5, "action": "kill", "target": "127.0.1"},
                                {"at_s": 30, "action": "join", "target": "new"}]))
    assert load_schedule(path) == (Action("kill", "127.0.1", at_step=5), Action("join", "new", at_s=30))


@pytest.mark.parametrize("body,match", [
    ('{"not": "a list"}', "JSON list"),
    ('[{"at_step": 5, "action": "explode", "target": "x"}]', "unknown action"),
    ('[{"at_step": 5, "at_s": 3, "action": "kill", "target": "x"}]', "exactly one"),
    ('[{"action": "kill", "target": "x", "when": 3}]', "at_step or at_s"),
    ('not json', "cannot read"),
])
def test_bad_schedules_are_clear(tmp_path: Path, body: str, match: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(body)
    with pytest.raises(ScheduleError, match=match):
        load_schedule(path)


def test_lifetimes_follow_the_paper_shape() -> None:
    rng = random.Random(7)
    draws = [sample_lifetime_h(rng) for _ in range(20000)]
    early = sum(d < 2.0 for d in draws) / len(draws)
    full = sum(d == 24.0 for d in draws) / len(draws)
    assert 0.18 < early < 0.22 and 0.68 < full < 0.72


def test_lifetime_schedule_is_seeded_and_compressed() -> None:
    hosts = [f"h{i}" for i in range(40)]
    a = lifetime_schedule(hosts, seed=3, run_s=600, day_s=600)
    assert a == lifetime_schedule(hosts, seed=3, run_s=600, day_s=600)
    assert a != lifetime_schedule(hosts, seed=4, run_s=600, day_s=600)
    assert all(x.action == "notice" and 0 < (x.at_s or 0) < 600 for x in a)
    assert [x.at_s for x in a] == sorted(x.at_s for x in a)
    assert 0 < len(a) < len(hosts)  # most VMs live the full day
