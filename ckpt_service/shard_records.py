"""Shard records: what each writer reports to the coordinator, and the check that they make one save.

A record travels through a gather (a Horovod collective, or the store itself) in its
JSON form, so any collective that carries JSON can carry it::

    {"rank": 1, "step": 120, "attempt": "r3f2a-120-0", "plan": "<sha256>", "nonce": "3f2a...",
     "pieces": [<PieceRecord fields>, ...], "bytes": 1048576}
    {"rank": 1, "step": 120, "attempt": "r3f2a-120-0", "plan": "<sha256>", "error": "RuntimeError: device lost",
     "pieces": [], "bytes": 0}

``step``, ``attempt`` (None for a save through a collective that gave none) and ``plan`` (the
save plan's digest; None on a writer that failed before it could plan) tie a record to one
save: the coordinator commits only records of its own step, attempt and plan, so writers that
disagree (a replayed step's old attempt, another step, another state) never make a checkpoint.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ckpt_service import layout
from ckpt_service.errors import IncompleteShardRecordsError, MismatchedShardRecordsError, WriterFailedError
from ckpt_service.manifest import PieceRecord
from ckpt_service.plan import SavePlan

#: A shard record's JSON form (:meth:`ShardRecord.to_json`).
RecordJSON = dict[str, Any]


@dataclass(frozen=True)
class ShardRecord:
    """The pieces one writer wrote for a step, or why it wrote none."""

    rank: int
    pieces: tuple[PieceRecord, ...] = ()
    nonce: str | None = None  # the writer's own attempt, part of every key it wrote
    error: str | None = None  # set on a writer that failed: the coordinator abandons the step
    step: int | None = None  # None only in records of older versions, which are rejected
    attempt: str | None = None  # the save attempt all writers agreed on (None: the gather ties them)
    plan: str | None = None  # SavePlan.digest; None on a writer that failed before planning

    @classmethod
    def failed(cls, rank: int, exc: BaseException, *, step: int, attempt: str | None,
               plan: str | None) -> ShardRecord:
        return cls(rank, error=f"{type(exc).__name__}: {exc}", step=step, attempt=attempt, plan=plan)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def to_json(self) -> RecordJSON:
        body: RecordJSON = {"rank": self.rank, "step": self.step, "attempt": self.attempt, "plan": self.plan}
        if self.error is None:
            body["nonce"] = self.nonce
        else:
            body["error"] = self.error
        body["pieces"] = [asdict(p) for p in self.pieces]
        body["bytes"] = self.nbytes
        return body

    @classmethod
    def from_json(cls, body: Any) -> ShardRecord:
        try:
            error, nonce, step = body.get("error"), body.get("nonce"), body.get("step")
            attempt, plan = body.get("attempt"), body.get("plan")
            return cls(rank=int(body["rank"]), pieces=tuple(PieceRecord(**p) for p in body["pieces"]),
                       nonce=str(nonce) if nonce is not None else None, error=str(error) if error else None,
                       step=int(step) if step is not None else None,
                       attempt=str(attempt) if attempt is not None else None,
                       plan=str(plan) if plan is not None else None)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise IncompleteShardRecordsError(
                f"a writer's shard record is malformed ({exc!r}): {str(body)[:200]}") from exc


def mismatches(step: int, attempt: str | None, plan: SavePlan, records: Sequence[ShardRecord]) -> list[str]:
    """What makes each record not one of this save's (pure): one line per problem, naming the rank."""
    found: list[str] = []
    prefix = layout.step_prefix(step)
    planned = {(i.group, i.index): i.rank for i in plan.items}
    for r in records:
        if r.step != step:
            found.append(f"rank {r.rank} wrote step {r.step}" if r.step is not None
                         else f"rank {r.rank}'s record names no step (written by an older version)")
            continue  # its attempt, plan and keys are another save's: one line says it
        if r.attempt != attempt:
            found.append(f"rank {r.rank} wrote attempt {r.attempt!r}, not {attempt!r}")
            continue
        if r.plan is not None and r.plan != plan.digest:
            found.append(f"rank {r.rank} planned another state or world size (plan {r.plan[:12]}, "
                         f"not {plan.digest[:12]})")
            continue
        if r.plan is None and r.error is None:
            found.append(f"rank {r.rank}'s record names no plan")
            continue
        for p in r.pieces:
            if not p.key.startswith(prefix):
                found.append(f"rank {r.rank}'s piece {p.group}/{p.index} lies outside step {step} ({p.key})")
            elif p.writer != r.rank:
                found.append(f"rank {r.rank}'s piece {p.group}/{p.index} names writer {p.writer}")
            elif planned.get((p.group, p.index), r.rank) != r.rank:
                found.append(f"rank {r.rank} reported piece {p.group}/{p.index}, which the plan gives "
                             f"rank {planned[(p.group, p.index)]}")
    return found


def pieces_to_commit(step: int, plan: SavePlan, records: Sequence[ShardRecord], *,
                     attempt: str | None = None) -> tuple[PieceRecord, ...]:
    """Every writer's pieces in plan order, provided every record is of this step, ``attempt`` and
    plan, no writer failed, and together they are the plan's pieces.

    Raises MismatchedShardRecordsError naming the ranks and what differed, WriterFailedError
    naming the failed writers, or IncompleteShardRecordsError.
    """
    wrong = mismatches(step, attempt, plan, records)
    if wrong:
        raise MismatchedShardRecordsError(
            f"step {step} (attempt {attempt!r}): shard records of another save were gathered ({'; '.join(wrong)}); "
            "nothing was committed. Every rank of one save must pass the same step, attempt and tensors")
    failed = [f"rank {r.rank}: {r.error}" for r in records if r.error]
    if failed:
        raise WriterFailedError(f"step {step}: writers failed ({'; '.join(failed)}); nothing was committed")
    pieces = sorted((p for r in records for p in r.pieces), key=lambda p: (p.group, p.index))
    got = [(p.group, p.index, p.start, p.stop) for p in pieces]
    want = [(i.group, i.index, i.start, i.stop) for i in plan.items]
    if got != want:
        raise IncompleteShardRecordsError(
            f"step {step}: the writers' shard records do not cover the save plan exactly "
            f"({len(got)} pieces reported, {len(want)} planned); nothing was committed")
    return tuple(pieces)
