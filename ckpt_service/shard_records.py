"""Shard records: what each writer reports to the coordinator, and the check that they cover the plan.

A record travels through a gather (a Horovod collective, or the store itself) in its
JSON form, so any collective that carries JSON can carry it::

    {"rank": 1, "nonce": "3f2a...", "pieces": [<PieceRecord fields>, ...], "bytes": 1048576}
    {"rank": 1, "error": "RuntimeError: device lost", "pieces": [], "bytes": 0}
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ckpt_service.errors import IncompleteShardRecordsError, WriterFailedError
from ckpt_service.manifest import PieceRecord
from ckpt_service.plan import SavePlan

#: A shard record's JSON form (:meth:`ShardRecord.to_json`).
RecordJSON = dict[str, Any]


@dataclass(frozen=True)
class ShardRecord:
    """The pieces one writer wrote for a step, or why it wrote none."""

    rank: int
    pieces: tuple[PieceRecord, ...] = ()
    nonce: str | None = None  # the writer's attempt, part of every key it wrote
    error: str | None = None  # set on a writer that failed: the coordinator abandons the step

    @classmethod
    def failed(cls, rank: int, exc: BaseException) -> ShardRecord:
        return cls(rank, error=f"{type(exc).__name__}: {exc}")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def to_json(self) -> RecordJSON:
        body: RecordJSON = {"rank": self.rank}
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
            error = body.get("error")
            nonce = body.get("nonce")
            return cls(rank=int(body["rank"]), pieces=tuple(PieceRecord(**p) for p in body["pieces"]),
                       nonce=str(nonce) if nonce is not None else None, error=str(error) if error else None)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise IncompleteShardRecordsError(
                f"a writer's shard record is malformed ({exc!r}): {str(body)[:200]}") from exc


def pieces_to_commit(step: int, plan: SavePlan, records: Sequence[ShardRecord]) -> tuple[PieceRecord, ...]:
    """Every writer's pieces in plan order, provided no writer failed and together they are the plan's pieces.

    Raises WriterFailedError naming the failed writers, or IncompleteShardRecordsError.
    """
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
