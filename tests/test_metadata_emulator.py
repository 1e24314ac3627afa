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

from hvd_transient.testing.metadata_emulator import AWS_TIME_FORMATS, InvalidRequestError, MetadataEmulator

pytestmark = [pytest.mark.timeout(120), pytest.mark.timed]  # bounds wall-clock times

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
    # as the real server: Google's HTML error page, still flavoured, without an ETag
    assert denied.headers["Metadata-Flavor"] == "Google" and "ETag" not in denied.headers
    assert denied.headers["Content-Type"] == "text/html; charset=UTF-8"
    assert "Missing Metadata-Flavor:Google header." in denied.text
    assert "/i/a/computeMetadata/v1/instance/preempted" in denied.text
    wrong = gce(emu, "a", "instance/preempted", headers={"Metadata-Flavor": "Amazon"})
    assert wrong.status_code == 403

    ok = gce(emu, "a", "instance/preempted")
    assert ok.status_code == 200 and ok.text == "FALSE"
    assert ok.headers["Metadata-Flavor"] == "Google" and ok.headers["ETag"]


def test_gce_rejects_forwarded_requests(emu):
    reply = gce(emu, "a", "instance/name", headers={**FLAVOR, "X-Forwarded-For": "10.0.0.1"})
    assert reply.status_code == 403 and reply.headers["Metadata-Flavor"] == "Google"
    assert "X-Forwarded-For" in reply.text


def test_gce_serves_instance_and_project_keys(emu):
    assert gce(emu, "b", "instance/name").text == "b"
    assert gce(emu, "b", "instance/hostname").text == "b"
    assert re.fullmatch(r"projects/\d+/zones/[a-z0-9-]+", gce(emu, "b", "instance/zone").text)
    assert gce(emu, "b", "project/project-id").text
    assert gce(emu, "b", "instance/maintenance-event").text == "NONE"
    ok = gce(emu, "b", "instance/name")
    assert ok.headers["Content-Type"] == "application/text" and re.fullmatch(r"[0-9a-f]{16}", ok.headers["ETag"])
    missing = gce(emu, "b", "instance/no-such-key")
    assert missing.status_code == 404 and missing.headers["Metadata-Flavor"] == "Google"
    assert missing.headers["Content-Type"] == "text/html; charset=UTF-8"
    assert "<code>/i/b/computeMetadata/v1/instance/no-such-key</code> was not found" in missing.text


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


def test_bad_long_polls_are_a_400(emu):
    assert gce(emu, "a", "instance/preempted", wait_for_change="true", timeout_sec="soon").status_code == 400
    # GCE takes whole seconds only
    assert gce(emu, "a", "instance/preempted", wait_for_change="true", timeout_sec="1.5").status_code == 400
    # a plain directory listing cannot be waited on, only a key or a recursive directory
    listing = gce(emu, "a", "instance/", wait_for_change="true", timeout_sec=60)
    assert listing.status_code == 400 and "recursive=true" in listing.text


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


def _plain(emu: MetadataEmulator, host: str, key: str) -> requests.Response:
    """``key`` without the ``/i/<name>`` prefix, sent to ``host`` (an alias of 127.0.0.1)."""
    return requests.get(f"http://{host}:{emu.port}/computeMetadata/v1/{key}", headers=FLAVOR, timeout=AT_ONCE)


def test_plain_paths_are_answered_by_the_default_instance_whatever_the_host():
    """One rule: ``/i/<name>`` selects an instance; any other path gets the default one, the first
    given, which ``GET /control/instances`` names, even when the Host header names another."""
    with MetadataEmulator(instances=["localhost", "127.0.0.1"]) as emu:
        control = requests.get(f"http://127.0.0.1:{emu.port}/control/instances", timeout=AT_ONCE).json()
        by_ip = _plain(emu, "127.0.0.1", "instance/name")
        by_alias = _plain(emu, "localhost", "instance/name")
        prefixed = requests.get(f"http://localhost:{emu.port}/i/127.0.0.1/computeMetadata/v1/instance/name",
                                headers=FLAVOR, timeout=AT_ONCE)
        emu.add_instance("127.1")  # a later instance never becomes the default
        later = _plain(emu, "127.0.0.1", "instance/name")
        emu.preempt("localhost", window=30)  # the default's state is what plain paths see
        recursive = requests.get(f"http://127.0.0.1:{emu.port}/computeMetadata/v1/instance/",
                                 params={"recursive": "true"}, headers=FLAVOR, timeout=AT_ONCE).json()
        unknown = requests.get(f"http://127.0.0.1:{emu.port}/i/nope/computeMetadata/v1/instance/name",
                               headers=FLAVOR, timeout=AT_ONCE)
    assert control["default"] == "localhost"
    assert by_ip.text == by_alias.text == later.text == "localhost"
    assert prefixed.text == "127.0.0.1"
    assert recursive["name"] == "localhost" and recursive["preempted"] == "TRUE"
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]


def test_default_instance_can_be_chosen_and_is_reported():
    with MetadataEmulator(instances=["a", "b"], default_instance="b") as emu:
        control = requests.get(f"{emu.url}/control/instances", timeout=AT_ONCE).json()
        plain = _plain(emu, "127.0.0.1", "instance/name")
    assert control["default"] == "b" and plain.text == "b"


def test_cli_help_states_the_instance_rule():
    from hvd_transient.testing.metadata_emulator.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "/i/<name>/" in text and "default instance, the first named here" in text
    assert "Host header" in text


def test_directory_listings_like_the_real_server(emu):
    listing = gce(emu, "a", "instance/")
    assert listing.status_code == 200 and listing.headers["Content-Type"] == "application/text"
    assert listing.headers["Metadata-Flavor"] == "Google" and listing.headers["ETag"]
    names = listing.text.splitlines()
    assert {"attributes/", "hostname", "id", "machine-type", "maintenance-event", "name",
            "network-interfaces/", "preempted", "scheduling/", "zone"} <= set(names)
    assert names == sorted(names) and listing.text.endswith("\n")
    assert gce(emu, "a", "instance/", alt="json").json() == names
    assert gce(emu, "a", "instance/network-interfaces/").text == "0/\n"
    assert gce(emu, "a", "instance/attributes/").text == ""  # an empty directory, not a 404
    assert gce(emu, "a", "instance/scheduling/").text.splitlines() == [
        "automatic-restart", "on-host-maintenance", "preemptible"]
    assert gce(emu, "a", "").text == "instance/\nproject/\n"  # computeMetadata/v1/
    assert gce(emu, "a", "project/").text.splitlines() == ["attributes/", "numeric-project-id", "project-id"]
    # above v1, as on the real server: what google-auth's ping asks for
    root = requests.get(emu.root_url("a") + "/", headers=FLAVOR, timeout=AT_ONCE)
    assert root.status_code == 200 and root.text == "computeMetadata/\n"
    assert root.headers["Metadata-Flavor"] == "Google"
    # a directory without its slash is a 301 to the slash form, query kept; unknown paths 404
    moved = gce(emu, "a", "instance/scheduling", allow_redirects=False, recursive="true")
    assert moved.status_code == 301 and moved.headers["Metadata-Flavor"] == "Google"
    assert moved.headers["Location"] == "/i/a/computeMetadata/v1/instance/scheduling/?recursive=true"
    v1 = requests.get(f"{emu.root_url('a')}/computeMetadata/v1", headers=FLAVOR, timeout=AT_ONCE,
                      allow_redirects=False)
    assert v1.status_code == 301 and v1.headers["Location"] == "/i/a/computeMetadata/v1/"
    assert gce(emu, "a", "instance/scheduling", recursive="true").json() == {  # followed, query kept
        "automaticRestart": "FALSE", "onHostMaintenance": "TERMINATE", "preemptible": "TRUE"}
    assert gce(emu, "a", "instance/nope/").status_code == 404
    assert gce(emu, "a", "instance/", alt="yaml").status_code == 400


def test_recursive_json_for_two_instances(emu):
    emu.add_instance("d", zone="europe-west4-a", project_id="other-project")
    emu.preempt("d", window=30)
    docs = {inst: gce(emu, inst, "instance/", recursive="true") for inst in ("a", "d")}
    for inst, reply in docs.items():
        assert reply.headers["Content-Type"] == "application/json"
        doc = reply.json()
        assert doc["name"] == doc["hostname"] == inst
        assert isinstance(doc["id"], int) and str(doc["id"]) == gce(emu, inst, "instance/id").text
        assert doc["maintenanceEvent"] == "NONE"
        assert doc["scheduling"] == {"automaticRestart": "FALSE", "onHostMaintenance": "TERMINATE",
                                     "preemptible": "TRUE"}
        assert doc["attributes"] == {}
        assert re.fullmatch(r"projects/\d+/machineTypes/[a-z0-9-]+", doc["machineType"])
        [nic] = doc["networkInterfaces"]  # a numbered directory is a JSON array
        assert nic["ip"] == gce(emu, inst, "instance/network-interfaces/0/ip").text and nic["mtu"] == 1460
        assert not {"maintenance-event", "machine-type", "network-interfaces"} & set(doc)
    a, d = docs["a"].json(), docs["d"].json()
    assert (a["preempted"], d["preempted"]) == ("FALSE", "TRUE")
    assert a["id"] != d["id"] and a["networkInterfaces"][0]["ip"] != d["networkInterfaces"][0]["ip"]
    assert re.fullmatch(r"projects/\d+/zones/europe-west4-a", d["zone"]) and a["zone"].endswith("/us-central1-a")
    project = gce(emu, "d", "project/", recursive="true").json()
    assert project == {"attributes": {}, "numericProjectId": project["numericProjectId"],
                       "projectId": "other-project"}
    assert isinstance(project["numericProjectId"], int)
    everything = gce(emu, "d", "", recursive="true").json()  # computeMetadata/v1/?recursive=true
    assert everything["instance"] == d and everything["project"] == project
    # alt=json on a key is its JSON value; alt=text on a recursive directory one "path value" a line
    assert gce(emu, "d", "instance/name", alt="json").json() == "d"
    assert gce(emu, "d", "instance/id", alt="json").json() == d["id"]
    text = gce(emu, "d", "instance/", recursive="true", alt="text")
    assert text.headers["Content-Type"] == "application/text"
    lines = text.text.splitlines()
    assert "preempted TRUE" in lines and "scheduling/preemptible TRUE" in lines
    assert "network-interfaces/0/mtu 1460" in lines and "name d" in lines


def test_directory_etags_follow_the_content(emu):
    def etag(inst: str, key: str, **params: str) -> str:
        return gce(emu, inst, key, **params).headers["ETag"]

    tree, listing = etag("a", "instance/", recursive="true"), etag("a", "instance/")
    project = etag("a", "project/", recursive="true")
    other = etag("b", "instance/", recursive="true")
    assert etag("a", "instance/", recursive="true") == tree  # stable while nothing changes
    assert etag("a", "instance/", recursive="true", alt="text") != tree  # another representation
    emu.preempt("a", window=30)
    assert etag("a", "instance/", recursive="true") != tree  # preempted changed under instance/
    assert etag("a", "instance/") == listing  # the names in the listing did not change
    assert etag("a", "project/", recursive="true") == project
    assert etag("b", "instance/", recursive="true") == other  # nor did another instance


def test_wait_for_change_on_a_recursive_directory_wakes_on_a_preemption(emu):
    first = {inst: gce(emu, inst, "instance/", recursive="true") for inst in ("a", "b")}
    results: dict[str, requests.Response] = {}

    def wait(inst: str, timeout_sec: int) -> None:
        results[inst] = gce(emu, inst, "instance/", recursive="true", wait_for_change="true",
                            last_etag=first[inst].headers["ETag"], timeout_sec=timeout_sec, timeout=70)

    before = emu.instance("a").requests
    waiter = threading.Thread(target=wait, args=("a", 60))
    waiter.start()
    assert emu.wait_for(lambda s: s["a"].requests > before, timeout=10)  # the long poll has arrived
    assert "a" not in results  # and is parked: nothing under instance/ changed yet

    emu.preempt("a", window=30)
    waiter.join(AT_ONCE)
    assert not waiter.is_alive()
    reply = results["a"]
    assert reply.status_code == 200 and reply.json()["preempted"] == "TRUE"
    assert reply.headers["ETag"] != first["a"].headers["ETag"]
    assert reply.headers["ETag"] == gce(emu, "a", "instance/", recursive="true").headers["ETag"]

    # b's directory did not change: its long poll ends at timeout_sec with the same content
    wait("b", 1)
    assert results["b"].headers["ETag"] == first["b"].headers["ETag"]
    assert results["b"].json() == first["b"].json()


def test_wait_for_change_on_a_directory_with_a_stale_etag_returns_at_once(emu):
    reply = gce(emu, "a", "instance/", recursive="true", wait_for_change="true", last_etag="0",
                timeout_sec=60)  # "0": what Google's guest agent sends first
    assert reply.status_code == 200 and reply.json()["name"] == "a"


def test_google_auth_metadata_client_reads_the_emulator(emu, monkeypatch):
    """google-auth's own GCE client: its ping, a recursive read through the 301, a 404."""
    from google.auth.compute_engine import _metadata
    from google.auth.transport.requests import Request

    request = Request()
    monkeypatch.setenv("GCE_METADATA_IP", emu.metadata_host("b"))
    assert _metadata.ping(request, timeout=AT_ONCE, retry_count=1)
    root = emu.gce_base_url("b")
    doc = _metadata.get(request, "instance", root=root, recursive=True, retry_count=1)
    assert isinstance(doc, dict) and doc["name"] == "b" and doc["scheduling"]["preemptible"] == "TRUE"
    assert _metadata.get(request, "project/project-id", root=root, retry_count=1) == "hvd-transient-local"
    assert _metadata.get(request, "instance/nope", root=root, retry_count=1,
                         return_none_for_not_found_error=True) is None


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


def test_stop_releases_hung_lost_and_long_polling_requests():
    emu = MetadataEmulator(instances=["a", "b", "c"]).start()
    emu.set_fault("a", "hang")
    emu.set_fault("c", "lose")
    errors: list[BaseException] = []

    def call(inst: str, **params: str) -> None:
        try:
            gce(emu, inst, "instance/preempted", timeout=60, **params)
        except requests.RequestException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=("a",)),
               threading.Thread(target=call, args=("b",), kwargs={"wait_for_change": "true"}),
               threading.Thread(target=call, args=("c",))]
    for t in threads:
        t.start()
    assert emu.wait_for(lambda s: all(s[i].requests == 1 for i in "abc"), timeout=10)
    emu.stop()
    for t in threads:
        t.join(AT_ONCE)
        assert not t.is_alive()
    assert len(errors) == 3  # dropped unanswered, so the clients see a closed connection


# Every cloud's metadata API of one instance, as (method, path, headers, params) under its root.
EVERY_API = [
    ("GET", "/computeMetadata/v1/instance/preempted", FLAVOR, {}),
    ("GET", "/computeMetadata/v1/instance/preempted", FLAVOR,
     {"wait_for_change": "true", "last_etag": "stale", "timeout_sec": "60"}),  # answers at once
    ("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, {}),
    ("GET", "/latest/meta-data/spot/instance-action", {}, {}),  # no token: a 401 when healthy
    ("GET", "/metadata/scheduledevents", {"Metadata": "true"}, {"api-version": "2020-07-01"}),
]


HEALTHY = [200, 200, 200, 401, 200]


def every_api(emu: MetadataEmulator, inst: str, timeout: float = AT_ONCE) -> list[int]:
    return [requests.request(method, emu.root_url(inst) + path, headers=headers, params=params,
                             timeout=timeout).status_code for method, path, headers, params in EVERY_API]


def test_503_for_a_given_time_on_every_api_of_one_instance(emu):
    snap = emu.set_fault("a", "503", duration=1.0)
    assert snap.fault == "503" and snap.fault_until == pytest.approx(time.time() + 1.0, abs=0.5)
    emu.preempt("a", at=snap.fault_until, window=30)  # the notice appears as the errors end
    assert every_api(emu, "a") == [503] * len(EVERY_API)  # the long-poll too, at once
    gce_503 = gce(emu, "a", "instance/preempted")
    assert gce_503.headers["Metadata-Flavor"] == "Google"  # as the real server's errors
    assert every_api(emu, "b") == HEALTHY  # other instances are not affected

    assert emu.wait_for(lambda s: s["a"].fault == "ok", timeout=AT_ONCE)  # it ends by itself...
    assert time.time() >= snap.fault_until  # ...not before its time
    after = emu.instance("a")
    assert after.fault_until is None and after.fault_hits == {"503": len(EVERY_API) + 1}
    assert after.preempted and after.notice_at >= snap.fault_until
    assert gce(emu, "a", "instance/preempted").text == "TRUE"  # the first answer shows the notice


def test_timed_hang_answers_when_it_ends(emu):
    snap = emu.set_fault("a", "hang", duration=1.0)
    answered: dict[str, float] = {}

    def call(i: int, method: str, path: str, headers: dict[str, str], params: dict[str, str]) -> None:
        reply = requests.request(method, emu.root_url("a") + path, headers=headers, params=params, timeout=60)
        if reply.status_code in (200, 401):
            answered[str(i)] = time.time()

    threads = [threading.Thread(target=call, args=(i, *api)) for i, api in enumerate(EVERY_API[::2])]
    for t in threads:
        t.start()
    assert emu.wait_for(lambda s: s["a"].fault_hits.get("hang") == len(threads), timeout=AT_ONCE)
    assert every_api(emu, "b") == HEALTHY
    for t in threads:
        t.join(AT_ONCE)
    assert len(answered) == len(threads)  # every held request was answered...
    assert min(answered.values()) >= snap.fault_until  # ...once the hang was over


def test_lose_never_answers_even_after_it_ends(emu):
    snap = emu.set_fault("a", "lose", duration=0.5)
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            outcome["reply"] = gce(emu, "a", "instance/preempted", timeout=2.0)
        except requests.ReadTimeout as exc:
            outcome["error"] = exc
            outcome["at"] = time.time()

    lost = threading.Thread(target=call)
    lost.start()
    assert emu.wait_for(lambda s: s["a"].fault_hits.get("lose") == 1, timeout=AT_ONCE)
    assert emu.wait_for(lambda s: s["a"].fault == "ok", timeout=AT_ONCE)
    assert gce(emu, "a", "instance/preempted").text == "FALSE"  # new requests are answered again
    lost.join(AT_ONCE)
    # the lost request got nothing, though the fault ended 1.5 s before its client gave up
    assert "reply" not in outcome and isinstance(outcome["error"], requests.ReadTimeout)
    assert outcome["at"] > snap.fault_until + 1.0  # type: ignore[operator]


def test_a_fault_hits_a_long_poll_already_waiting(emu):
    """As a restarting server fails what it holds: an error at once, a lost reply, a late one."""
    path = "computeMetadata/v1/instance/preempted"
    etags = {i: gce(emu, i, "instance/preempted").headers["ETag"] for i in "abc"}
    outcome: dict[str, object] = {}

    def long_poll(inst: str) -> None:
        try:
            reply = gce(emu, inst, "instance/preempted", wait_for_change="true", last_etag=etags[inst],
                        timeout_sec=60, timeout=2.0)
            outcome[inst] = (reply.status_code, reply.text, time.time())
        except requests.ReadTimeout:
            outcome[inst] = "lost"

    threads = [threading.Thread(target=long_poll, args=(i,)) for i in "abc"]
    for t in threads:
        t.start()
    assert emu.wait_for(lambda s: all(s[i].path_hits.get("/" + path) == 2 for i in "abc"), timeout=AT_ONCE)
    emu.set_fault("a", "503")
    emu.set_fault("b", "lose", duration=0.2)
    hang = emu.set_fault("c", "hang", duration=0.5)
    emu.preempt("c", window=30)  # a change during the hang is answered only once it is over
    for t in threads:
        t.join(AT_ONCE)
    assert outcome["a"][:2] == (503, "injected fault: service unavailable\n")  # type: ignore[index]
    assert outcome["b"] == "lost"  # not answered when the fault ended either
    status, text, at = outcome["c"]  # type: ignore[misc]
    assert (status, text) == (200, "TRUE") and at >= hang.fault_until
    assert [emu.instance(i).fault_hits for i in "ab"] == [{"503": 1}, {"lose": 1}]


def test_a_fault_without_a_duration_lasts_until_cleared(emu):
    for endless in (float("inf"), float("nan")):
        with pytest.raises(InvalidRequestError, match="duration"):
            emu.set_fault("a", "503", duration=endless)
    assert emu.set_fault("a", "503").fault_until is None
    assert every_api(emu, "a")[0] == 503
    assert emu.set_fault("a", "ok").fault == "ok"
    assert gce(emu, "a", "instance/preempted").status_code == 200


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
    timed = requests.post(f"{ctl}/b/fault", json={"mode": "503", "duration": 60}, timeout=AT_ONCE).json()
    assert timed["fault"] == "503" and timed["fault_until"] == pytest.approx(time.time() + 60, abs=10)
    for bad in ({"mode": "503", "duration": -1}, {"mode": "503", "duration": "soon"},
                {"mode": "503", "duration": 0}, {"mode": "ok", "duration": 5}):
        refused = requests.post(f"{ctl}/c/fault", json=bad, timeout=AT_ONCE)
        assert refused.status_code == 400 and "duration" in refused.json()["error"], bad
    assert requests.post(f"{ctl}/b/fault", json={"mode": "ok"}, timeout=AT_ONCE).json()["fault_until"] is None
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


# ---- notices in the past, started Azure events, VM names, AWS time formats, trickled replies -----------
AZURE = {"Metadata": "true"}
EVENTS_API = {"api-version": "2020-07-01"}


def azure_events(emu: MetadataEmulator, inst: str) -> list[dict]:
    reply = requests.get(f"{emu.root_url(inst)}/metadata/scheduledevents", headers=AZURE, params=EVENTS_API,
                         timeout=AT_ONCE)
    assert reply.status_code == 200
    return reply.json()["Events"]


def aws_action(emu: MetadataEmulator, inst: str) -> requests.Response:
    root = emu.root_url(inst)
    token = requests.put(f"{root}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
                         timeout=AT_ONCE).text
    return requests.get(f"{root}/latest/meta-data/spot/instance-action",
                        headers={"X-aws-ec2-metadata-token": token}, timeout=AT_ONCE)


def test_a_notice_can_start_in_the_past(emu):
    before = time.time()
    snap = emu.preempt("a", ago=15.0, window=30)
    assert snap.preempted and before - 15 <= snap.notice_at <= time.time() - 15
    assert snap.deadline == pytest.approx(snap.notice_at + 30)
    assert gce(emu, "a", "instance/preempted").text == "TRUE"
    assert aws_action(emu, "a").json()["time"] == iso8601(snap.deadline)
    [event] = azure_events(emu, "a")
    assert event["EventStatus"] == "Scheduled"
    assert email.utils.parsedate_to_datetime(event["NotBefore"]).timestamp() == int(snap.deadline)
    with pytest.raises(InvalidRequestError):
        emu.preempt("b", ago=5.0, delay=1.0)
    with pytest.raises(InvalidRequestError):
        emu.preempt("b", ago=-1.0)


def iso8601(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(epoch)))


def test_an_azure_event_starts_when_approved_or_once_its_not_before_passes(emu):
    with pytest.raises(InvalidRequestError):
        emu.start_azure_event("a")  # no notice, no event
    emu.preempt("a", window=30)
    [scheduled] = azure_events(emu, "a")
    assert scheduled["EventStatus"] == "Scheduled" and scheduled["NotBefore"]
    snap = emu.start_azure_event("a")
    assert snap.azure_started_at is not None
    [started] = azure_events(emu, "a")
    assert started["EventStatus"] == "Started" and started["NotBefore"] == ""
    assert started["EventId"] == scheduled["EventId"]
    emu.preempt("b", ago=31.0, window=30)  # NotBefore is past: Azure shows the event under way
    [_, past] = azure_events(emu, "b")  # (a's event too: every VM of the set sees every event)
    assert past["Resources"] == ["b"] and past["EventStatus"] == "Started" and past["NotBefore"] == ""
    assert emu.reset("a").azure_started_at is None


def test_a_vm_is_named_apart_from_its_host(emu):
    emu.add_instance("10.128.0.7", vm_name="spot-vm-7")
    assert gce(emu, "10.128.0.7", "instance/name").text == "spot-vm-7"
    assert gce(emu, "10.128.0.7", "instance/hostname").text == "10.128.0.7"
    root = emu.root_url("10.128.0.7")
    compute = requests.get(f"{root}/metadata/instance/compute", headers=AZURE,
                           params={"api-version": "2021-02-01"}, timeout=AT_ONCE).json()
    assert compute["name"] == "spot-vm-7" and compute["osProfile"]["computerName"] == "10.128.0.7"
    name = requests.get(f"{root}/metadata/instance/compute/name", headers=AZURE,
                        params={"api-version": "2021-02-01", "format": "text"}, timeout=AT_ONCE)
    assert name.text == "spot-vm-7"
    emu.preempt("10.128.0.7")
    assert [e["Resources"] for e in azure_events(emu, "a")] == [["spot-vm-7"]]  # seen by a VM of the set too
    assert emu.set_vm_name("b", "vm-b").vm_name == "vm-b" and gce(emu, "b", "instance/name").text == "vm-b"
    with pytest.raises(InvalidRequestError):
        emu.set_vm_name("b", "")


def test_aws_instance_action_time_in_each_format(emu):
    expected = {
        "iso8601": r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "iso8601-lower-z": r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dz",
        "iso8601-fraction": r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z",
        "iso8601-offset": r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+0000", "iso8601-no-zone": r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d",
        "iso8601-minutes": r"\d{4}-\d\d-\d\dT\d\d:\d\dZ", "epoch": r"\d{10}",
        "rfc1123": r"\w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", "unreadable": r"in two minutes",
    }
    for fmt in AWS_TIME_FORMATS:
        emu.reset("c")
        emu.preempt("c", window=120, aws_time_format=fmt)
        body = aws_action(emu, "c").json()
        if fmt == "missing":
            assert "time" not in body and body["action"] == "terminate"
        elif fmt == "epoch-number":
            assert body["time"] == int(emu.instance("c").deadline)
        else:
            assert re.fullmatch(expected[fmt], body["time"]), (fmt, body)
    emu.reset("c")
    with pytest.raises(InvalidRequestError):
        emu.preempt("c", aws_time_format="sundial")


def test_trickle_sends_the_headers_at_once_then_a_byte_at_a_time(emu):
    emu.set_fault("a", "trickle", trickle_s=0.2)
    started = time.monotonic()
    with requests.get(emu.gce_base_url("a") + "instance/preempted", headers=FLAVOR, stream=True,
                      timeout=AT_ONCE) as reply:
        headers_after = time.monotonic() - started
        assert reply.status_code == 200 and reply.headers["Content-Length"] == "5"
        body = b"".join(reply.iter_content(1))
    assert body == b"FALSE" and reply.headers["Metadata-Flavor"] == "Google"
    assert headers_after < 0.8 <= time.monotonic() - started  # four gaps of 0.2 s after the first byte
    assert emu.instance("a").fault_hits["trickle"] == 1 and emu.instance("a").trickle_s == 0.2
    with pytest.raises(InvalidRequestError):
        emu.set_fault("a", "trickle", trickle_s=0)


def test_control_api_for_past_notices_vm_names_started_events_and_trickles(emu):
    ctl = f"{emu.url}/control/instances"
    made = requests.post(ctl, json={"name": "d", "vm_name": "spot-vm-d"}, timeout=AT_ONCE).json()
    assert made["vm_name"] == "spot-vm-d"
    assert requests.post(f"{ctl}/a/vm-name", json={"vm_name": "spot-vm-a"}, timeout=AT_ONCE).json()["vm_name"] \
        == "spot-vm-a"
    assert requests.post(f"{ctl}/a/vm-name", json={}, timeout=AT_ONCE).status_code == 400
    past = requests.post(f"{ctl}/b/preempt", json={"ago": 10, "window": 30, "aws_time_format": "epoch"},
                         timeout=AT_ONCE).json()
    assert past["notice_at"] == pytest.approx(time.time() - 10, abs=5) and past["aws_time_format"] == "epoch"
    assert requests.post(f"{ctl}/b/azure-start", timeout=AT_ONCE).json()["azure_started_at"] is not None
    assert requests.post(f"{ctl}/c/azure-start", timeout=AT_ONCE).status_code == 400
    trickle = requests.post(f"{ctl}/c/fault", json={"mode": "trickle", "interval": 0.25}, timeout=AT_ONCE).json()
    assert trickle["fault"] == "trickle" and trickle["trickle_s"] == 0.25
    assert requests.post(f"{ctl}/c/fault", json={"mode": "trickle", "interval": -1}, timeout=AT_ONCE).status_code \
        == 400


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
        banner = [proc.stdout.readline() for _ in range(4)]
        assert f"  default instance x (paths without /i/<name>): GCE_METADATA_HOST={url[7:]}\n" in banner
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
