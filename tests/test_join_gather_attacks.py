"""Attacks on "VMs that started together join together" (``--join-gather``, ``JoinGate.gather_s``).

A ready VM that started after the job's launch is also held back while a VM that started within gather_s of it
is still warming up, for at most gather_s after the first of them was ready. The promises attacked:

1. bounded: a ready VM is held back at most gather_s after its own ready time, never past its join timeout, and
   never for a VM that started more than gather_s away or after it was ready, was present at launch, or is past
   its join timeout (one excluded as leaving still counts: the cloud lists it);
2. nothing is listed later than before except by that hold; gather_s 0 is exactly the old rule;
3. together: the VMs of a group that are ready when the hold ends are listed in the same discovery call;
4. a bad --join-gather / HVDT_JOIN_GATHER_S is refused with exit status 2, naming the option;
5. discovery never crashes, whatever ready records are in the store and whatever start times the hosts have.

Through the pure ``JoinGate.admit`` (a deterministic replay of discovery calls, and hypothesis searches over
groups of VMs) and the real ``hvd-transient discover`` (``cli.main``) on a ``LocalStore`` and a local-backend
state file. A test marked xfail(strict) is a known limit; its reason says what goes wrong.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_service.stores import LocalStore
from hvd_transient.core.membership import publish_leaving
from hvd_transient.discovery import cli
from hvd_transient.discovery.hosts import Host
from hvd_transient.discovery.ready import JoinGate, ReadyRecord, publish_ready
from hvd_transient.gcp.instances import Incarnation
from hvd_transient.store_keys import ready_key

pytestmark = pytest.mark.timeout(60)

SINCE = 1000.0


def vm(name: str, started_at: float | None, instance_id: str | None = None, aliases: tuple[str, ...] = ()) -> Host:
    incarnation = None if started_at is None and instance_id is None else Incarnation(instance_id, started_at)
    return Host(name, 1, frozenset(aliases), incarnation)


def names(hosts: list[Host]) -> list[str]:
    return [host.name for host in hosts]


def old_rule(gate: JoinGate, hosts: list[Host], records: list[ReadyRecord], now: float) -> list[Host]:
    """The gate before --join-gather: a VM is listed once not awaited, or ready."""
    return JoinGate(gate.standby_since, gate.join_timeout_s, gather_s=0.0).admit(hosts, records, now)


def replay(gate: JoinGate, starts: dict[str, float], ready: dict[str, float | None], times: list[float], *,
           appear_at_start: bool = True) -> dict[float, list[str]]:
    """What discovery lists at each call time: a VM is in the cloud's list from its start (or always), and its
    ready record is in the store from its ready time on (agreeing clocks)."""
    listed = {}
    for now in times:
        hosts = [vm(name, start) for name, start in starts.items() if start <= now or not appear_at_start]
        records = [ReadyRecord(name, at) for name, at in ready.items() if at is not None and at <= now]
        listed[now] = names(gate.admit(hosts, records, now))
    return listed


def first_listed(listing: dict[float, list[str]], name: str) -> float | None:
    return next((now for now, hosts in sorted(listing.items()) if name in hosts), None)


def grid(start: float, stop: float, step: float = 0.5) -> list[float]:
    return [start + step * i for i in range(int((stop - start) / step) + 1)]


# ---- promise 1 and 2, deterministic ------------------------------------------------------------------------------


def test_a_ready_vm_is_held_at_most_gather_s_after_its_own_ready_time_and_never_past_its_join_timeout():
    gate = JoinGate(SINCE, join_timeout_s=120.0, gather_s=10.0)
    # b never comes ready: a (ready at 1040) is listed at 1050 exactly, not one call later
    listing = replay(gate, {"a": 1010.0, "b": 1012.0}, {"a": 1040.0, "b": None}, grid(1010.0, 1140.0))
    assert first_listed(listing, "a") == 1050.0
    assert first_listed(listing, "b") == 1132.0  # its own join timeout
    # a ready just before its join timeout: the timeout wins over the gather hold
    listing = replay(gate, {"a": 1010.0, "b": 1012.0}, {"a": 1127.0, "b": None}, grid(1010.0, 1140.0))
    assert first_listed(listing, "a") == 1130.0
    # the first of a group ready much earlier: a later one is not held longer than gather_s after its own time
    listing = replay(gate, {"a": 1010.0, "b": 1011.0, "c": 1013.0}, {"a": 1020.0, "b": 1029.0, "c": None},
                     grid(1010.0, 1140.0))
    assert first_listed(listing, "a") == first_listed(listing, "b") == 1030.0


def test_a_ready_vm_never_waits_for_a_far_launch_time_timed_out_or_startless_vm():
    gate = JoinGate(SINCE, join_timeout_s=120.0, gather_s=10.0)
    a = vm("a", 1010.0)
    ready = [ReadyRecord("a", 1040.0)]
    strangers = [
        vm("far", 1020.5),  # started 10.5 s after a
        vm("early", 999.5),  # 10.5 s before a
        vm("launch", SINCE),  # present at launch (started at standby_since, not after it)
        vm("startless", None, instance_id="77"),  # start unknown
        vm("plain", None),  # nothing known
    ]
    for stranger in strangers:
        assert names(gate.admit([a, stranger], ready, 1041.0))[0] == "a", stranger
    # one that is past its join timeout, next to a peer that started with a: only the peer holds a back
    timed_out = JoinGate(SINCE, join_timeout_s=35.0, gather_s=10.0)
    assert names(timed_out.admit([a, vm("old", 1005.0)], ready, 1041.0)) == ["a", "old"]
    assert names(timed_out.admit([a, vm("old", 1006.5)], ready, 1041.0)) == []  # still within its 35 s


def test_gather_zero_is_exactly_the_old_rule_on_an_example():
    gate = JoinGate(SINCE, join_timeout_s=120.0, gather_s=0.0)
    hosts = [vm("a", 1010.0), vm("b", 1010.0), vm("c", 1011.0)]
    records = [ReadyRecord("a", 1040.0)]
    assert names(gate.admit(hosts, records, 1040.0)) == ["a"]


# ---- promise 1-3: hypothesis over groups of VMs -------------------------------------------------------------------

GATHERS = st.sampled_from([0.0, 1.0, 2.5, 5.0, 10.0, 30.0])
TIMEOUTS = st.sampled_from([5.0, 20.0, 60.0, 120.0])
HALF = st.integers(min_value=0, max_value=2 * 80).map(lambda k: k / 2)  # 0 .. 80 s, on a 0.5 s grid


@st.composite
def fleets(draw):
    """VMs started after launch (on a 0.5 s grid, often equal), each ready some time after its start or never."""
    count = draw(st.integers(min_value=1, max_value=6))
    starts, ready = {}, {}
    for i in range(count):
        name = f"w{i}"
        starts[name] = SINCE + 0.5 + draw(st.integers(min_value=0, max_value=60)) / 2
        delay = draw(st.none() | HALF)
        ready[name] = None if delay is None else starts[name] + delay
    return starts, ready


def _calls(starts: dict[str, float]) -> list[float]:
    return grid(SINCE, max(starts.values()) + 130.0)


@settings(deadline=None, derandomize=True, max_examples=120)
@given(fleet=fleets(), gather=GATHERS, timeout=TIMEOUTS)
def test_search_the_hold_is_bounded_and_lists_nothing_the_old_rule_did_not(fleet, gather, timeout):
    """At every call: the gathered listing is a subset of the old one; gather 0 is the old one; a VM is listed
    once gather_s has passed since its own ready time, or once its join timeout has; and what holds a ready VM
    back is only the awaited VMs that started within gather_s of it (dropping every other VM changes nothing,
    as does adding VMs present at launch or without a start time)."""
    starts, ready = fleet
    gate = JoinGate(SINCE, join_timeout_s=timeout, gather_s=gather)
    extras = [vm("launch", SINCE - 3.0), vm("startless", None, instance_id="9"), vm("plain", None)]
    for now in _calls(starts):
        hosts = [vm(name, start) for name, start in starts.items()]
        records = [ReadyRecord(name, at) for name, at in ready.items() if at is not None and at <= now]
        new, old = names(gate.admit(hosts, records, now)), names(old_rule(gate, hosts, records, now))
        assert set(new) <= set(old)
        if gather == 0:
            assert new == old
        for name, start in starts.items():
            own = ready[name]
            if now >= start + timeout or (own is not None and now >= own + gather):
                assert name in new, (name, now)
            if name in old and name not in new:  # held by the gather rule: find what holds it
                peers = [h for h in hosts if gate.awaits(h, now) and abs(h.incarnation.started_at - start) <= gather]
                assert name in names(peers)
                assert names(gate.admit(peers, records, now)).count(name) == 0
                assert name not in names(gate.admit(hosts + extras, records, now))
            if name in new:
                assert name in names(gate.admit(hosts + extras, records, now))


@st.composite
def clean_groups(draw):
    """Groups of VMs that started together (all within gather_s of each other), groups more than 2 gather_s apart,
    each VM ready (if ever) only after all of its group started: no chains, no VM that starts after a peer was
    ready."""
    gather = draw(st.sampled_from([2.0, 5.0, 10.0]))
    starts, ready, group_of = {}, {}, {}
    base = SINCE + 1.0
    for g in range(draw(st.integers(min_value=1, max_value=3))):
        size = draw(st.integers(min_value=1, max_value=4))
        offsets = [draw(st.integers(min_value=0, max_value=int(2 * gather))) / 2 for _ in range(size)]
        last = base + max(offsets)
        for i, offset in enumerate(offsets):
            name = f"g{g}w{i}"
            starts[name], group_of[name] = base + offset, g
            delay = draw(st.none() | HALF)
            ready[name] = None if delay is None else last + delay
        base += 2 * gather + 1.0 + draw(st.integers(min_value=0, max_value=20))
    return gather, starts, ready, group_of


@settings(deadline=None, derandomize=True, max_examples=120)
@given(groups=clean_groups(), timeout=TIMEOUTS)
def test_search_ready_vms_of_a_clean_group_are_listed_in_the_same_call(groups, timeout):
    """Promise 3 where groups are unambiguous: when a VM is first listed through the gate (ready, before its join
    timeout), every VM of its group that is ready by then is listed in that same call."""
    gather, starts, ready, group_of = groups
    gate = JoinGate(SINCE, join_timeout_s=timeout, gather_s=gather)
    listing = replay(gate, starts, ready, _calls(starts))
    for name, start in starts.items():
        first = first_listed(listing, name)
        assert first is not None
        if first < start + timeout:  # listed through the gate, not by its timeout
            together = [peer for peer in starts if group_of[peer] == group_of[name]
                        and ready[peer] is not None and ready[peer] <= first]
            assert set(together) <= set(listing[first]), (name, first)


@settings(deadline=None, derandomize=True, max_examples=80)
@given(groups=clean_groups())
def test_search_without_timeouts_a_listed_vm_stays_listed(groups):
    """In clean groups, with no VM reaching its join timeout inside the window, a VM once listed stays listed."""
    gather, starts, ready, _ = groups
    gate = JoinGate(SINCE, join_timeout_s=10_000.0, gather_s=gather)
    listing = replay(gate, starts, ready, _calls(starts))
    seen: set[str] = set()
    for now in sorted(listing):
        assert seen <= set(listing[now]), now
        seen |= set(listing[now])


# ---- promises 2/3: the hold never drops a VM it listed; a chain of starts splits a group (a known limit) ----------


@pytest.mark.xfail(strict=True, reason=(
    "a known limit (docs/keras-and-mpi.md): groups are not transitive. a (1010) and b (1018) started 8 s apart "
    "and are both ready at 1041, but a waits only for b (listed at 1041) while b also waits for c (1026), "
    "warming up, until 1050: two ring changes where one would do (each VM waits for the VMs that started within "
    "gather_s of it, never longer than gather_s after the first of them was ready)"))
def test_vms_that_started_together_and_are_both_ready_are_listed_in_one_call_even_in_a_chain():
    gate = JoinGate(SINCE, join_timeout_s=120.0, gather_s=10.0)
    listing = replay(gate, {"a": 1010.0, "b": 1018.0, "c": 1026.0}, {"a": 1040.0, "b": 1041.0, "c": None},
                     grid(1026.0, 1060.0))
    assert first_listed(listing, "a") == first_listed(listing, "b")


def test_a_listed_vm_is_not_dropped_when_a_vm_that_started_with_it_appears():
    gate = JoinGate(SINCE, join_timeout_s=120.0, gather_s=10.0)
    listing = replay(gate, {"a": 1010.0, "b": 1018.0}, {"a": 1015.0, "b": None}, grid(1010.0, 1030.0))
    assert listing[1016.0] == ["a"]
    assert all("a" in listing[now] for now in listing if now >= 1016.0)


def test_a_listed_vm_is_not_dropped_when_a_ready_peer_reaches_its_join_timeout():
    gate = JoinGate(SINCE, join_timeout_s=120.0, gather_s=10.0)
    listing = replay(gate, {"a": 1008.0, "b": 1001.0, "c": 1005.0}, {"a": 1116.0, "b": 1110.0, "c": None},
                     grid(1100.0, 1130.0))
    assert listing[1120.0] == ["a", "b"]
    assert all("a" in listing[now] for now in listing if now >= 1120.0)


# ---- the real command ------------------------------------------------------------------------------------------


def discover(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse refuses a bad option with SystemExit(2)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def setup(tmp_path: Path, hosts: list[dict], since: float | None, *extra: str) -> tuple[LocalStore, list[str]]:
    """A local-backend state file of ``hosts`` and a store; the discover arguments (gated from ``since``)."""
    state = tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": hosts}))
    store_dir = tmp_path / "store"
    argv = ["--backend", "local", "--state-file", str(state), "--store", str(store_dir), *extra]
    if since is not None:
        argv += ["--standby-since", repr(since)]
    return LocalStore(store_dir), argv


def test_cli_lists_a_group_in_one_call_once_all_are_ready_and_waits_for_a_vm_under_notice_at_most_gather_s(
        tmp_path, capsys):
    """A VM published as leaving is not listed, but it still counts as a peer (the cloud lists it: were its record
    to expire, it would hold its group back again), so the others wait for it at most gather_s after the first
    of them was ready."""
    now = time.time()
    store, argv = setup(tmp_path, [{"host": "localhost", "started_at": now - 300},
                                   {"host": "127.0.1", "started_at": now - 8},
                                   {"host": "127.0.2", "started_at": now - 6},
                                   {"host": "127.0.3", "started_at": now - 5}], now - 100)
    publish_ready(store, "127.0.1", now=now - 1)
    assert discover(argv, capsys)[:2] == (0, "localhost:1\n")
    publish_ready(store, "127.0.2", now=now - 1)
    assert discover(argv, capsys)[:2] == (0, "localhost:1\n")
    publish_leaving(store, "127.0.3", deadline=now + 25)
    assert discover(argv, capsys)[:2] == (0, "localhost:1\n")  # still within the hold
    assert discover(argv + ["--join-gather", "1"], capsys)[:2] == (0, "localhost:1\n127.0.1:1\n127.0.2:1\n")
    store.delete("hosts/leaving/127.0.3.json")
    publish_ready(store, "127.0.3", now=now - 1)
    assert discover(argv, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n127.0.2:1\n127.0.3:1\n")


def test_cli_gather_zero_and_the_env_give_the_old_listing(tmp_path, capsys, monkeypatch):
    """Each call as a fresh job's first (its own --listed-file): a VM once listed is never held back again."""
    now = time.time()
    store, argv = setup(tmp_path, [{"host": "127.0.1", "started_at": now - 8},
                                   {"host": "127.0.2", "started_at": now - 6}], now - 100)
    calls = iter(range(100))

    def fresh(*extra: str) -> list[str]:
        return [*argv, *extra, "--listed-file", str(tmp_path / f"listed-{next(calls)}.json")]

    publish_ready(store, "127.0.1", now=now - 1)
    assert discover(fresh(), capsys)[:2] == (0, "")
    assert discover(fresh("--join-gather", "0"), capsys)[:2] == (0, "127.0.1:1\n")
    monkeypatch.setenv("HVDT_JOIN_GATHER_S", "0")
    assert discover(fresh(), capsys)[:2] == (0, "127.0.1:1\n")
    assert discover(fresh("--join-gather", "30"), capsys)[:2] == (0, "")  # the option beats the env
    monkeypatch.setenv("HVDT_JOIN_GATHER_S", "0.5")  # the first was ready 1 s ago: the hold is over
    assert discover(fresh(), capsys)[:2] == (0, "127.0.1:1\n")


BAD_GATHERS = ["-1", "-0.5", "abc", "nan", "NaN", "inf", "1e999", "", " ", "10s", "1,5", "0x10"]


@pytest.mark.parametrize("value", BAD_GATHERS + ["-inf"])
def test_cli_refuses_a_bad_join_gather_option_with_status_2_naming_it(tmp_path, capsys, value):
    _, argv = setup(tmp_path, [{"host": "a", "started_at": time.time() - 5}], time.time() - 50)
    code, out, err = discover(argv + ["--join-gather", value], capsys)
    assert (code, out) == (2, "") and "--join-gather" in err and "Traceback" not in err, err
    code, out, err = discover(argv + [f"--join-gather={value}"], capsys)
    assert (code, out) == (2, "") and "--join-gather" in err, err


@pytest.mark.parametrize("value", BAD_GATHERS)
def test_cli_refuses_a_bad_join_gather_env_with_status_2_naming_the_option(tmp_path, capsys, monkeypatch, value):
    _, argv = setup(tmp_path, [{"host": "a", "started_at": time.time() - 5}], time.time() - 50)
    monkeypatch.setenv("HVDT_JOIN_GATHER_S", value)
    code, out, err = discover(argv, capsys)
    assert (code, out) == (2, "") and "--join-gather" in err and "Traceback" not in err, err


def test_cli_survives_whatever_ready_records_and_start_times(tmp_path, capsys):
    """Junk, stale and foreign records, and hosts with equal, missing, id-only and far-future start times."""
    now = time.time()
    hosts = [
        {"host": "localhost", "started_at": now - 300},
        {"host": "127.0.1", "started_at": now - 5, "instance_id": "41"},
        {"host": "127.0.2", "started_at": now - 5},  # the same start
        {"host": "127.0.3", "started_at": now - 5},
        {"host": "127.0.4"},  # no start time
        {"host": "127.0.5", "instance_id": "55"},  # an id only
        {"host": "127.0.6", "started_at": now + 1e6},  # a clock far ahead
        {"host": "127.0.7", "started_at": 1e300},
        {"host": "127.0.8", "started_at": -1e300},
        {"host": "127.0.9", "started_at": 0},
    ]
    store, argv = setup(tmp_path, hosts, now - 100)
    junk = {
        "127.0.1": json.dumps({"ready_at": now - 1, "instance_id": "40"}),  # another incarnation's id
        "127.0.2": json.dumps({"ready_at": now - 50}),  # from before this VM started
        "127.0.3": "{not json",
        "127.0.4": json.dumps({"ready_at": "soon"}),
        "127.0.5": json.dumps([now]),
        "127.0.6": '{"ready_at": NaN}',
        "127.0.7": '{"ready_at": Infinity}',
        "127.0.8": '{"ready_at": -Infinity}',
        "127.0.9": json.dumps({"ready_at": 1e308, "pid": "x", "instance_id": {"a": 1}}),
        "stranger": json.dumps({"ready_at": now}),
        "localhost": "",
    }
    for host, text in junk.items():
        store.put(ready_key(host), text.encode())
    store.put(ready_key("w-utf16"), json.dumps({"ready_at": now}).encode("utf-16"))
    store.put(ready_key("w-bytes"), b"\xff\xfe\x00garbage")
    store.put("hosts/ready/nested/deeper.json", json.dumps({"ready_at": now}).encode())
    store.put("hosts/ready/.json", b"{}")
    for gather in ("0", "10", "1e9"):
        code, out, err = discover(argv + ["--join-gather", gather], capsys)
        assert code == 0 and "Traceback" not in err, err
        listed = out.splitlines()
        assert {"localhost:1", "127.0.4:1", "127.0.5:1", "127.0.8:1", "127.0.9:1"} <= set(listed), listed
        # 127.0.1's only record names another instance and 127.0.2's predates its start: held
        assert "127.0.1:1" not in listed and "127.0.2:1" not in listed


def test_cli_survives_a_deeply_nested_ready_record(tmp_path, capsys):
    now = time.time()
    store, argv = setup(tmp_path, [{"host": "a", "started_at": now - 5}], now - 100)
    store.put(ready_key("a"), b"[" * 100_000)
    assert discover(argv, capsys)[:2] == (0, "")


def test_cli_survives_a_ready_record_with_a_huge_integer_time(tmp_path, capsys):
    now = time.time()
    store, argv = setup(tmp_path, [{"host": "a", "started_at": now - 5}], now - 100)
    store.put(ready_key("a"), b'{"ready_at": 1' + b"0" * 400 + b"}")
    assert discover(argv, capsys)[:2] == (0, "")


def test_cli_survives_a_host_with_a_huge_integer_start_time(tmp_path, capsys):
    now = time.time()
    state = tmp_path / "hosts.json"
    state.write_text('{"hosts": [{"host": "a", "started_at": 1' + "0" * 400 + "}]}")
    argv = ["--backend", "local", "--state-file", str(state), "--store", str(tmp_path / "store"),
            "--standby-since", repr(now - 100)]
    assert discover(argv, capsys)[0] in (0, 2)


def test_cli_does_not_drop_a_listed_vm_when_a_peer_appears(tmp_path, capsys):
    now = time.time()
    a = {"host": "127.0.1", "started_at": now - 8}
    store, argv = setup(tmp_path, [a], now - 100)
    publish_ready(store, "127.0.1", now=now - 3)
    assert discover(argv, capsys)[:2] == (0, "127.0.1:1\n")
    (tmp_path / "hosts.json").write_text(json.dumps({"hosts": [a, {"host": "127.0.2", "started_at": now - 1}]}))
    assert discover(argv, capsys)[:2] == (0, "127.0.1:1\n")
