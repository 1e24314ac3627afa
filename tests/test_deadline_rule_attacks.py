"""Attacks on the deadline rules: a VM under notice must leave before the cloud stops it, whatever the
watcher saw and whenever it looked, and never do worse than leaving at the notice. Real watchers against
the real metadata emulator (behind the per-path fault front of ``test_deadline_rule_edges``), and the pure
planning functions. Each test states the rule it attacks."""
from __future__ import annotations

import math
import socket
import struct
import threading
import time

import pytest
import test_watchers as shared
from test_deadline_rule_edges import Front, gce_path, static

from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound, decode_notice, encode_notice
from hvd_transient.core.leave_plan import plan_for_round, plan_leave, steps_to_next_round
from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE
from hvd_transient.watchers import AwsWatcher, GceWatcher, LocalWatcher
from hvd_transient.watchers.errors import MetadataGarbageError, MetadataTimeoutError, WatcherError
from hvd_transient.watchers.metadata_http import MetadataClient

pytestmark = [pytest.mark.timeout(60), pytest.mark.timed]  # bounds wall-clock times

emu, watchers = shared.emu, shared.watchers  # the fixtures
FAST = shared.FAST
NEAR = TransientConfig(store="memory://x", leave="near_deadline")
HOSTS = ["h0", "h1", "h2"]
#: a notice that appears while the watched key answers is seen within about 2 s; some slack
SEEN_WITHIN_S = 2.5


@pytest.fixture
def front(emu):
    f = Front(emu.url)
    yield f
    f.stop()


def hang(front: Front, conn: socket.socket) -> None:
    """Never answer (until the front stops)."""
    front.stopping.wait(30)


def reset_mid_reply(front: Front, conn: socket.socket) -> None:
    """Half a reply, then the connection torn down with a reset (SO_LINGER 0): what a crashing server does."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Length: 100\r\n\r\nFAL")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _trickle(head: bytes, tail: bytes) -> "callable":
    def rule(front: Front, conn: socket.socket) -> None:
        conn.sendall(head)
        while not front.stopping.wait(0.1):
            conn.sendall(tail)
    return rule


def _byte_by_byte(data: bytes):
    def rule(front: Front, conn: socket.socket) -> None:
        for b in data:
            if front.stopping.wait(0.2):
                return
            conn.sendall(bytes([b]))
    return rule


CHUNKED = b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nTransfer-Encoding: chunked\r\n\r\n"
TRICKLES = {
    "status-line": _byte_by_byte(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Length: 5\r\n\r\nFALSE"),
    "100-continue-flood": _trickle(b"", b"HTTP/1.1 100 Continue\r\n\r\n"),
    "chunk-trailer": _trickle(CHUNKED + b"5\r\nFALSE\r\n0\r\nX-T: ", b"a"),
    "many-trailers": _trickle(CHUNKED + b"5\r\nFALSE\r\n0\r\n", b"X-T: 1\r\n"),
    "negative-chunk-size": _trickle(CHUNKED + b"-5\r\nFALSE\r\n", b""),
    "body": _trickle(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Length: 999\r\n\r\n", b"F"),
}


# ---- rule 1: every request ends within its total time, with a typed error ---------------------------------
@pytest.mark.parametrize("fault", list(TRICKLES.values()), ids=list(TRICKLES))
def test_request_ends_within_its_total_with_a_typed_error_whatever_the_reply_trickles(emu, front, fault):
    """Rule 1: a reply trickled at any place (status line, 100-continue lines, chunk trailers, a negative
    chunk size, the body) ends the 1 s request within its total, as a MetadataTimeoutError or
    MetadataGarbageError. (Survived.)"""
    path = gce_path("instance/preempted")
    front.rules[path] = fault
    client = MetadataClient(connect_timeout=0.5, total_timeout=1.0)
    outcome: list[tuple[float, BaseException | None]] = []
    done = threading.Event()

    def call() -> None:
        start = time.monotonic()
        try:
            client.get(front.url(emu.url) + path, headers={"Metadata-Flavor": "Google"})
            outcome.append((time.monotonic() - start, None))
        except BaseException as exc:  # noqa: BLE001 - what it raised is the point
            outcome.append((time.monotonic() - start, exc))
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(4.0), "a 1 s request still had no end after 4 s"
    took, exc = outcome[0]
    assert took <= 1.8, f"a 1 s request took {took:.2f} s"
    assert isinstance(exc, (MetadataTimeoutError, MetadataGarbageError)), repr(exc)


def test_a_reply_reset_mid_way_is_a_typed_watcher_error(emu, front):
    """Rule 1: a server that closes mid-reply gives a typed WatcherError (MetadataTimeoutError /
    MetadataGarbageError / MetadataServerError), never a raw exception. A reset (RST) after half a reply
    raises the socket's ConnectionResetError as it is: ``request`` types only timeouts and HTTPException."""
    path = gce_path("instance/preempted")
    front.rules[path] = reset_mid_reply
    client = MetadataClient(connect_timeout=0.5, total_timeout=1.0)
    with pytest.raises(Exception) as info:
        client.get(front.url(emu.url) + path, headers={"Metadata-Flavor": "Google"})
    assert isinstance(info.value, WatcherError), f"raw {type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("total", [0.0, -1.0, math.nan, math.inf], ids=["zero", "negative", "nan", "inf"])
def test_a_request_with_a_total_that_is_no_bound_is_a_typed_error(emu, total):
    """Rule 1: a request ends within its total with a typed WatcherError (a total that is no positive finite
    number of seconds is a configuration mistake: WatcherConfigError), never a raw socket error."""
    client = MetadataClient(connect_timeout=0.5, total_timeout=1.0)
    with pytest.raises(Exception) as info:
        client.get(emu.gce_base_url("a") + "instance/preempted", headers={"Metadata-Flavor": "Google"}, total=total)
    assert isinstance(info.value, WatcherError), f"raw {type(info.value).__name__}: {info.value}"


# ---- rule 2: a notice is dated no later than the truth --------------------------------------------------
def test_gce_notice_on_a_vm_with_a_short_window_whose_attribute_fails_is_not_dated_late(emu, front, watchers):
    """Rule 2: a GCE notice is dated from the last clear read plus the VM's window. The VM was created with a
    10 s notice (``cluster up --preemption-notice-duration 10``, which writes the attribute); the attribute
    answers 503 at every read. The watcher dates the notice with the 30 s default: 20 s after the cloud stops
    the VM. Unknown window must not mean a longer guess."""
    emu.set_attribute("a", NOTICE_ATTRIBUTE, "10")
    front.rules[gce_path(f"instance/attributes/{NOTICE_ATTRIBUTE}")] = static(503, "busy")
    w = GceWatcher(front.url(emu.gce_base_url("a")), instance="a", long_poll_timeout=1, request_margin=0.5,
                   watch_maintenance=False, **FAST)
    watchers.append(w.start())
    front.wait_hits(gce_path("instance/preempted"), 2)
    emu.preempt("a", window=10)
    notice = w.wait(10)
    assert notice is not None
    truth = emu.instance("a").deadline
    assert notice.deadline <= truth, (f"dated {notice.deadline - truth:.1f} s after the VM is stopped "
                                      f"(basis {notice.deadline_basis}, window {w.window:g} s)")


@pytest.mark.parametrize("deadline_json", ["Infinity", "NaN", "ms", "1e300"])
def test_local_notice_file_deadline_that_is_no_time_is_not_trusted(tmp_path, deadline_json):
    """Rule 2 (and 4): a notice is dated no later than the truth. A notice file whose ``deadline`` is no
    epoch time (JSON ``Infinity`` / ``NaN``, epoch milliseconds, 1e300) is taken as it is: the notice round
    agrees on it and ``near_deadline`` plans a ``leave_at`` at infinity, so the VM never leaves, where
    ``at_notice`` leaves at once. At most the window from the read that saw it can be trusted."""
    text = str(int((time.time() + 30) * 1000)) if deadline_json == "ms" else deadline_json
    notice_file = tmp_path / "notice"
    notice_file.write_text('{"deadline": %s, "reason": "test"}' % text)
    w = LocalWatcher(notice_file, interval=0.05, window=30.0, initial_backoff=0.05, max_backoff=0.3)
    w.start()
    try:
        notice = w.wait(10)
    finally:
        w.stop()
    assert notice is not None
    # what every rank then plans for it (encoded, summed, decoded as the notice round does)
    now = time.time()
    summed = encode_notice(2, 3, notice.deadline, wall=now) + encode_notice(0, 3, None, wall=now) \
        + encode_notice(1, 3, None, wall=now)
    round_ = decode_notice(summed, 3, HOSTS)
    plan = plan_for_round(NEAR, HOSTS, round_, round_.deadline_of(2), now)
    assert math.isfinite(notice.deadline) and notice.deadline <= notice.detected_at + w.window, notice
    assert plan.at_once or plan.leave_at <= notice.detected_at + w.window, plan


# ---- rule 3: an optional key never delays the preemption poll ------------------------------------------
def test_gce_hanging_optional_keys_do_not_delay_the_notice(emu, front, watchers):
    """Rule 3: a failure of an optional key (the ``hvdt-preemption-notice-s`` attribute, ``instance/id``)
    never delays the preemption poll by more than about a second. Both hang here: each clear read of
    they are read on the identity's own thread; when they were read on the preempted poller's thread (and
    again before reporting), a notice came about 4 s after the key said TRUE (6 s without a given name)."""
    front.rules[gce_path(f"instance/attributes/{NOTICE_ATTRIBUTE}")] = hang
    front.rules[gce_path("instance/id")] = hang
    w = GceWatcher(front.url(emu.gce_base_url("a")), instance="a", long_poll_timeout=1, request_margin=0.5,
                   request_timeout=1.0, watch_maintenance=False, **FAST)
    watchers.append(w.start())
    front.wait_hits(gce_path(f"instance/attributes/{NOTICE_ATTRIBUTE}"), 1, ruled=True)
    start = time.monotonic()
    emu.preempt("a", window=30)
    notice = w.wait(15)
    took = time.monotonic() - start
    assert notice is not None
    assert took <= SEEN_WITHIN_S, f"notice reported {took:.1f} s after instance/preempted said TRUE"


def test_aws_hanging_instance_id_delays_the_notice_by_about_a_second_at_most(emu, front, watchers):
    """Rule 3 (AWS): instance-id is read after each clear read of instance-action; one that never answers
    costs at most its 1 s total per poll, and the notice (read first) is seen within about 2 s. (Survived.)"""
    front.rules["/i/a/latest/meta-data/instance-id"] = hang
    w = AwsWatcher(front.url(emu.root_url("a")), interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    front.wait_hits("/i/a/latest/meta-data/instance-id", 1, ruled=True)
    start = time.monotonic()
    emu.preempt("a", window=120)
    notice = w.wait(15)
    assert notice is not None and time.monotonic() - start <= SEEN_WITHIN_S
    assert notice.deadline <= emu.instance("a").deadline


# ---- rule 4: the lead ------------------------------------------------------------------------------------
@pytest.mark.parametrize("deadline,departure_s", [(math.inf, None), (math.nan, None), (130.0, math.nan),
                                                  (130.0, -5.0)],
                         ids=["deadline-inf", "deadline-nan", "departure-nan", "departure-negative"])
def test_plan_with_inputs_that_are_no_time_leaves_at_once_or_before_the_deadline(deadline, departure_s):
    """Rule 4: where the lead cannot be shown to fit, the VM leaves at once, as ``at_notice`` does. A deadline
    of inf / NaN gives ``leave_at`` inf / NaN (never reached: the VM trains until the cloud stops it); a NaN
    departure gives a NaN lead and ``leave_at``; a negative one a negative lead, ``leave_at`` after the
    deadline."""
    plan = plan_leave(NEAR, HOSTS, {"h2"}, deadline, 100.0, step_s=1.0, departure_s=departure_s)
    if plan.at_once:
        return
    assert plan.leave_at is not None and math.isfinite(plan.leave_at) and math.isfinite(deadline)
    assert plan.leave_at + NEAR.boundary_wait_s(1.0) <= deadline, plan


CADENCES = [dict(), dict(check_interval_s=0.2), dict(check_interval_s=5.0), dict(max_check_every_steps=2),
            dict(check_every_steps=1), dict(check_every_steps=3), dict(check_every_steps=50)]


@pytest.mark.parametrize("cadence", CADENCES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "adaptive")
def test_the_first_round_after_leave_at_leaves_time_for_the_departure(cadence):
    """Rule 4 (survived): with every step after the notice round exactly as slow as the slowest the job timed,
    the first round at or after ``leave_at`` (the host check that drops the VM) plus the departure allowance
    ends by the deadline, or the VM leaves at once; over step times from 10 us to 20 s, fast or slow steps
    before the notice, an unknown departure, the fixed and adaptive cadences, a notice at a save round."""
    config = TransientConfig(store="memory://x", leave="near_deadline", **cadence)
    at = 1_000_000.0
    checked = 0
    for step_s in (1e-5, 0.003, 0.09, 0.7, 1.0, 2.9, 20.0):
        for prior in (0.05, 1.0):  # steps before the notice were this share of step_s
            for departure_s in (None, 0.0, 3.0):
                for window in (5.0, 31.0, 120.0):
                    for notice_step in (1000, 1001):  # a check round, or (fixed cadence) a save round
                        deadline = at + window
                        round_ = NoticeRound(leaving=(2,), deadline=deadline, vm_deadlines=(None, None, deadline),
                                             slowest_step_s=step_s * prior, departure_s=departure_s, step_s=step_s,
                                             at=at, elapsed_s=20 * step_s * prior)
                        plan = plan_for_round(config, HOSTS, round_, deadline, at)
                        if plan.at_once:
                            continue
                        assert plan.leave_at is not None
                        step, t, steps, ring_slowest = notice_step, at, 20, step_s * prior
                        for _ in range(5000):
                            if config.check_every_steps:
                                nxt = (step // config.check_every_steps + 1) * config.check_every_steps
                            else:
                                nxt = step + steps_to_next_round(config, round_, steps, ring_slowest)
                            steps, step = nxt - step, nxt
                            t += steps * step_s
                            ring_slowest = max(ring_slowest, step_s)
                            round_ = NoticeRound(leaving=(2,), deadline=deadline, vm_deadlines=(None, None, deadline),
                                                 slowest_step_s=step_s, departure_s=departure_s, step_s=step_s,
                                                 at=t, elapsed_s=steps * step_s)
                            if t >= plan.leave_at:
                                break
                        else:
                            continue  # too many rounds to follow (tiny steps): not this test's point
                        gone = t + config.departure_allowance_s(departure_s)
                        assert gone <= deadline + 1e-6, (cadence, step_s, prior, departure_s, window, notice_step,
                                                         plan, t - at)
                        checked += 1
    assert checked > 20


# ---- rule 5: configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("check_every_steps", math.nan), ("check_every_steps", math.inf),
                                         ("check_every_steps", 2.5), ("check_interval_s", math.inf),
                                         ("max_check_every_steps", math.nan)],
                         ids=["every-nan", "every-inf", "every-2.5", "interval-inf", "max-every-nan"])
def test_a_cadence_that_is_no_number_of_steps_or_seconds_is_refused_naming_its_field(field, value):
    """Rule 5: NaN / inf / nonsense settings get a typed ValueError naming the field. The cadence is what the
    lead rests on: ``check_every_steps=NaN`` or ``inf`` means ``step % N == 0`` never (or only at step 0)
    holds, so no notice round ever runs (nor a host check); ``2.5`` holds at every 5th step while the lead
    (``boundary_wait_s``) covers 2.5 steps; ``check_interval_s=inf`` puts rounds ``max_check_every_steps``
    (1000) steps apart, a notice agreed long after its deadline; ``max_check_every_steps=NaN`` slips past
    ``< 1``."""
    with pytest.raises(ValueError, match=field):
        TransientConfig(store="memory://x", leave="near_deadline", **{field: value})
