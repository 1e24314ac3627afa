"""Randomised fault schedules through the real Lease + put_resolved over a MemoryStore.

Faults on lease CAS puts: pass / applied-reply-lost / not-reached / timed-out-still-in-flight (lands
later); read-backs may fail. Late requests land at random store calls (mode "mid": any call, so also
between _renew's read and its write-on-top; mode "between": only between operations).
Checks: S4 every applied lease record's fence number > the previous one's; S1 after a confirmed steal
by master-b, master-a's fence never returns; S2 after release, fence never returns without acquire;
L1 master-a, the only holder (no steal, not released), never gets LeaseLostError, and recovers
once faults stop."""
from __future__ import annotations

import json
import random

import pytest

from ckpt_service.errors import LeaseLostError, PreconditionFailedError, StoreDeadlineError, StoreUnavailableError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.stores.memory import MemoryStore
from ckpt_service.testing.delegating import DelegatingStore

STEPS = 60
SEEDS = 1500


class Violation(AssertionError):
    pass


class Inner(MemoryStore):
    def __init__(self):
        super().__init__("fuzz")
        self.last_fence = -1
        self.applied = []

    def put(self, key, data, *, if_generation_match=None):
        g = super().put(key, data, if_generation_match=if_generation_match)
        if "lease" in key:
            rec = json.loads(data)
            if rec["fence"] <= self.last_fence:
                raise Violation(f"S4: fence number {rec['fence']} written after {self.last_fence}")
            self.last_fence = rec["fence"]
            self.applied.append((rec["holder"], rec["fence"], rec["released"], g))
        return g


class Fuzz(DelegatingStore):
    def __init__(self, inner, rng, log, mid):
        super().__init__(inner)
        self.rng, self.log, self.mid, self.on = rng, log, mid, True
        self.late = []

    def maybe_land(self):
        for item in list(self.late):
            if self.rng.random() < 0.3:
                self.late.remove(item)
                key, data, exp = item
                try:
                    self.inner.put(key, data, if_generation_match=exp)
                    self.log.append(f"  late write (fence {json.loads(data)['fence']}, on g{exp}) LANDS")
                except PreconditionFailedError:
                    self.log.append(f"  late write (on g{exp}) refused")

    def land_all(self):
        for key, data, exp in self.late:
            try:
                self.inner.put(key, data, if_generation_match=exp)
                self.log.append(f"  late write (on g{exp}) LANDS (final)")
            except PreconditionFailedError:
                pass
        self.late.clear()

    def put(self, key, data, *, if_generation_match=None):
        if "lease" not in key or if_generation_match is None or not self.on:
            return self.inner.put(key, data, if_generation_match=if_generation_match)
        if self.mid:
            self.maybe_land()
        r = self.rng.random()
        who = json.loads(data)["holder"]
        if r < 0.45:
            self.log.append(f"  put {who} on g{if_generation_match}: sent")
            return self.inner.put(key, data, if_generation_match=if_generation_match)
        if r < 0.6:
            g = self.inner.put(key, data, if_generation_match=if_generation_match)
            self.log.append(f"  put {who} on g{if_generation_match}: applied g{g}, reply lost")
            raise StoreDeadlineError("reply lost", attempted=True)
        if r < 0.75:
            self.log.append(f"  put {who} on g{if_generation_match}: not reached")
            raise StoreUnavailableError("reset")
        self.late.append((key, data, if_generation_match))
        self.log.append(f"  put {who} on g{if_generation_match}: timed out, in flight")
        raise StoreDeadlineError("timed out", attempted=True)

    def get_versioned(self, key):
        if "lease" in key and self.on:
            if self.mid:
                self.maybe_land()
            if self.rng.random() < 0.25:
                self.log.append("  read fails")
                raise StoreDeadlineError("read failed", attempted=True)
        return self.inner.get_versioned(key)


def run(seed, mid, steal, log=None):
    rng = random.Random(seed)
    log = [] if log is None else log
    inner = Inner()
    s = Fuzz(inner, rng, log, mid)
    a = Lease(s, "master-a")
    s.on = False
    a.acquire()
    s.on = True
    released = False
    b_holds = False
    b = Lease(inner, "master-b")
    for step in range(STEPS):
        if not mid:
            s.maybe_land()
        op = rng.random()
        if steal and not b_holds and op < 0.05:
            b.acquire(steal=True)
            b_holds = True
            log.append(f"b steals (fence {b.generation})")
            continue
        if not b_holds and op < 0.10:
            if released:
                try:
                    a.acquire()
                    released = False
                    log.append(f"a acquires again -> {a.generation}")
                except (StoreUnavailableError, LeaseHeldError) as e:
                    log.append(f"a acquire: {type(e).__name__}")
            else:
                released = True
                try:
                    a.release()
                    log.append("a release ok")
                except StoreUnavailableError as e:
                    log.append(f"a release: {type(e).__name__}")
            continue
        log.append(f"a fence (held g{a.object_generation}, unresolved {len(a._unresolved)})")
        try:
            n = a.fence()
            log.append(f"  -> ok fence {n}")
            if b_holds:
                raise Violation("S1: a fenced after b's steal")
            if released:
                raise Violation("S2: a fenced after its release")
        except LeaseLostError:
            log.append("  -> LeaseLostError")
            if not b_holds and not released:
                raise Violation("L1: the only holder lost the lease")
            if not b_holds:
                pass
        except StoreUnavailableError as e:
            log.append(f"  -> {type(e).__name__}")
    # faults stop
    s.on = False
    s.land_all()
    if b_holds:
        with pytest.raises(LeaseLostError):
            a.fence()
        b.fence()
        return
    if released:
        a.acquire()
    try:
        a.fence()
    except LeaseLostError:
        raise Violation("L1: no recovery after faults stopped")


@pytest.mark.parametrize("mid", [False, True], ids=["late-between-ops", "late-any-call"])
@pytest.mark.parametrize("steal", [False, True], ids=["alone", "with-steal"])
def test_fuzz(mid, steal) -> None:
    fails = {}
    for seed in range(SEEDS):
        log = []
        try:
            run(seed, mid, steal, log)
        except Violation as v:
            fails.setdefault(str(v), []).append((seed, log))
    if fails:
        msg = []
        for what, hits in fails.items():
            seed, log = hits[0]
            msg.append(f"{what}: {len(hits)}/{SEEDS} seeds; first seed {seed}, its last steps:\n" + "\n".join(log[-8:]))
        pytest.fail("\n".join(msg), pytrace=False)
