"""The metadata-server emulator, exercised over real HTTP on 127.0.0.1 ephemeral ports."""
from __future__ import annotations

import calendar
import email.utils
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from hvd_transient.metadata_emulator import MetadataEmulator

pytestmark = pytest.mark.timeout(120)

FLAVOR = {"Metadata-Flavor": "Google"}
# Generous client read timeout: a reply expected "at once" that instead waited for a
# 60 s long-poll would fail the test with ReadTimeout rather than pass slowly.
AT_ONCE = 20


@pytest.fixture
def emu():
    with MetadataEmulator(instances=["a", "b", "c"], port=0) as emulator:
        yield emulator


def gce(emu: MetadataEmulator, inst: str | None, key: str, *, headers=FLAVOR, timeout=AT_ONCE,
        allow_redirects: bool = True, **params) -> requests.Response:
    return requests.get(emu.gce_base_url(inst) + key, headers=headers, params=params, timeout=timeout,
                        allow_redirects=allow_redirects)


# ---- GCE -----------------------------------------------------------------------------------------
def test_gce_requires_metadata_flavor_header(emu):
    denied = gce(emu, "a", "instance/preempted", headers={})
    assert denied.status_code == 403
    assert denied.headers["Metadata-Flavor"] == "Google" and denied.headers["ETag"]
    wrong = gce(emu, "a", "instance/preempted", headers={"Metadata-Flavor": "Amazon"})
    assert wrong.status_code == 403

    ok = gce(emu, "a", "instance/preempted")
    assert ok.status_code == 200 and ok.text == "FALSE"
    assert ok.headers["Metadata-Flavor"] == "Google" and ok.headers["ETag"]


def test_gce_rejects_forwarded_requests(emu):
    reply = gce(emu, "a", "instance/name", headers={**FLAVOR, "X-Forwarded-For": "10.0.0.1"})
    assert reply.status_code == 403


def test_gce_serves_instance_and_project_keys(emu):
    assert gce(emu, "b", "instance/name").text == "b"
    assert gce(emu, "b", "instance/hostname").text == "b"
    assert re.fullmatch(r"projects/\d+/zones/[a-z0-9-]+", gce(emu, "b", "instance/zone").text)
    assert gce(emu, "b", "project/project-id").text
    assert gce(emu, "b", "instance/maintenance-event").text == "NONE"
    assert gce(emu, "b", "instance/no-such-key").status_code == 404


def test_etag_changes_with_the_value_only(emu):
    first = gce(emu, "a", "instance/preempted").headers["ETag"]
    assert gce(emu, "a", "instance/preempted").headers["ETag"] == first
    emu.preempt("a", window=30)
    assert gce(emu, "a", "instance/preempted").headers["ETag"] != first


def test_stale_etag_returns_at_once(emu):
    reply = gce(emu, "a", "instance/preempted", wait_for_change="true", last_etag="not-the-current-etag",
                timeout_sec=60)
    assert reply.status_code == 200 and reply.text == "FALSE"

    old = reply.headers["ETag"]
    emu.preempt("a", window=30)
    reply = gce(emu, "a", "instance/preempted", wait_for_change="true", last_etag=old, timeout_sec=60)
    assert reply.text == "TRUE" and reply.headers["ETag"] != old


def test_wait_for_change_returns_when_preempted_from_another_thread(emu):
    etag = gce(emu, "a", "instance/preempted").headers["ETag"]
    before = emu.instance("a").requests
    result: dict[str, requests.Response] = {}
    poll = threading.Thread(target=lambda: result.setdefault("r", gce(
        emu, "a", "instance/preempted", wait_for_change="true", last_etag=etag, timeout_sec=60)))
    poll.start()
    assert emu.wait_for(lambda s: s["a"].requests > before, timeout=10)
    assert "r" not in result  # still parked in the long-poll

    emu.preempt("a", window=30)
    poll.join(AT_ONCE)
    assert not poll.is_alive()
    assert result["r"].text == "TRUE" and result["r"].headers["ETag"] != etag


def test_wait_for_change_without_etag_waits_for_the_next_change(emu):
    result: dict[str, requests.Response] = {}
    poll = threading.Thread(target=lambda: result.setdefault("r", gce(
        emu, "a", "instance/maintenance-event", wait_for_change="true", timeout_sec=60)))
    poll.start()
    assert emu.wait_for(lambda s: s["a"].requests >= 1, timeout=10)
    emu.set_maintenance("a", "MIGRATE_ON_HOST_MAINTENANCE")
    poll.join(AT_ONCE)
    assert result["r"].text == "MIGRATE_ON_HOST_MAINTENANCE"


def test_timeout_sec_returns_the_unchanged_value(emu):
    current = gce(emu, "a", "instance/preempted")
    reply = gce(emu, "a", "instance/preempted", wait_for_change="true",
                last_etag=current.headers["ETag"], timeout_sec=1)
    assert reply.status_code == 200 and reply.text == "FALSE"
    assert reply.headers["ETag"] == current.headers["ETag"]


def test_bad_timeout_sec_is_a_400(emu):
    reply = gce(emu, "a", "instance/preempted", wait_for_change="true", timeout_sec="soon")
    assert reply.status_code == 400


def test_instances_are_isolated(emu):
    emu.preempt("b", window=30)
    assert gce(emu, "a", "instance/preempted").text == "FALSE"
    assert gce(emu, "b", "instance/preempted").text == "TRUE"
    assert gce(emu, "c", "instance/preempted").text == "FALSE"
    # The plain path is the default (first) instance.
    assert gce(emu, None, "instance/name").text == "a"
    assert gce(emu, None, "instance/preempted").text == "FALSE"
    # A long-poll on a is not woken by b's preemption.
    etag = gce(emu, "a", "instance/preempted").headers["ETag"]
    emu.preempt("c", window=30)
    reply = gce(emu, "a", "instance/preempted", wait_for_change="true", last_etag=etag, timeout_sec=1)
    assert reply.text == "FALSE"
    assert gce(emu, "zz", "instance/name").status_code == 404


def test_plain_paths_are_answered_by_the_default_instance_whatever_the_host():
    """One rule: ``/i/<name>`` selects an instance; any other path gets the default one, the first
    given, which ``GET /control/instances`` names, even when the Host header names another."""
    with MetadataEmulator(instances=["localhost", "127.0.0.1"]) as emu:
        control = requests.get(f"http://127.0.0.1:{emu.port}/control/instances", timeout=AT_ONCE).json()
        by_ip = requests.get(f"http://127.0.0.1:{emu.port}/computeMetadata/v1/instance/name",
                             headers=FLAVOR, timeout=AT_ONCE)
        by_alias = requests.get(f"http://localhost:{emu.port}/computeMetadata/v1/instance/name",
                                headers=FLAVOR, timeout=AT_ONCE)
        prefixed = requests.get(f"http://localhost:{emu.port}/i/127.0.0.1/computeMetadata/v1/instance/name",
                                headers=FLAVOR, timeout=AT_ONCE)
    assert control["default"] == "localhost"
    assert by_ip.text == by_alias.text == "localhost"
    assert prefixed.text == "127.0.0.1"


def test_directories_listings_and_recursive_json_like_the_real_server(emu):
    emu.add_instance("d", zone="europe-west4-a")
    listing = gce(emu, "a", "instance/")
    assert listing.status_code == 200 and listing.headers["Content-Type"] == "application/text"
    names = listing.text.splitlines()
    assert {"attributes/", "hostname", "id", "maintenance-event", "name", "preempted", "scheduling/",
            "zone"} <= set(names) and names == sorted(names)
    assert gce(emu, "a", "").text.splitlines() == ["instance/", "project/"]
    assert gce(emu, "a", "instance/attributes/").text == ""  # an empty directory
    assert gce(emu, "a", "instance/", alt="json").json() == names
    # a directory without its slash is redirected to it; an unknown path is 404
    moved = gce(emu, "a", "instance/scheduling", allow_redirects=False)
    assert moved.status_code == 301 and moved.headers["Location"].endswith("/computeMetadata/v1/instance/scheduling/")
    assert gce(emu, "a", "instance/scheduling").text.splitlines() == [
        "automatic-restart", "on-host-maintenance", "preemptible"]
    assert gce(emu, "a", "instance/nope/").status_code == 404
    # recursive JSON, camelCase names and numeric ids, for every instance
    for inst in ("a", "d"):
        doc = gce(emu, inst, "instance/", recursive="true").json()
        assert doc["name"] == inst and isinstance(doc["id"], int)
        assert doc["preempted"] == "FALSE" and doc["maintenanceEvent"] == "NONE"
        assert doc["scheduling"] == {"automaticRestart": "FALSE", "onHostMaintenance": "TERMINATE",
                                     "preemptible": "TRUE"}
        assert doc["attributes"] == {}
    assert gce(emu, "d", "instance/", recursive="true").json()["zone"].endswith("/zones/europe-west4-a")
    text = gce(emu, "a", "instance/scheduling/", recursive="true", alt="text").text
    assert "preemptible TRUE\n" in text
    assert gce(emu, "a", "instance/name", alt="json").json() == "a"
    assert gce(emu, "a", "instance/", alt="yaml").status_code == 400


def test_wait_for_change_on_a_recursive_directory_wakes_on_a_change_under_it(emu):
    first = gce(emu, "a", "instance/", recursive="true")
    assert first.headers["ETag"] == gce(emu, "a", "instance/", recursive="true").headers["ETag"]  # stable
    other = gce(emu, "a", "project/", recursive="true")
    results: dict[str, requests.Response] = {}
    waiter = threading.Thread(target=lambda: results.setdefault("reply", gce(
        emu, "a", "instance/", recursive="true", wait_for_change="true", last_etag=first.headers["ETag"],
        timeout_sec=60, timeout=70)))
    waiter.start()
    emu.wait_for(lambda s: s["a"].requests >= 4, timeout=10)  # the long poll has arrived
    emu.preempt("a", window=30)
    waiter.join(30)
    reply = results["reply"]
    assert reply.json()["preempted"] == "TRUE"
    assert reply.headers["ETag"] != first.headers["ETag"]
    # a directory that did not change keeps its ETag
    assert gce(emu, "a", "project/", recursive="true").headers["ETag"] == other.headers["ETag"]


def test_scheduled_preemption_at_an_absolute_time(emu):
    at = time.time() + 1.0
    snap = emu.preempt("a", at=at, window=12)
    assert snap.scheduled_at == at and not snap.preempted and snap.deadline is None
    reply = gce(emu, "a", "instance/preempted")
    if reply.text == "FALSE":  # (on a very slow machine T may already have passed)
        reply = gce(emu, "a", "instance/preempted", wait_for_change="true",
                    last_etag=reply.headers["ETag"], timeout_sec=60)
    assert reply.text == "TRUE"
    snap = emu.instance("a")
    assert snap.preempted and snap.notice_at >= at
    assert snap.deadline == pytest.approx(snap.notice_at + 12)


def test_preempting_twice_is_a_conflict_until_reset(emu):
    emu.preempt("a", window=30)
    with pytest.raises(Exception, match="already preempted"):
        emu.preempt("a")
    emu.reset("a")
    assert gce(emu, "a", "instance/preempted").text == "FALSE"
    emu.preempt("a", window=30)
    assert gce(emu, "a", "instance/preempted").text == "TRUE"


def test_kill_pid_gets_sigterm_when_the_window_ends(emu):
    child = subprocess.Popen(["sleep", "60"])
    try:
        emu.preempt("a", window=0.5, kill_pid=child.pid)
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    snap = emu.instance("a")
    assert snap.killed_at is not None and snap.killed_at >= snap.deadline
    assert snap.kill_signal == "SIGTERM" and snap.kill_error is None


def test_kill_of_a_missing_pid_is_recorded_not_fatal(emu):
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: the pid is gone
    emu.preempt("a", window=0, kill_pid=child.pid)
    assert emu.wait_for(lambda s: s["a"].kill_error is not None, timeout=10)
    assert gce(emu, "a", "instance/preempted").text == "TRUE"  # the server keeps serving


# ---- AWS IMDSv2 --------------------------------------------------------------------------------
def test_aws_imdsv2_token_and_spot_instance_action(emu):
    root = emu.root_url("b")
    action_url = f"{root}/latest/meta-data/spot/instance-action"
    assert requests.get(action_url, timeout=AT_ONCE).status_code == 401
    assert requests.put(f"{root}/latest/api/token", timeout=AT_ONCE).status_code == 400
    assert requests.get(action_url, headers={"X-aws-ec2-metadata-token": "forged"},
                        timeout=AT_ONCE).status_code == 401

    token = requests.put(f"{root}/latest/api/token",
                         headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout=AT_ONCE)
    assert token.status_code == 200 and token.text
    auth = {"X-aws-ec2-metadata-token": token.text}
    assert requests.get(action_url, headers=auth, timeout=AT_ONCE).status_code == 404
    assert requests.get(f"{root}/latest/meta-data/instance-id", headers=auth,
                        timeout=AT_ONCE).text.startswith("i-")

    emu.preempt("b", window=120)
    reply = requests.get(action_url, headers=auth, timeout=AT_ONCE)
    assert reply.status_code == 200
    body = reply.json()
    assert body["action"] == "terminate"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", body["time"])
    deadline = emu.instance("b").deadline
    parsed = calendar.timegm(time.strptime(body["time"], "%Y-%m-%dT%H:%M:%SZ"))
    assert parsed == int(deadline)
    # Other instances have no interruption, and b's token is b's alone.
    assert requests.get(f"{emu.root_url('c')}/latest/meta-data/spot/instance-action", headers=auth,
                        timeout=AT_ONCE).status_code == 401


# ---- Azure Scheduled Events ------------------------------------------------------------------
def test_azure_scheduled_events(emu):
    url = f"{emu.root_url('c')}/metadata/scheduledevents"
    params = {"api-version": "2020-07-01"}
    assert requests.get(url, params=params, timeout=AT_ONCE).status_code == 400
    assert requests.get(url, headers={"Metadata": "true"}, timeout=AT_ONCE).status_code == 400

    quiet = requests.get(url, params=params, headers={"Metadata": "true"}, timeout=AT_ONCE).json()
    assert quiet["Events"] == []

    emu.preempt("c", window=45)
    doc = requests.get(url, params=params, headers={"Metadata": "true"}, timeout=AT_ONCE).json()
    assert doc["DocumentIncarnation"] > quiet["DocumentIncarnation"]
    [event] = doc["Events"]
    assert event["EventType"] == "Preempt" and event["ResourceType"] == "VirtualMachine"
    assert event["Resources"] == ["c"] and event["EventStatus"] == "Scheduled" and event["EventId"]
    not_before = email.utils.parsedate_to_datetime(event["NotBefore"]).timestamp()
    assert not_before == int(emu.instance("c").deadline)
    name = requests.get(f"{emu.root_url('c')}/metadata/instance/compute/name", headers={"Metadata": "true"},
                        params={"api-version": "2021-02-01", "format": "text"}, timeout=AT_ONCE)
    assert name.text == "c"


# ---- faults ----------------------------------------------------------------------------------------
def test_fault_500_and_garbage(emu):
    emu.set_fault("a", "500")
    reply = gce(emu, "a", "instance/preempted")
    assert reply.status_code == 500 and reply.headers["Metadata-Flavor"] == "Google"
    assert gce(emu, "b", "instance/preempted").status_code == 200  # only a is broken

    emu.set_fault("a", "garbage")
    reply = gce(emu, "a", "instance/preempted")
    assert reply.status_code == 200 and reply.content not in (b"TRUE", b"FALSE")
    assert emu.instance("a").fault_hits == {"500": 1, "garbage": 1}

    emu.set_fault("a", "ok")
    assert gce(emu, "a", "instance/preempted").text == "FALSE"


def test_hang_answers_nothing_until_cleared(emu):
    emu.set_fault("a", "hang")
    result: dict[str, requests.Response] = {}
    poll = threading.Thread(target=lambda: result.setdefault("r", gce(emu, "a", "instance/name", timeout=60)))
    poll.start()
    assert emu.wait_for(lambda s: s["a"].fault_hits.get("hang") == 1, timeout=10)
    assert gce(emu, "b", "instance/name").text == "b"  # other instances keep answering
    assert "r" not in result

    emu.set_fault("a", "ok")
    poll.join(AT_ONCE)
    assert result["r"].status_code == 200 and result["r"].text == "a"


def test_stop_releases_hung_and_long_polling_requests():
    emu = MetadataEmulator(instances=["a", "b"]).start()
    emu.set_fault("a", "hang")
    errors: list[BaseException] = []

    def call(inst: str, **params: str) -> None:
        try:
            gce(emu, inst, "instance/preempted", timeout=60, **params)
        except requests.RequestException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=("a",)),
               threading.Thread(target=call, args=("b",), kwargs={"wait_for_change": "true"})]
    for t in threads:
        t.start()
    assert emu.wait_for(lambda s: s["a"].requests == 1 and s["b"].requests == 1, timeout=10)
    emu.stop()
    for t in threads:
        t.join(AT_ONCE)
        assert not t.is_alive()
    assert len(errors) == 2  # dropped unanswered, so the clients see a closed connection


# ---- control API over HTTP -----------------------------------------------------------------
def test_control_api_over_http(emu):
    ctl = f"{emu.url}/control/instances"
    assert requests.post(ctl, json={"name": "d", "zone": "europe-west4-a"}, timeout=AT_ONCE).status_code == 201
    assert requests.post(ctl, json={"name": "d"}, timeout=AT_ONCE).status_code == 409
    assert gce(emu, "d", "instance/zone").text.endswith("/zones/europe-west4-a")

    reply = requests.post(f"{ctl}/d/preempt", json={"delay": 60, "window": 5, "kill_pid": None}, timeout=AT_ONCE)
    assert reply.status_code == 200
    snap = reply.json()
    assert snap["scheduled_at"] > time.time() and snap["preempted"] is False

    assert requests.post(f"{ctl}/d/reset", timeout=AT_ONCE).json()["scheduled_at"] is None
    assert requests.post(f"{ctl}/d/preempt", json={"window": 5}, timeout=AT_ONCE).json()["preempted"] is True

    assert requests.post(f"{ctl}/a/maintenance", json={"event": "TERMINATE_ON_HOST_MAINTENANCE"},
                         timeout=AT_ONCE).status_code == 200
    assert gce(emu, "a", "instance/maintenance-event").text == "TERMINATE_ON_HOST_MAINTENANCE"
    assert requests.post(f"{ctl}/a/maintenance", json={"event": "REBOOT"}, timeout=AT_ONCE).status_code == 400
    assert requests.post(f"{ctl}/a/fault", json={"mode": "slow"}, timeout=AT_ONCE).status_code == 400
    assert requests.post(f"{ctl}/a/fault", json={"mode": "500"}, timeout=AT_ONCE).json()["fault"] == "500"
    assert requests.post(f"{ctl}/nope/preempt", json={}, timeout=AT_ONCE).status_code == 404
    assert requests.post(f"{ctl}/a/preempt", data=b"{not json", timeout=AT_ONCE).status_code == 400

    state = requests.get(ctl, timeout=AT_ONCE).json()
    assert set(state["instances"]) == {"a", "b", "c", "d"} and state["default"] == "a"
    d = state["instances"]["d"]
    assert d["preempted"] and d["deadline"] == pytest.approx(d["notice_at"] + 5)
    assert state["instances"]["a"]["fault"] == "500"


def test_control_api_signals_a_pid_with_a_chosen_signal(emu):
    child = subprocess.Popen(["sleep", "60"])
    try:
        reply = requests.post(f"{emu.url}/control/instances/b/preempt",
                              json={"window": 0.2, "kill_pid": child.pid, "signal": "SIGINT"}, timeout=AT_ONCE)
        assert reply.status_code == 200
        assert child.wait(timeout=30) == -signal.SIGINT
    finally:
        child.kill()
        child.wait()


# ---- CLI ---------------------------------------------------------------------------------------------
def test_cli_serves_until_sigterm():
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hvd_transient.cli", "metadata-emulator", "--port", "0", "--instances", "x,y"],
        stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
    try:
        url = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
        reply = requests.get(f"{url}/i/y/computeMetadata/v1/instance/name", headers=FLAVOR, timeout=AT_ONCE)
        assert reply.text == "y"
        assert requests.post(f"{url}/control/instances/x/preempt", json={}, timeout=AT_ONCE).ok
        assert requests.get(f"{url}/computeMetadata/v1/instance/preempted", headers=FLAVOR,
                            timeout=AT_ONCE).text == "TRUE"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
