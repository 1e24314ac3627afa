"""Preemption watchers against the real metadata emulator (HTTP on 127.0.0.1), plus auto-selection."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest

from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE
from hvd_transient.testing.metadata_emulator import MetadataEmulator
from hvd_transient.watchers import (
    AwsWatcher,
    AzureWatcher,
    GceWatcher,
    LocalWatcher,
    Notice,
    Watcher,
    WatcherConfigError,
    choose_kind,
    make_watcher,
    read_dmi,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.timed]  # bounds wall-clock times

WAIT = 30  # upper bound for something that should happen soon; never a timing assertion
FAST = {"initial_backoff": 0.05, "max_backoff": 0.3}


@pytest.fixture
def emu():
    with MetadataEmulator(instances=["a", "b", "c"], port=0) as emulator:
        yield emulator


@pytest.fixture
def watchers():
    """Collects started watchers and stops them even when a test fails."""
    started: list[Watcher] = []
    yield started
    for w in started:
        w.stop(timeout=0.1)  # a thread parked in a long-poll ends when the emulator stops


def gce_watcher(emu: MetadataEmulator, inst: str, **kw) -> GceWatcher:
    return GceWatcher(emu.gce_base_url(inst), long_poll_timeout=1, request_margin=1.0, **{**FAST, **kw})


def make(kind: str, emu: MetadataEmulator, inst: str, **kw) -> Watcher:
    if kind == "gce":
        return gce_watcher(emu, inst, **kw)
    cls = AwsWatcher if kind == "aws" else AzureWatcher
    return cls(emu.root_url(inst), interval=0.05, request_timeout=1.0, **{**FAST, **kw})


PREEMPTED = "/computeMetadata/v1/instance/preempted"
MAINTENANCE = "/computeMetadata/v1/instance/maintenance-event"
AWS_ACTION = "/latest/meta-data/spot/instance-action"
AZURE_EVENTS = "/metadata/scheduledevents"


def hits(emu: MetadataEmulator, inst: str, path: str, n: int) -> bool:
    """Wait until ``inst`` has had ``n`` requests for ``path`` in all. Request n+1 on a
    path starts only after the watcher has handled reply n."""
    return emu.wait_for(lambda s: s[inst].path_hits.get(path, 0) >= n, timeout=WAIT)


def seen(w: Watcher) -> Notice:
    """The notice ``w`` sees (within ``WAIT``)."""
    notice = w.wait(WAIT)
    assert notice is not None
    return notice


# ---- GCE -----------------------------------------------------------------------------------------
def test_gce_watcher_sees_preemption_with_its_window(emu, watchers):
    seen: list[Notice] = []
    called = threading.Event()
    w = gce_watcher(emu, "a", window=7, on_notice=lambda n: (seen.append(n), called.set()))
    watchers.append(w.start())
    assert hits(emu, "a", PREEMPTED, 2)  # a plain read, then a parked long-poll
    assert w.notice is None and w.running

    emu.preempt("a", window=7)
    notice = w.wait(WAIT)
    assert notice is not None and called.wait(WAIT) and seen == [notice]
    assert (notice.source, notice.instance, notice.reason) == ("gce", "a", "preempted")
    state = emu.instance("a")
    assert notice.detected_at >= state.notice_at
    # the window from the last read that said FALSE: never after the cloud's, at most a few reads before
    assert notice.deadline_basis == "last_clear_read"
    assert state.deadline - 10 < notice.deadline <= state.deadline
    assert w.join(WAIT) and not w.running
    assert emu.instance("b").preempted is False


def test_gce_watcher_sees_a_notice_already_there_at_start(emu, watchers):
    emu.preempt("b", window=30)
    w = gce_watcher(emu, "b")
    watchers.append(w.start())
    notice = w.wait(WAIT)
    assert notice is not None and notice.instance == "b"
    # nothing tells when it came: its window may be over, so leave at once
    assert notice.deadline_basis == "first_read_unknown_start" and notice.deadline <= notice.detected_at


@pytest.mark.parametrize("attribute, given, expected", [
    ("120", None, 120.0),     # `cluster up --preemption-notice-duration 120`
    (None, None, 30.0),       # a VM created without it: Compute Engine's 30 s
    ("soon", None, 30.0),     # garbage in the attribute: the safe default, never a longer guess
    ("120", 45.0, 45.0),      # an explicit window wins
])
def test_gce_watcher_window_follows_the_vms_configured_notice(emu, watchers, attribute, given, expected):
    if attribute is not None:
        emu.set_attribute("c", NOTICE_ATTRIBUTE, attribute)
    w = gce_watcher(emu, "c", **({} if given is None else {"window": given}))
    watchers.append(w.start())
    assert hits(emu, "c", PREEMPTED, 2)  # a read said FALSE: the notice's window counts from it
    emu.preempt("c", window=expected)
    notice = w.wait(WAIT)
    assert notice is not None and w.window == expected
    assert notice.deadline_basis == "last_clear_read"
    assert emu.instance("c").deadline - 10 < notice.deadline <= emu.instance("c").deadline


def test_gce_watcher_takes_its_url_from_gce_metadata_host(emu, watchers, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", emu.metadata_host("c"))
    w = GceWatcher(long_poll_timeout=1, request_margin=1.0, **FAST)
    assert w.base_url == emu.gce_base_url("c")
    watchers.append(w.start())
    emu.preempt("c")
    assert w.wait(WAIT).instance == "c"


def test_gce_watcher_acts_on_terminate_maintenance_only(emu, watchers):
    w = gce_watcher(emu, "a", window=60)
    watchers.append(w.start())
    assert hits(emu, "a", MAINTENANCE, 2)
    seen = emu.instance("a").path_hits[MAINTENANCE]
    emu.set_maintenance("a", "MIGRATE_ON_HOST_MAINTENANCE")
    assert hits(emu, "a", MAINTENANCE, seen + 2)  # the watcher has read MIGRATE and polled again
    assert w.notice is None

    emu.set_maintenance("a", "TERMINATE_ON_HOST_MAINTENANCE")
    notice = w.wait(WAIT)
    assert notice is not None and "TERMINATE_ON_HOST_MAINTENANCE" in notice.reason
    assert notice.deadline_basis == "last_clear_read"  # the window from the last read of NONE or MIGRATE
    assert notice.detected_at - 10 < notice.deadline - 60 <= notice.detected_at
    assert not emu.instance("a").preempted


# ---- AWS and Azure ---------------------------------------------------------------------------------
def test_aws_watcher_takes_the_deadline_from_the_notice_time(emu, watchers):
    w = make("aws", emu, "b")
    watchers.append(w.start())
    assert hits(emu, "b", AWS_ACTION, 1)
    emu.preempt("b", window=120)
    notice = w.wait(WAIT)
    assert notice is not None and notice.source == "aws"
    assert notice.instance.startswith("i-") and notice.reason == "spot-interruption terminate"
    assert notice.deadline == int(emu.instance("b").deadline)  # the "time" field, whole seconds
    assert notice.deadline_basis == "cloud_time"


AWS_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"


def test_aws_rebalance_recommendation_is_an_early_warning_not_a_notice(emu, watchers):
    """The recommendation is kept as ``warning``; the watcher goes on and still sees the notice."""
    w = make("aws", emu, "a")
    watchers.append(w.start())
    assert hits(emu, "a", AWS_REBALANCE, 1)
    assert w.warning is None
    emu.recommend_rebalance("a")
    assert emu.wait_for(lambda s: w.warning is not None, timeout=WAIT)
    warning = w.warning
    assert warning is not None and warning.early and warning.reason == "rebalance-recommendation"
    assert w.notice is None and w.running  # nothing to leave yet: keep training, keep watching

    seen_action = emu.instance("a").path_hits.get(AWS_ACTION, 0)
    assert hits(emu, "a", AWS_ACTION, seen_action + 1)  # the instance-action poll goes on
    emu.preempt("a", window=120)
    notice = w.wait(WAIT)
    assert notice is not None and not notice.early and notice.reason == "spot-interruption terminate"
    assert w.warning is warning


def test_azure_watcher_takes_the_deadline_from_not_before(emu, watchers):
    w = make("azure", emu, "c")
    watchers.append(w.start())
    assert hits(emu, "c", AZURE_EVENTS, 1)
    emu.preempt("c", window=45)
    notice = w.wait(WAIT)
    assert notice is not None and notice.source == "azure" and notice.instance == "c"
    assert notice.reason.startswith("scheduled-event Preempt")
    assert notice.deadline == int(emu.instance("c").deadline)
    assert notice.deadline_basis == "cloud_time"


def test_azure_watcher_ignores_events_for_other_vms(emu, watchers):
    """Every VM of the emulator sees every VM's events, as in an Azure availability set."""
    emu.preempt("b", window=45)
    w = make("azure", emu, "c", instance="some-other-vm")
    watchers.append(w.start())
    assert hits(emu, "c", AZURE_EVENTS, 2)  # the first reply, with b's event, has been handled
    assert w.notice is None


# ---- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gce", "aws", "azure"])
@pytest.mark.parametrize("fault", ["hang", "500", "garbage"])
def test_watcher_survives_a_broken_server_and_detects_after_it_heals(emu, watchers, kind, fault):
    emu.set_fault("a", fault)
    w = make(kind, emu, "a", instance="a")
    watchers.append(w.start())
    # More faulty replies (or hung requests) than the watcher has pollers: a failure was
    # survived and retried. (GCE polls two keys at once.)
    retried = 3 if kind == "gce" else 2
    assert emu.wait_for(lambda s: s["a"].fault_hits.get(fault, 0) >= retried, timeout=WAIT)
    assert w.notice is None and w.running

    emu.set_fault("a", "ok")
    emu.preempt("a", window=60)
    notice = w.wait(WAIT)
    assert notice is not None and notice.source == kind and notice.instance == "a"


# ---- a failing or hanging metadata server never blinds a watcher for long ----------------------------
SEEN_WITHIN_S = 2.0  # from the notice's appearance; a GCE Spot VM has 30 s in all
# (kind, emulator fault, seconds): the fault begins while the watcher watches, the notice appears
# as it ends. "lose": requests (the GCE long-poll in flight included) are never answered; "hang":
# they are answered only when the fault ends.
SPELLS = [
    ("gce", "503", 25.0),   # measured on the old 30 s backoff: the notice was seen 7.7 s late
    ("gce", "lose", 8.0),
    ("gce", "hang", 8.0),
    ("aws", "503", 10.0),
    ("aws", "lose", 10.0),
    ("aws", "hang", 10.0),
    ("azure", "503", 8.0),
    ("azure", "lose", 8.0),
    ("azure", "hang", 8.0),
]
POLLERS = {"gce": 2, "aws": 2, "azure": 1}
FIRST_POLLS = {"gce": (PREEMPTED, MAINTENANCE), "aws": (AWS_ACTION, AWS_REBALANCE), "azure": (AZURE_EVENTS,)}
HEALTHY_PAUSE = {"gce": 0.0, "aws": 5.0, "azure": 2.0}  # the default interval after a quiet answer


def default_watcher(kind: str, emu: MetadataEmulator, inst: str) -> Watcher:
    """A watcher with its default timeouts, intervals and backoff: those are what is tested."""
    if kind == "gce":
        return GceWatcher(emu.gce_base_url(inst))
    return (AwsWatcher if kind == "aws" else AzureWatcher)(emu.root_url(inst))


def test_a_notice_after_errors_or_hangs_is_seen_within_2_s(watchers, caplog):
    """Every watcher polls about once a second while the server fails, and bounds each request,
    so a notice that appears as a spell of 503s, lost or late replies ends is seen at once.
    The spells run side by side, one instance each, to keep the test as long as the longest."""
    caplog.set_level(logging.INFO, logger="hvd_transient.watchers")
    names = [f"{kind}-{mode}" for kind, mode, _ in SPELLS]
    with MetadataEmulator(instances=names) as emu:
        for (kind, _, _), name in zip(SPELLS, names):
            watchers.append(default_watcher(kind, emu, name).start())
        for (kind, _, _), name in zip(SPELLS, names):  # each is watching: the GCE long-polls are parked
            for path in FIRST_POLLS[kind]:
                assert hits(emu, name, path, 2 if kind == "gce" else 1)
        spells = {}
        for (kind, mode, seconds), name in zip(SPELLS, names):
            spells[name] = emu.set_fault(name, mode, duration=seconds)
            emu.preempt(name, at=spells[name].fault_until, window=120)
        report, late = [], []
        for (kind, mode, seconds), name, w in zip(SPELLS, names, watchers):
            notice = w.wait(seconds + WAIT)
            state = emu.instance(name)
            assert notice is not None and state.notice_at is not None, name
            assert state.notice_at >= spells[name].fault_until
            seen_after = notice.detected_at - state.notice_at
            failed = sum(state.fault_hits.values())  # requests met by the fault
            # about one request a second per poller while the fault lasts (once it reached the poller)
            expected = POLLERS[kind] * int(0.8 * (seconds - HEALTHY_PAUSE[kind]))
            report.append(f"{name}: seen {seen_after:.2f} s after it appeared; {failed} requests failed")
            if not 0 <= seen_after <= SEEN_WITHIN_S or failed < expected:
                late.append(f"{name} (wanted at least {expected} requests)")
    print("\n".join(report))
    assert not late, "; ".join(report)
    # a failing server is reported, not a line per retry: the first failure of each poller's run
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "failed request" in r.getMessage()]
    assert 1 <= len(warned) <= sum(POLLERS[kind] for kind, _, _ in SPELLS), [r.getMessage() for r in warned]


def test_gce_watcher_started_during_errors_still_learns_the_vms_window(emu, watchers):
    """A 5xx is no answer: the configured notice is asked again, not assumed to be 30 s."""
    emu.set_attribute("c", NOTICE_ATTRIBUTE, "120")
    spell = emu.set_fault("c", "503", duration=1.0)
    w = default_watcher("gce", emu, "c")
    watchers.append(w.start())
    emu.preempt("c", at=spell.fault_until, window=120)
    notice = w.wait(WAIT)
    assert notice is not None and emu.instance("c").fault_hits["503"] >= 2
    assert w.window == 120 and notice.deadline <= emu.instance("c").deadline


def test_watcher_on_a_dead_server_reports_nothing_and_never_raises(watchers):
    emu = MetadataEmulator(instances=["a"]).start()
    url = emu.gce_base_url("a")
    emu.stop()  # nothing listens there any more
    w = GceWatcher(url, long_poll_timeout=1, request_margin=0.5, **FAST)
    watchers.append(w.start())
    assert w.wait(0.5) is None
    w.stop()
    assert w.join(WAIT)


def test_stop_returns_during_a_long_poll_and_nothing_is_reported_after(emu, watchers):
    seen: list[Notice] = []
    w = GceWatcher(emu.gce_base_url("a"), long_poll_timeout=60, watch_maintenance=False,
                   on_notice=seen.append, **FAST)
    watchers.append(w.start())
    assert hits(emu, "a", PREEMPTED, 2)  # a plain read, then the long-poll that is now parked
    w.stop(timeout=0.5)  # returns although the long-poll has ~60 s to go
    assert not w.running

    emu.preempt("a")  # the parked long-poll now returns TRUE to a stopped watcher
    assert w.join(WAIT)
    assert w.notice is None and seen == []


def test_stop_cuts_a_backoff_short(emu, watchers):
    emu.set_fault("a", "500")
    w = make("gce", emu, "a", initial_backoff=60, max_backoff=60)
    watchers.append(w.start())
    assert emu.wait_for(lambda s: s["a"].fault_hits.get("500", 0) >= 1, timeout=WAIT)
    w.stop(timeout=WAIT)
    assert w.join(0)  # already ended: the 60 s backoff did not have to run out


def test_a_failing_callback_does_not_lose_the_notice(emu, watchers):
    def explode(_notice: Notice) -> None:
        raise RuntimeError("callback bug")

    w = make("gce", emu, "a", on_notice=explode)
    watchers.append(w.start())
    emu.preempt("a")
    assert w.wait(WAIT) is not None and w.notice is not None


# ---- local ---------------------------------------------------------------------------------------
def test_local_watcher_sees_a_notice_file(tmp_path, watchers):
    path = tmp_path / "preempt"
    w = LocalWatcher(path, interval=0.02, window=9, instance="worker-1")
    watchers.append(w.start())
    assert w.wait(0.1) is None
    path.write_text("")
    notice = w.wait(WAIT)
    assert (notice.source, notice.instance) == ("local", "worker-1")
    assert notice.reason == f"notice file {path}"
    assert notice.deadline == pytest.approx(notice.detected_at + 9)


def test_local_notice_file_may_carry_deadline_and_reason(tmp_path, watchers, monkeypatch):
    path = tmp_path / "preempt.json"
    monkeypatch.setenv("HVDT_NOTICE_FILE", str(path))
    w = LocalWatcher(interval=0.02)
    watchers.append(w.start())
    path.write_text(json.dumps({"deadline": 1234567890.5, "reason": "simulated spot eviction"}))
    notice = w.wait(WAIT)
    assert notice.deadline == 1234567890.5 and notice.reason == "simulated spot eviction"


def test_local_watcher_turns_sigterm_into_a_notice(watchers):
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM)
    w = LocalWatcher(handle_sigterm=True, interval=0.02, window=5)
    watchers.append(w.start())
    handler = signal.getsignal(signal.SIGTERM)
    assert handler not in (before, signal.SIG_DFL)  # guard: never SIGTERM ourselves unprotected
    os.kill(os.getpid(), signal.SIGTERM)
    notice = w.wait(WAIT)
    assert notice.reason == "signal SIGTERM"
    assert notice.deadline == pytest.approx(notice.detected_at + 5)
    w.stop()
    assert signal.getsignal(signal.SIGTERM) == before


def test_local_watcher_installs_no_handler_off_the_main_thread(tmp_path, watchers):
    before = signal.getsignal(signal.SIGTERM)
    w = LocalWatcher(tmp_path / "x", handle_sigterm=True, interval=0.02)
    starter = threading.Thread(target=w.start)
    starter.start()
    starter.join(WAIT)
    watchers.append(w)
    assert signal.getsignal(signal.SIGTERM) == before
    (tmp_path / "x").touch()
    assert w.wait(WAIT) is not None  # the file is still watched


# ---- auto-selection (pure) ---------------------------------------------------------------------------
GOOGLE = {"sys_vendor": "Google", "product_name": "Google Compute Engine"}
AMAZON = {"sys_vendor": "Amazon EC2", "product_name": "m5.large"}
AMAZON_XEN = {"sys_vendor": "Xen", "product_name": "HVM domU", "bios_version": "4.11.amazon"}
AZURE = {"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
         "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"}
HYPERV = {"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
          "chassis_asset_tag": "None"}
LAPTOP = {"sys_vendor": "LENOVO", "product_name": "20XW"}


@pytest.mark.parametrize("env, dmi, kind", [
    ({}, {}, "local"),
    ({}, LAPTOP, "local"),
    ({}, GOOGLE, "gce"),
    ({}, AMAZON, "aws"),
    ({}, AMAZON_XEN, "aws"),
    ({}, AZURE, "azure"),
    ({}, {k: v for k, v in AZURE.items() if k != "chassis_asset_tag"}, "azure"),
    ({}, HYPERV, "local"),
    ({"GCE_METADATA_HOST": "127.0.0.1:8080"}, LAPTOP, "gce"),
    ({"GCE_METADATA_HOST": "127.0.0.1:8080"}, AMAZON, "gce"),
    ({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:1"}, {}, "aws"),
    ({"HVDT_AZURE_METADATA_ENDPOINT": "http://127.0.0.1:1"}, {}, "azure"),
    ({"HVDT_WATCHER": "local"}, GOOGLE, "local"),
    ({"HVDT_WATCHER": "AWS", "GCE_METADATA_HOST": "x"}, GOOGLE, "aws"),
    ({"HVDT_WATCHER": "auto"}, GOOGLE, "gce"),
])
def test_choose_kind(env, dmi, kind):
    assert choose_kind(env, dmi) == kind


def test_choose_kind_rejects_an_unknown_forced_kind():
    with pytest.raises(WatcherConfigError, match="HVDT_WATCHER"):
        choose_kind({"HVDT_WATCHER": "openstack"}, {})


def test_make_watcher_builds_the_chosen_kind_and_drops_foreign_options(tmp_path):
    gce = make_watcher("auto", env={"GCE_METADATA_HOST": "127.0.0.1:9"}, dmi={}, window=12,
                       path=str(tmp_path / "f"), long_poll_timeout=3)
    assert isinstance(gce, GceWatcher) and gce.window == 12 and gce.long_poll_timeout == 3
    assert gce.base_url == "http://127.0.0.1:9/computeMetadata/v1/"
    local = make_watcher("auto", env={}, dmi=LAPTOP, path=str(tmp_path / "f"), long_poll_timeout=3)
    assert isinstance(local, LocalWatcher) and local.path == str(tmp_path / "f")
    assert isinstance(make_watcher("azure", endpoint="http://127.0.0.1:9"), AzureWatcher)
    with pytest.raises(WatcherConfigError):
        make_watcher("ibm")


def test_read_dmi_reads_what_exists(tmp_path):
    (tmp_path / "sys_vendor").write_text("Google\n")
    (tmp_path / "product_name").write_text("Google Compute Engine\n")
    assert read_dmi(tmp_path) == {"sys_vendor": "Google", "product_name": "Google Compute Engine"}
    assert choose_kind({}, read_dmi(tmp_path)) == "gce"
