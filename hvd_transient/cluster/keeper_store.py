"""The keeper's state between runs: its JSON form (pure), and :class:`StateFile`, which keeps it as
``keeper/<cluster>.json`` in the run store, so a restarted keeper - or one run from cron with
``--once`` - carries on where it stopped."""
from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any

from hvd_transient.cluster.keeper_state import Backoff, KeeperState, Spend

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)

STATE_PREFIX = "keeper/"


def state_to_json(state: KeeperState) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(state)


def state_from_json(doc: object) -> KeeperState:
    """The saved state, or a fresh one (with a warning) for anything unreadable."""
    try:
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")

        def opt(value: object) -> float | None:
            return None if value is None else _finite(value)

        spend = doc.get("spend") or {}
        return KeeperState(
            backoffs=tuple(Backoff(str(b["zone"]), bool(b["spot"]), int(b["failures"]), _finite(b["until"]),
                                   str(b.get("code", ""))) for b in doc.get("backoffs") or ()),
            no_spot_since=opt(doc.get("no_spot_since")),
            spend=Spend(_finite(spend.get("spot", 0.0)), _finite(spend.get("on_demand", 0.0)),
                        _finite(spend.get("on_demand_seconds", 0.0))),
            observed_at=opt(doc.get("observed_at")),
            running=tuple((str(n), bool(s)) for n, s in doc.get("running") or ()),
            fallback_since=opt(doc.get("fallback_since")),
            fallback_spend_mark=_finite(doc.get("fallback_spend_mark", 0.0)),
            budget_note=str(doc.get("budget_note", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring the keeper's saved state (%s): starting afresh", exc)
        return KeeperState()


def _finite(value: object) -> float:
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


class StateFile:
    """The keeper's state as ``keeper/<cluster>.json`` in the run store; failures only warn."""

    def __init__(self, store: "ObjectStore", cluster: str) -> None:
        self.store, self.key = store, f"{STATE_PREFIX}{cluster}.json"

    def load(self) -> KeeperState:
        try:
            found = self.store.get_versioned(self.key)
        except Exception as exc:  # the keeper must run even when the store is unreachable
            log.warning("could not read %s from %s: %s", self.key, self.store.url, exc)
            return KeeperState()
        if found is None:
            return KeeperState()
        try:
            return state_from_json(json.loads(found[0]))
        except ValueError as exc:
            log.warning("%s is not JSON (%s): starting afresh", self.key, exc)
            return KeeperState()

    def save(self, state: KeeperState) -> None:
        try:
            self.store.put(self.key, json.dumps(state_to_json(state), sort_keys=True).encode())
        except Exception as exc:
            log.warning("could not save the keeper's state to %s: %s", self.store.url, exc)


__all__ = ["STATE_PREFIX", "StateFile", "state_from_json", "state_to_json"]
