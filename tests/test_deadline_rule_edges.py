"""The deadline rules at their edges: how a notice is dated, how long a metadata request may
take, and when a VM under notice leaves. Each test states the rule as it should hold; real watchers
against the real metadata emulator (behind a small per-path fault front where the emulator has no such
fault), and the pure planning functions."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from typing import Callable
from urllib.parse import urlsplit

import pytest
import test_watchers as shared

from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound
from hvd_transient.core.leave_plan import departures_due, plan_for_round, steps_to_next_round
from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE
from hvd_transient.watchers import AwsWatcher, AzureWatcher, GceWatcher
from hvd_transient.watchers import azure as azure_mod
from hvd_transient.watchers.aws import action_deadline
from hvd_transient.watchers.azure import event_deadline
from hvd_transient.watchers.deadline import FIRST_READ, parse_time
from hvd_transient.watchers.metadata_http import MetadataClient

pytestmark = [pytest.mark.timeout(60), pytest.mark.timed]  # bounds wall-clock times

emu, watchers = shared.emu, shared.watchers  # the fixtures
FAST = shared.FAST
#: a notice that appears while the server answers is seen within about 2 s; a little slack
SEEN_WITHIN_S = 3.5


# ---- a per-path fault front before the emulator ---------------------------------------------------
Rule = Callable[["Front", socket.socket], None]


class Front:
    """Forwards every request to the emulator, except paths given a rule (a raw-socket reply)."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname, parts.port)
        self.rules: dict[str, Rule] = {}
        self.hits: Counter[str] = Counter()
        self.ruled_hits: Counter[str] = Counter()
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def url(self, upstream_url: str) -> str:
        parts = urlsplit(upstream_url)
        return upstream_url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{self.port}", 1)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(2)
        self.sock.close()

    def wait_hits(self, path: str, n: int, *, ruled: bool = False, timeout: float = 20.0) -> None:
        counter = self.ruled_hits if ruled else self.hits
        with self.cond:
            assert self.cond.wait_for(lambda: counter[path] >= n, timeout), f"{path}: {counter[path]} < {n}"

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            path = data.split(b"\r\n", 1)[0].split(b" ")[1].decode().split("?")[0]
            rule = self.rules.get(path)
            with self.cond:
                self.hits[path] += 1
                if rule is not None:
                    self.ruled_hits[path] += 1
                self.cond.notify_all()
            if rule is not None:
                rule(self, conn)
                return
            up = socket.create_connection(self.upstream, timeout=10)
            try:
                up.sendall(data)
                while chunk := up.recv(65536):
                    conn.sendall(chunk)
            finally:
                up.close()
        except OSError:
            pass
        finally:
            conn.close()


def static(status: int, body: bytes | str, headers: dict[str, str] | None = None) -> Rule:
    payload = body.encode() if isinstance(body, str) else body

    def rule(front: Front, conn: socket.socket) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        conn.sendall(head.encode() + b"\r\n" + payload)
    return rule


def bad_status_line(front: Front, conn: socket.socket) -> None:
    conn.sendall(b"NONSENSE\r\n\r\n")


def slow_headers(front: Front, conn: socket.socket) -> None:
    """The status line at once, then a header line one byte every 0.2 s, forever."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nX-Pad: ")
    while not front.stopping.wait(0.2):
        conn.sendall(b"a")


def trickled_chunk_extension(front: Front, conn: socket.socket) -> None:
    """Headers at once (chunked), then a chunk-size line whose extension trickles a byte every 0.2 s."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nTransfer-Encoding: chunked\r\n\r\n5;x=")
    while not front.stopping.wait(0.2):
        conn.sendall(b"a")


@pytest.fixture
def front(emu):
    f = Front(emu.url)
    yield f
    f.stop()


def gce_path(key: str, inst: str = "a") -> str:
    return f"/i/{inst}/computeMetadata/v1/{key}"


# ---- every request's total time is bounded ---------------------------------------------------
@pytest.mark.parametrize("fault", [slow_headers, trickled_chunk_extension], ids=["slow-headers", "chunk-ext"])
def test_request_total_time_is_bounded_whatever_the_server_trickles(emu, front, fault):
    path = gce_path("instance/preempted")
    front.rules[path] = fault
    client = MetadataClient(connect_timeout=0.5, total_timeout=1.0)
    took: list[float] = []

    def call() -> None:
        start = time.monotonic()
        try:
            client.get(front.url(emu.url) + path, headers={"Metadata-Flavor": "Google"})
        except Exception:
            pass
        took.append(time.monotonic() - start)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(3.0)
    assert took and took[0] <= 1.5, "a 1 s request still had no end after 3 s"


def test_gce_notice_is_seen_soon_after_a_server_that_trickled_headers_recovers(emu, front, watchers):
    path = gce_path("instance/preempted")
    w = GceWatcher(front.url(emu.gce_base_url("a")), window=30, instance="a", long_poll_timeout=1,
                   request_margin=0.5, watch_maintenance=False, **FAST)
    watchers.append(w.start())
    front.wait_hits(path, 2)
    front.rules[path] = slow_headers
    front.wait_hits(path, 1, ruled=True)  # a request is in the fault now
    emu.preempt("a", window=30)
    del front.rules[path]                 # the server answers again
    assert w.wait(SEEN_WITHIN_S) is not None, "notice not seen: a request with trickled headers never ended"


# ---- a notice is never missed: an optional key's odd reply ------------------------------------------
def test_gce_notice_not_lost_when_the_optional_window_attribute_answers_a_bad_status_line(emu, front, watchers):
    """The window attribute is optional (a broken one "never delays or stops that poll"), but an
    http.client.HTTPException from it is neither WatcherError nor OSError."""
    front.rules[gce_path(f"instance/attributes/{NOTICE_ATTRIBUTE}")] = bad_status_line
    w = GceWatcher(front.url(emu.gce_base_url("a")), instance="a", long_poll_timeout=1, request_margin=0.5,
                   watch_maintenance=False, **FAST)
    watchers.append(w.start())
    front.wait_hits(gce_path("instance/preempted"), 3)
    emu.preempt("a", window=30)
    notice = w.wait(SEEN_WITHIN_S)
    assert notice is not None, "notice never reported while the optional attribute answers garbage"
    assert notice.deadline <= emu.instance("a").deadline


def test_aws_notice_not_lost_while_instance_id_is_unreadable(emu, front, watchers):
    """instance-id fails at every read (the watcher was given no instance): neither its errors nor
    their back-off may keep the watcher from instance-action, before or after the notice comes."""
    front.rules["/i/a/latest/meta-data/instance-id"] = static(404, "not found")
    w = AwsWatcher(front.url(emu.root_url("a")), interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    front.wait_hits("/i/a/latest/meta-data/instance-id", 3)
    emu.preempt("a", window=120)
    assert w.wait(SEEN_WITHIN_S) is not None, "IMDS shows an interruption, the watcher never reads it"


def test_aws_notice_present_at_start_is_seen_while_instance_id_is_unreadable(emu, front, watchers):
    front.rules["/i/a/latest/meta-data/instance-id"] = static(404, "not found")
    emu.preempt("a", window=120)
    w = AwsWatcher(front.url(emu.root_url("a")), interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    assert w.wait(SEEN_WITHIN_S) is not None, "IMDS shows an interruption, the watcher never reads it"


# ---- Azure: which event, which names ----------------------------------------------------------------
def _rfc1123(epoch: float) -> str:
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(epoch))


def _events(*events: dict) -> Rule:
    return static(200, json.dumps({"DocumentIncarnation": 2, "Events": list(events)}),
                  {"Content-Type": "application/json"})


def _preempt(eid: str, resources: list[str], not_before: str, status: str = "Scheduled") -> dict:
    return {"EventId": eid, "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": resources,
            "EventStatus": status, "NotBefore": not_before, "Description": "", "EventSource": "Platform",
            "DurationInSeconds": -1}


def test_azure_two_events_for_this_vm_take_the_earliest_deadline(emu, front, watchers):
    now = time.time()
    soon, later = int(now) + 35, int(now) + 90
    front.rules["/i/a/metadata/scheduledevents"] = _events(_preempt("e-late", ["a"], _rfc1123(later)),
                                                           _preempt("e-soon", ["a"], _rfc1123(soon)))
    w = AzureWatcher(front.url(emu.root_url("a")), instance="a", interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    notice = w.wait(SEEN_WITHIN_S)
    assert notice is not None
    assert notice.deadline <= soon, (
        f"deadline {notice.deadline - now:.0f} s away; an event for this VM says {soon - now:.0f} s")


def test_azure_event_naming_the_vm_with_padding_is_not_missed(emu, front, watchers):
    front.rules["/i/a/metadata/scheduledevents"] = _events(_preempt("e1", ["a "], _rfc1123(time.time() + 40)))
    w = AzureWatcher(front.url(emu.root_url("a")), instance="a", interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    assert w.wait(10.0) is not None, "an event whose Resources name 'a ' is missed"


def test_azure_reads_before_the_vm_names_are_known_do_not_count_as_clear(emu, front, watchers, monkeypatch):
    """IMDS compute fails once; until it is asked again, reads cannot match an event naming the VM by
    its resource name, yet each counts as a read that saw no event for this VM: an event present all
    along, whose NotBefore cannot be read, is then dated from a read that did show it."""
    monkeypatch.setattr(azure_mod, "NAMES_RETRY_S", 1.5)  # 10 s in the product; only the length changes
    compute, events = "/i/a/metadata/instance/compute", "/i/a/metadata/scheduledevents"
    front.rules[compute] = static(500, "busy")
    appeared = time.time()
    front.rules[events] = _events(_preempt("e1", ["vmss_3"], "not a date"))
    w = AzureWatcher(front.url(emu.root_url("a")), instance="10.0.0.5", interval=0.05, request_timeout=1.0,
                     window=30, **FAST)
    watchers.append(w.start())
    front.wait_hits(events, 3)
    front.rules[compute] = static(200, json.dumps({"name": "vmss_3", "osProfile": {"computerName": "vmss000003"}}),
                                  {"Content-Type": "application/json"})
    notice = w.wait(10)
    assert notice is not None
    assert notice.deadline <= appeared + 30, (
        f"deadline {notice.deadline - appeared:.1f} s after the event appeared, with a 30 s window "
        f"(basis {notice.deadline_basis})")


# ---- a cloud time in a zone the parser does not know -----------------------------------------
TRUTH_JST = 1474277387.0  # Mon, 19 Sep 2016 18:29:47 JST == 09:29:47 UTC


def test_rfc1123_time_in_an_unknown_zone_is_not_taken_as_utc():
    parsed = parse_time("Mon, 19 Sep 2016 18:29:47 JST")
    assert parsed is None or parsed <= TRUTH_JST, f"read {parsed - TRUTH_JST:.0f} s later than it is"


def test_azure_not_before_in_an_unknown_zone_gives_no_later_deadline():
    event = _preempt("e1", ["a"], "Mon, 19 Sep 2016 18:29:47 JST")
    read = TRUTH_JST - 10  # the read 10 s before the real NotBefore
    d = event_deadline(event, read, read - 1, 30.0)
    # not read as UTC (9 h late): dated like an unreadable time, from the last read that showed no event
    assert d.basis == "last_clear_read" and d.at == read - 1 + 30.0, d


# ---- an AWS time that cannot be true is dated like one that cannot be read ---------
def test_aws_time_beyond_the_window_on_a_first_read_leaves_at_once():
    """A watcher started mid-notice (no clear read) reads a ``time`` an hour away: no such time is true
    (AWS gives two minutes), so it says as little as an unreadable one, which is dated by the first read
    (leave at once). The cap instead takes the latest bound possible: read end + 120 s."""
    read_started = 1_700_000_000.0
    detected_at = read_started + 0.9
    odd = action_deadline("2023-11-14T23:13:20Z", read_started, detected_at, None, 120.0)  # 1 h away
    unreadable = action_deadline("soon", read_started, detected_at, None, 120.0)
    assert unreadable.basis == FIRST_READ and unreadable.at == read_started
    assert odd.at <= unreadable.at, f"an impossible time gives {odd.at - read_started:.1f} s, an unreadable one 0 s"


# ---- the lead's wait for a step boundary under the adaptive cadence ------------------------------
def test_adaptive_lead_covers_the_wait_for_the_next_round_at_steps_no_slower_than_timed():
    """The job timed a 1 s step once; lately steps take 10 ms. The notice round plans with a boundary
    wait of max(1 s, check interval 1 s); the cadence without a notice would set the next round 10 steps
    away (allowance x interval at the ring's slowest step), so at 1 s steps (no slower than timed) the
    first host check after leave_at came 10 s after the plan."""
    config = TransientConfig(store="unused", leave="near_deadline")
    hosts = ["h0", "h1"]
    at = 1_000_000.0
    deadline = at + 4.5
    round_ = NoticeRound(leaving=(1,), deadline=deadline, vm_deadlines=(None, deadline), slowest_step_s=0.01,
                         departure_s=0.5, step_s=1.0, at=at, elapsed_s=1.0)
    plan = plan_for_round(config, hosts, round_, deadline, at)
    steps = steps_to_next_round(config, round_, 100, ring_slowest_step_s=1.0)
    if plan.at_once:
        return
    step_s = round_.step_s  # every later step exactly as slow as the slowest the job timed
    next_round = at + steps * step_s
    later = NoticeRound(leaving=(1,), deadline=deadline, vm_deadlines=(None, deadline), slowest_step_s=step_s,
                        departure_s=0.5, step_s=step_s, at=next_round, elapsed_s=next_round - at)
    assert departures_due(config, hosts, later, 30.0)  # the first host check that can drop it
    gone = next_round + round_.departure_s
    assert gone <= deadline, (f"planned leave_at {plan.leave_at - at:.1f} s after the notice round (lead "
                              f"{plan.lead_s:.1f} s), first host check {next_round - at:.1f} s, gone "
                              f"{gone - deadline:.1f} s after the deadline; at_notice leaves at once")
