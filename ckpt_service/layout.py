"""Where things live under a run's store prefix (pure key naming).

    steps/000000000120/data/float32/00003.<nonce>/...   zarr v3 array, one piece
    steps/000000000120/records/rank-00001.json          a writer's shard record (store gather)
    steps/000000000120/manifest.<token>.json            the manifest
    commits/000000000120.json                           create-only commit marker
    lease/master.json                                   checkpoint-master lease

Commit markers live in their own small directory so that finding the committed
steps is one short listing, however many data objects the steps hold.
"""
from __future__ import annotations

STEPS_PREFIX = "steps/"
COMMITS_PREFIX = "commits/"
LEASE_KEY = "lease/master.json"


def step_prefix(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint steps are non-negative integers, got {step}")
    return f"{STEPS_PREFIX}{step:012d}/"


def commit_key(step: int) -> str:
    step_prefix(step)  # validates
    return f"{COMMITS_PREFIX}{step:012d}.json"


def parse_commit_key(key: str) -> int | None:
    name = key[len(COMMITS_PREFIX):]
    stem = name[: -len(".json")] if name.endswith(".json") else ""
    return int(stem) if stem.isdigit() else None


def manifest_key(step: int, token: str) -> str:
    return step_prefix(step) + f"manifest.{token}.json"


def record_key(step: int, rank: int) -> str:
    return step_prefix(step) + f"records/rank-{rank:05d}.json"


def piece_prefix(step: int, group: str, index: int, nonce: str) -> str:
    # The writer's nonce makes every attempt's keys unique: a late or zombie
    # writer can never overwrite bytes that a committed manifest points to.
    return step_prefix(step) + f"data/{group}/{index:05d}.{nonce}/"


def parse_step_dir(name: str) -> int | None:
    return int(name) if name.isdigit() else None
