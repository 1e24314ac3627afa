"""Watchers that could go blind or look at the wrong VM: an Azure VM named apart from its host, a bad
optional GCE attribute, replies that trickle, AWS times in any form. Through the real metadata
emulator (HTTP on 127.0.0.1), plus the pure parts."""
from __future__ import annotations

import calendar
import time

import pytest
import test_watchers as shared

from hvd_transient.core.config import TransientConfig
from hvd_transient.core.interfaces import configured_watcher
from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE
from hvd_transient.testing.metadata_emulator import AWS_TIME_FORMATS, MetadataEmulator
from hvd_transient.watchers import AwsWatcher, AzureWatcher, GceWatcher, Watcher, deadline
from hvd_transient.watchers.azure import event_for, vm_names
from hvd_transient.watchers.errors import MetadataTimeoutError
from hvd_transient.watchers.metadata_http import MetadataClient

pytestmark = [pytest.mark.timeout(120), pytest.mark.timed]  # bounds wall-clock times

emu, watchers = shared.emu, shared.watchers  # the fixtures
AWS_ACTION, AZURE_EVENTS, PREEMPTED = shared.AWS_ACTION, shared.AZURE_EVENTS, shared.PREEMPTED
FAST, WAIT, hits, seen = shared.FAST, shared.WAIT, shared.hits, shared.seen

HOST, VM = "10.128.0.7", "spot-vm-7"


@pytest.fixture
def host(emu):
    """An emulated VM known by its Horovod host name, an address."""
    emu.add_instance(HOST)
    return HOST


# ---- Azure: the VM's own names ----------------------------------------------------------------------
def test_azure_plugin_watcher_sees_an_eviction_naming_the_vm_not_the_host(emu, host, watchers, monkeypatch):
    """The plugin passes the Horovod host name (an address here); the event names the VM."""
    emu.set_vm_name(HOST, VM)
    monkeypatch.setenv("HVDT_WATCHER", "azure")
    monkeypatch.setenv("HVDT_AZURE_METADATA_ENDPOINT", emu.root_url(HOST))
    w = configured_watcher(TransientConfig(store="unused"), HOST)
    assert isinstance(w, AzureWatcher) and w.instance == HOST
    watchers.append(w.start())
    assert hits(emu, HOST, AZURE_EVENTS, 1)
    emu.preempt("b", window=30)  # another VM of the set: not ours
    assert hits(emu, HOST, AZURE_EVENTS, emu.instance(HOST).path_hits[AZURE_EVENTS] + 2)
    assert w.notice is None
    emu.preempt(HOST, window=30)
    notice = seen(w)
    assert notice.instance == HOST and notice.deadline_basis == deadline.CLOUD_TIME
    assert notice.deadline == int(emu.instance(HOST).deadline)
    assert w.vm_names == {VM, HOST}  # compute/name and osProfile.computerName


def test_azure_vm_names_and_matching_are_what_imds_and_events_say():
    compute = {"name": "vmss_3", "osProfile": {"computerName": "vmss000003"}, "vmScaleSetName": "vmss"}
    assert vm_names(compute) == {"vmss_3", "vmss000003"}
    assert vm_names({"name": "", "osProfile": "garbage"}) == set()
    preempt = {"EventType": "Preempt", "Resources": ["VMSS000003"], "EventStatus": "Scheduled"}
    other = {"EventType": "Preempt", "Resources": ["vmss_4"]}
    reboot = {"EventType": "Reboot", "Resources": ["vmss_3"]}
    assert event_for([other, reboot, preempt], {"vmss_3", "vmss000003"}, ("Preempt",)) is preempt  # any name, any case
    assert event_for([other, reboot, {"EventType": "Preempt", "Resources": "vmss_3"}], {"vmss_3"}, ("Preempt",)) is None


# ---- GCE: a bad optional attribute ------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", "   ", "abc", "0", "-5", "nan", "inf", "\u00e9"])
def test_gce_bad_notice_attribute_falls_back_to_30_s_and_never_stops_the_poll(emu, watchers, value):
    emu.set_attribute("a", NOTICE_ATTRIBUTE, value)
    w = GceWatcher(emu.gce_base_url("a"), long_poll_timeout=1, request_margin=1.0, **FAST)
    watchers.append(w.start())
    assert hits(emu, "a", PREEMPTED, 3)  # read, long-polled, long-polled again: no failed poll
    assert emu.instance("a").fault_hits == {}
    emu.preempt("a", window=30)
    notice = seen(w)
    assert w.window == 30.0 and notice.deadline_basis == deadline.LAST_CLEAR_READ
    assert notice.deadline <= emu.instance("a").deadline


def test_gce_watcher_reports_the_vm_name_the_server_gives(emu, host, watchers):
    emu.set_vm_name(HOST, VM)
    w = GceWatcher(emu.gce_base_url(HOST), long_poll_timeout=1, request_margin=1.0, **FAST)
    watchers.append(w.start())
    assert hits(emu, HOST, PREEMPTED, 2)
    emu.preempt(HOST)
    assert seen(w).instance == VM


# ---- replies that trickle ----------------------------------------------------------------------------------
def test_a_trickled_reply_ends_at_the_requests_total_bound(emu):
    emu.set_fault("a", "trickle", trickle_s=0.5)
    client = MetadataClient(connect_timeout=0.5, total_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(MetadataTimeoutError):
        # about 40 bytes: 20 s a byte at a time, each byte well within a read timeout
        client.get(emu.gce_base_url("a") + "instance/zone", headers={"Metadata-Flavor": "Google"})
    assert time.monotonic() - started < 2.5  # the bound, and some slack for a loaded machine
    emu.set_fault("a", "trickle", trickle_s=0.01)
    reply = client.get(emu.gce_base_url("a") + "instance/preempted", headers={"Metadata-Flavor": "Google"})
    assert reply.status_code == 200 and reply.content == b"FALSE"  # a slow reply within the bound is whole


TRICKLE_S = 6.0
SEEN_WITHIN_S = 2.0


@pytest.mark.parametrize("kind", ["gce", "aws", "azure"])
def test_a_notice_after_trickled_replies_is_seen_within_2_s(watchers, kind):
    """Every reply trickles a byte every 0.5 s for 6 s, and the notice appears as that ends: each
    request gave up at its bound, so the watcher kept asking and sees the notice at once."""
    with MetadataEmulator(instances=["vm"]) as emu:
        w: Watcher
        if kind == "gce":
            w = GceWatcher(emu.gce_base_url("vm"))
            first = PREEMPTED
        elif kind == "aws":
            w = AwsWatcher(emu.root_url("vm"))
            first = AWS_ACTION
        else:
            w = AzureWatcher(emu.root_url("vm"), instance="vm")
            first = AZURE_EVENTS
        watchers.append(w.start())
        assert hits(emu, "vm", first, 2 if kind == "gce" else 1)
        spell = emu.set_fault("vm", "trickle", duration=TRICKLE_S, trickle_s=0.5)
        emu.preempt("vm", at=spell.fault_until, window=120)
        notice = w.wait(TRICKLE_S + WAIT)
        state = emu.instance("vm")
        assert notice is not None and state.notice_at is not None
        assert 0 <= notice.detected_at - state.notice_at <= SEEN_WITHIN_S, notice.detected_at - state.notice_at
        assert state.fault_hits.get("trickle", 0) >= int(0.6 * TRICKLE_S) - 1  # it kept asking


# ---- AWS: any time a server could send ----------------------------------------------------------------------
READABLE = [f for f in AWS_TIME_FORMATS if f not in ("unreadable", "missing")]


@pytest.mark.parametrize("fmt", READABLE)
def test_aws_time_in_any_form_is_the_deadline(emu, watchers, fmt):
    w = AwsWatcher(emu.root_url("b"), interval=0.05, **FAST)
    watchers.append(w.start())
    assert hits(emu, "b", AWS_ACTION, 1)
    emu.preempt("b", window=120, aws_time_format=fmt)
    notice = seen(w)
    cloud = emu.instance("b").deadline
    assert notice.deadline_basis == deadline.CLOUD_TIME
    slack = 60 if fmt == "iso8601-minutes" else 1  # whole minutes or seconds on the wire
    assert cloud - slack < notice.deadline <= cloud + 1e-6  # (microseconds through a float)


@pytest.mark.parametrize("fmt", ["unreadable", "missing"])
def test_aws_notice_with_an_unreadable_time_is_reported_with_the_earliest_deadline(emu, watchers, fmt):
    w = AwsWatcher(emu.root_url("b"), interval=0.05, **FAST)
    watchers.append(w.start())
    assert hits(emu, "b", AWS_ACTION, 1)  # a read found no notice: it came after that read
    emu.preempt("b", window=120, aws_time_format=fmt)
    notice = seen(w)
    assert notice.deadline_basis == deadline.LAST_CLEAR_READ
    assert notice.detected_at + 110 < notice.deadline <= emu.instance("b").deadline


def test_aws_unreadable_time_with_no_history_leaves_at_once(emu, watchers):
    emu.preempt("a", ago=5.0, window=120, aws_time_format="unreadable")
    w = AwsWatcher(emu.root_url("a"), interval=0.05, **FAST)
    watchers.append(w.start())
    notice = seen(w)
    assert notice.deadline_basis == deadline.FIRST_READ and notice.deadline <= notice.detected_at


T = calendar.timegm((2026, 11, 22, 8, 22, 0))


@pytest.mark.parametrize("text, expected", [
    ("2026-11-22T08:22:00Z", T), ("2026-11-22T08:22:00z", T), ("2026-11-22t08:22:00z", T),
    ("2026-11-22T08:22:00.250Z", T + 0.25), ("2026-11-22T08:22:00+0000", T), ("2026-11-22T09:22:00+01:00", T),
    ("2026-11-22T08:22:00", T), ("2026-11-22T08:22Z", T), ("2026-11-22 08:22:00Z", T),
    (str(T), T), (f" {T}.5 ", T + 0.5), (T, T), (T * 1000, T), (str(T * 1000), T),
    ("Sun, 22 Nov 2026 08:22:00 GMT", T), ("Sun, 22 Nov 2026 08:22:00 +0000", T), ("22 Nov 2026 08:22:00 -0000", T),
    ("soon", None), ("", None), (None, None), (True, None), ("-5", None), ("nan", None), ("inf", None),
    ([], None), ({"t": T}, None), ("2026-13-45T99:99:99Z", None),
])
def test_parse_time_accepts_what_a_server_could_send(text, expected):
    assert deadline.parse_time(text) == expected
