"""Host discovery: pure parsing/filtering, the command, and the gce backend against a real HTTP stand-in."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_compute_api import FakeComputeAPI, parse_filter

from ckpt_service.stores import LocalStore
from hvd_transient.core.membership import (
    Incarnation,
    LeavingRecord,
    excluded,
    leaving_hosts,
    prune_leaving,
    publish_leaving,
    read_leaving,
    still_leaving,
)
from hvd_transient.discovery import cli
from hvd_transient.discovery.errors import DiscoveryConfigError
from hvd_transient.discovery.gce import hosts_from_instances, hosts_from_managed, label_filter, parse_labels
from hvd_transient.discovery.hosts import (
    Host,
    exclude_leaving,
    format_hosts,
    parse_host_lines,
    parse_host_list,
    parse_state_document,
    unique,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "launch" / "discover_hosts.sh"
PROJECT, ZONE_A, ZONE_B = "proj-1", "us-central1-a", "us-central1-b"


# ---- pure: parsing, filtering, formatting ----------------------------------------------------


def test_host_lines_with_comments_slots_and_blanks():
    text = "# workers\nw1:4\n\n  w2   # default slots\n10.1.2.3:2\n"
    assert parse_host_lines(text, default_slots=2) == [Host("w1", 4), Host("w2", 2), Host("10.1.2.3", 2)]


@pytest.mark.parametrize("line, message", [
    ("w1:0", "positive"), ("w1:x", "positive"), ("w1:1:2", "host:slots"), (":3", "empty host"),
    ("bad host", "invalid host name"), ("a,b", "invalid host name"),
])
def test_bad_host_lines_name_the_line(line, message):
    with pytest.raises(DiscoveryConfigError, match=message) as info:
        parse_host_lines(f"ok\n{line}\n", origin="hosts.txt")
    assert "hosts.txt:2" in str(info.value)


def test_host_list_and_state_documents():
    assert parse_host_list("a, b:3,,") == [Host("a"), Host("b", 3)]
    expected = [Host("a", 2), Host("b", 4)]
    assert parse_state_document('["a", "b:4"]', 2) == expected
    assert parse_state_document('{"hosts": [{"host": "a"}, {"host": "b", "slots": 4}]}', 2) == expected
    assert parse_state_document("a\nb:4\n", 2) == expected
    assert parse_state_document("", 1) == []
    for bad in ('{"hosts": 3}', '[{"slots": 1}]', '[{"host": "a", "slots": "2"}]', "[1,"):
        with pytest.raises(DiscoveryConfigError):
            parse_state_document(bad, 1, origin="state.json")


def test_unique_exclude_and_format():
    hosts = [Host("w1", 1, frozenset({"10.0.0.1"})), Host("w2"), Host("w1", 3), Host("w3")]
    assert unique(hosts) == [hosts[0], hosts[1], hosts[3]]
    # a host leaves when any of its names is published: here w1 under its IP
    records = [LeavingRecord(name, published_at=100.0, deadline=130.0) for name in ("10.0.0.1", "w3", "stranger")]
    assert exclude_leaving(unique(hosts), records, 150.0, grace_s=60) == [Host("w2")]
    # past deadline + grace the records describe VMs that are gone: every host is listed again
    assert exclude_leaving(unique(hosts), records, 190.5, grace_s=60) == unique(hosts)
    assert format_hosts([Host("w2", 2), Host("w4")]) == "w2:2\nw4:1\n"
    assert format_hosts([]) == ""


def _instance(name, status="RUNNING", labels=None, ip="192.0.2.1", gpus=0):
    instance = {"name": name, "status": status, "labels": labels or {}, "networkInterfaces": [{"networkIP": ip}]}
    if gpus:
        instance["guestAccelerators"] = [{"acceleratorCount": gpus}]
    return instance


def test_hosts_from_instances_keeps_running_labelled_only():
    labels = {"hvdt-role": "worker"}
    instances = [
        _instance("w2", labels=labels, ip="192.0.2.2", gpus=2),
        _instance("w1", labels=labels, ip="192.0.2.1"),
        _instance("w3", status="STOPPING", labels=labels),
        _instance("driver", labels={"hvdt-role": "driver"}),
    ]
    assert hosts_from_instances(instances, labels=labels, slots=1, use_ip=False) == [
        Host("w1", 1, frozenset({"192.0.2.1"})), Host("w2", 1, frozenset({"192.0.2.2"}))]
    by_gpu = hosts_from_instances(instances, labels=labels, slots=None, use_ip=True)
    assert [(h.name, h.slots, h.aliases) for h in by_gpu] == [
        ("192.0.2.1", 1, frozenset({"w1"})), ("192.0.2.2", 2, frozenset({"w2"}))]


def test_hosts_from_managed_drops_members_being_removed():
    members = [
        {"instance": "https://x/zones/z/instances/m1", "instanceStatus": "RUNNING", "currentAction": "NONE"},
        {"instance": "https://x/zones/z/instances/m2", "instanceStatus": "RUNNING", "currentAction": "DELETING"},
        {"instance": "https://x/zones/z/instances/m3", "instanceStatus": "STAGING", "currentAction": "CREATING"},
        {"instance": "https://x/zones/z/instances/m4", "instanceStatus": "RUNNING", "currentAction": "VERIFYING"},
    ]
    assert hosts_from_managed(members, None, slots=2, use_ip=False) == [Host("m1", 2), Host("m4", 2)]
    by_name = {"m1": _instance("m1", ip="192.0.2.7")}
    # with --use-ip a member missing from the instance list is left out rather than guessed
    assert hosts_from_managed(members, by_name, slots=1, use_ip=True) == [Host("192.0.2.7", 1, frozenset({"m1"}))]


def test_label_filter_round_trips_through_the_fake_parser():
    text = label_filter(parse_labels(["hvdt-role=worker,run=r1"]))
    assert text == '(status = "RUNNING") (labels.hvdt-role = "worker") (labels.run = "r1")'
    assert parse_filter(text) == [("status", "=", "RUNNING"), ("labels.hvdt-role", "=", "worker"),
                                  ("labels.run", "=", "r1")]
    with pytest.raises(DiscoveryConfigError, match="key=value"):
        parse_labels(["novalue"])


# ---- the command, in process ----------------------------------------------------------------


# ---- leaving records: a record excludes only the incarnation of the host that published it ------


def test_a_record_excludes_until_its_deadline_plus_grace():
    record = LeavingRecord("w1", published_at=1000.0, deadline=1030.0)
    assert still_leaving(record, 1000.0, grace_s=60)
    assert still_leaving(record, 1090.0, grace_s=60)
    assert not still_leaving(record, 1090.1, grace_s=60)
    assert not still_leaving(record, 1030.5, grace_s=0)
    # no deadline: the default 30 s window from publication
    assert still_leaving(LeavingRecord("w1", published_at=1000.0), 1089.0, grace_s=60)
    assert not still_leaving(LeavingRecord("w1", published_at=1000.0), 1091.0, grace_s=60)


def test_a_restarted_or_recreated_vm_is_a_new_incarnation():
    record = LeavingRecord("w1", published_at=1000.0, deadline=1030.0, instance_id="42")
    same_vm = Incarnation(instance_id="42", started_at=500.0)
    assert still_leaving(record, 1010.0, incarnation=same_vm)
    assert not still_leaving(record, 1010.0, incarnation=Incarnation(instance_id="42", started_at=1005.0))
    assert not still_leaving(record, 1010.0, incarnation=Incarnation(instance_id="43", started_at=500.0))
    assert still_leaving(record, 1010.0, incarnation=Incarnation())  # nothing known: the deadline decides
    by_name = {"w1": Incarnation("42", 1005.0), "w2": Incarnation("7", 1.0)}
    records = [record, LeavingRecord("w2", published_at=1000.0, instance_id="7")]
    assert excluded(records, by_name, 1010.0) == {"w2"}


def test_records_round_trip_and_garbage_expires(tmp_path):
    store = LocalStore(tmp_path / "store")
    written = publish_leaving(store, "w1", deadline=2030.0, instance_id="42", now=2000.0)
    assert read_leaving(store) == [written]
    assert written == LeavingRecord("w1", published_at=2000.0, deadline=2030.0, instance_id="42")
    # a record from before instance ids were stored still parses; an unreadable one names its host
    # but expires at once, so it can never exclude a host forever
    store.put("hosts/leaving/old.json", json.dumps({"host": "old", "reason": "preemption-notice",
                                                    "published_at": 2000.0, "deadline": 2030.0}).encode())
    store.put("hosts/leaving/junk.json", b"{not json")
    by_host = {r.host: r for r in read_leaving(store)}
    assert by_host["old"] == LeavingRecord("old", published_at=2000.0, deadline=2030.0)
    assert leaving_hosts(store, now=2010.0) == {"w1", "old"}
    assert prune_leaving(store, now=2010.0) == ["junk"]
    assert prune_leaving(store, now=2100.0) == ["old", "w1"]
    assert read_leaving(store) == []


def test_discovery_grace_option_and_environment(tmp_path, capsys, monkeypatch):
    store = LocalStore(tmp_path / "store")
    import time as _time

    publish_leaving(store, "w2", deadline=_time.time() - 5)  # the VM is gone by now
    argv = ["--backend", "local", "--hosts", "w1,w2", "--store", str(tmp_path / "store")]
    assert run(argv, capsys)[:2] == (0, "w1:1\n")  # default grace 60 s: still excluded
    assert run(argv + ["--leaving-grace", "1"], capsys)[:2] == (0, "w1:1\nw2:1\n")
    monkeypatch.setenv("HVDT_LEAVING_GRACE_S", "2")
    assert run(argv, capsys)[:2] == (0, "w1:1\nw2:1\n")
    with pytest.raises(SystemExit):
        cli.main(argv + ["--leaving-grace", "-1"])
    assert "--leaving-grace" in capsys.readouterr().err


def test_local_state_file_incarnations_readmit_a_restarted_host(tmp_path, capsys):
    import time as _time

    store = LocalStore(tmp_path / "store")
    record = publish_leaving(store, "127.0.1", deadline=_time.time() + 30)
    state = tmp_path / "hosts.json"
    argv = ["--backend", "local", "--state-file", str(state), "--store", str(tmp_path / "store")]
    doc = {"hosts": [{"host": "localhost", "started_at": 1.0},
                     {"host": "127.0.1", "started_at": record.published_at - 100}]}
    state.write_text(json.dumps(doc))
    assert run(argv, capsys)[:2] == (0, "localhost:1\n")
    doc["hosts"][1]["started_at"] = record.published_at + 1  # the simulator started it again
    state.write_text(json.dumps(doc))
    assert run(argv, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    state.write_text(json.dumps({"hosts": [{"host": "a", "started_at": "yesterday"}]}))
    code, _, err = run(argv, capsys)
    assert code == 2 and "started_at must be Unix seconds" in err


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_file_backend_and_store_exclusion(tmp_path, capsys):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("w1:2\nw2\nw3 # spare\n")
    store_dir = tmp_path / "store"
    publish_leaving(LocalStore(store_dir), "w2")
    code, out, err = run(["--backend", "file", "--hosts-file", str(hosts_file), "--store", str(store_dir)], capsys)
    assert (code, out) == (0, "w1:2\nw3:1\n"), err


def test_discovery_reads_only_the_records_of_hosts_it_lists(tmp_path, capsys, monkeypatch):
    """Records of VMs that discovery no longer lists (gone, or of an earlier wave) change nothing it
    prints: reading them would make every call cost one store read per VM that ever left."""
    store_dir = tmp_path / "store"
    for host in ["w2", *(f"old{i}" for i in range(30))]:
        publish_leaving(LocalStore(store_dir), host)
    read: list[str] = []
    real_get = LocalStore.get
    monkeypatch.setattr(LocalStore, "get", lambda self, key: read.append(key) or real_get(self, key))
    code, out, err = run(["--backend", "local", "--hosts", "w1,w2,w3", "--store", str(store_dir)], capsys)
    assert (code, out) == (0, "w1:1\nw3:1\n"), err
    assert [k for k in read if "leaving" in k] == [k for k in read if k.endswith("w2.json")] and len(read) == 1, read


def test_leaving_records_are_read_several_at_a_time(tmp_path):
    """A wave writes many records at once: they are read in parallel, so a call costs about one round
    trip per READ_PARALLEL records (each read here waits until another read is under way too)."""
    import threading

    from hvd_transient.core import membership

    store = LocalStore(tmp_path / "store")
    hosts = [f"w{i}" for i in range(12)]
    for host in hosts:
        publish_leaving(store, host)
    both = threading.Barrier(2, timeout=10)
    real_get = store.get

    def get(key: str) -> bytes:
        both.wait()  # breaks (BrokenBarrierError) if reads run one at a time
        return real_get(key)

    store.get = get  # type: ignore[method-assign]
    assert membership.READ_PARALLEL >= 2
    assert sorted(r.host for r in read_leaving(store)) == sorted(hosts)


def test_local_backend_reads_state_file_each_call(tmp_path, capsys):
    state = tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": ["localhost:1"]}))
    argv = ["--backend", "local", "--hosts", "127.0.0.1", "--state-file", str(state)]
    assert run(argv, capsys)[:2] == (0, "127.0.0.1:1\nlocalhost:1\n")
    tmp = tmp_path / "hosts.json.tmp"  # the demo rewrites atomically: temp file + replace
    tmp.write_text(json.dumps({"hosts": ["localhost:1", "127.0.1:1"]}))
    os.replace(tmp, state)
    assert run(argv, capsys)[:2] == (0, "127.0.0.1:1\nlocalhost:1\n127.0.1:1\n")


def test_no_hosts_is_empty_output_and_success(tmp_path, capsys):
    state = tmp_path / "state"
    state.write_text("# nobody yet\n")
    assert run(["--backend", "local", "--state-file", str(state)], capsys)[:2] == (0, "")


@pytest.mark.parametrize("argv, message", [
    (["--backend", "file", "--hosts-file", "/nonexistent/hosts"], "does not exist"),
    (["--backend", "file"], "needs --hosts-file"),
    (["--backend", "local"], "needs --hosts"),
    (["--backend", "local", "--hosts", "a", "--slots", "auto"], "only applies to the gce backend"),
    (["--backend", "local", "--hosts", "a", "--slots", "0"], "positive"),
    (["--backend", "local", "--hosts", "a", "--store", "s3://bucket/x"], "unsupported store URL"),
    (["--backend", "gce", "--label", "a=b"], "needs --project"),
    (["--backend", "gce", "--project", "p", "--zone", "z"], "needs --mig NAME or at least one --label"),
    (["--backend", "gce", "--project", "p", "--zone", "a,b", "--mig", "g"], "exactly one --zone"),
])
def test_misconfiguration_exits_2_with_a_clear_message(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("HVDT_COMPUTE_API", "http://127.0.0.1:9/compute/v1")  # never contacted
    monkeypatch.setenv("HVDT_COMPUTE_ANONYMOUS", "1")
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "")
    assert message in err


def test_unknown_backend_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--backend", "ec2"])
    assert info.value.code == 2
    assert "invalid choice: 'ec2'" in capsys.readouterr().err


def test_anonymous_without_stand_in_url_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("HVDT_COMPUTE_API", raising=False)
    monkeypatch.setenv("HVDT_COMPUTE_ANONYMOUS", "1")
    code, out, err = run(["--backend", "gce", "--project", "p", "--label", "a=b"], capsys)
    assert (code, out) == (2, "") and "only works with a stand-in" in err


# ---- gce backend against the fake Compute API ------------------------------------------------


@pytest.fixture
def compute(monkeypatch):
    with FakeComputeAPI(page_size=2) as fake:
        monkeypatch.setenv("HVDT_COMPUTE_API", fake.base_url)
        monkeypatch.setenv("HVDT_COMPUTE_ANONYMOUS", "1")
        yield fake


def _cluster(fake):
    role = {"hvdt-role": "worker"}
    for index, zone in enumerate([ZONE_A, ZONE_B, ZONE_A, ZONE_B, ZONE_A]):
        fake.add_instance(PROJECT, zone, f"w{index}", labels=role, ip=f"192.0.2.{20 + index}", gpus=1)
    fake.set_status(PROJECT, ZONE_B, "w3", "TERMINATED")  # preempted Spot VM, stopped
    fake.add_instance(PROJECT, ZONE_A, "driver", labels={"hvdt-role": "driver"})
    fake.add_instance("other-project", ZONE_A, "w9", labels=role)


def test_gce_label_backend_pages_through_zones(compute, capsys):
    _cluster(compute)
    code, out, err = run(["--backend", "gce", "--project", PROJECT, "--zone", f"{ZONE_A},{ZONE_B}",
                          "--label", "hvdt-role=worker"], capsys)
    assert (code, out) == (0, "w0:1\nw1:1\nw2:1\nw4:1\n"), err
    lists = compute.requests_matching("GET", f"zones/{ZONE_A}/instances")
    assert len(lists) == 2  # three matches in zone a at two per page
    assert lists[1].query["pageToken"] == "2"
    assert all(r.query["filter"] == label_filter({"hvdt-role": "worker"}) for r in lists)
    assert all(r.authorization is None for r in compute.requests)  # anonymous: no credentials sent


def test_gce_label_backend_without_zones_uses_aggregated_list(compute, capsys):
    _cluster(compute)
    code, out, err = run(["--backend", "gce", "--project", PROJECT, "--label", "hvdt-role=worker",
                          "--use-ip", "--slots", "auto"], capsys)
    assert (code, out) == (0, "192.0.2.20:1\n192.0.2.21:1\n192.0.2.22:1\n192.0.2.24:1\n"), err
    assert compute.requests_matching("GET", "aggregated/instances")


def test_gce_mig_backend_and_store_exclusion_by_alias(compute, capsys, tmp_path):
    for name in ("m1", "m2", "m3", "m4"):
        compute.add_instance(PROJECT, ZONE_A, name, gpus=2)
    compute.set_status(PROJECT, ZONE_A, "m4", "STOPPING")
    compute.add_mig(PROJECT, ZONE_A, "workers", {"m1": "NONE", "m2": "NONE", "m3": "DELETING", "m4": "NONE"})
    argv = ["--backend", "gce", "--project", PROJECT, "--zone", ZONE_A, "--mig", "workers", "--slots", "auto"]
    assert run(argv, capsys)[:2] == (0, "m1:2\nm2:2\n")
    # m2 publishes itself as leaving under its IP; discovery prints names, and still drops it
    m2_ip = next(i for i in compute.instances(PROJECT) if i["name"] == "m2")["networkInterfaces"][0]["networkIP"]
    store = tmp_path / "store"
    publish_leaving(LocalStore(store), m2_ip)
    assert run(argv + ["--store", str(store)], capsys)[:2] == (0, "m1:2\n")
    assert compute.requests_matching("POST", "instanceGroupManagers/workers/listManagedInstances")


def test_gce_transient_5xx_is_retried(compute, capsys):
    _cluster(compute)
    compute.fail_next(2, status=503)
    code, out, _ = run(["--backend", "gce", "--project", PROJECT, "--zone", ZONE_B, "--label", "hvdt-role=worker"],
                       capsys)
    assert (code, out) == (0, "w1:1\n")


def test_gce_unreachable_api_is_failure_not_empty_output(compute, capsys):
    compute.fail_next(10, status=503)
    code, out, err = run(["--backend", "gce", "--project", PROJECT, "--zone", ZONE_A, "--label", "a=b"], capsys)
    assert (code, out) == (1, "")
    assert "cannot determine hosts" in err and "503" in err


def test_gce_missing_mig_is_a_clear_error(compute, capsys):
    code, out, err = run(["--backend", "gce", "--project", PROJECT, "--zone", ZONE_A, "--mig", "nope"], capsys)
    assert (code, out) == (1, "")
    assert "instance group manager nope not found" in err


# ---- the script horovodrun runs, as a subprocess ---------------------------------------------


def _script_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDT_")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if shutil.which("hvd-transient", path=env["PATH"]) is None:  # package not installed: run the module
        env["HVDT_CLI"] = f"{sys.executable} -m hvd_transient.cli"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def test_discover_hosts_script_with_env_against_fake_api(tmp_path):
    with FakeComputeAPI(page_size=1) as fake:
        _cluster(fake)
        store = tmp_path / "store"
        publish_leaving(LocalStore(store), "w2")
        env = _script_env(
            HVDT_DISCOVERY_BACKEND="gce", HVDT_PROJECT=PROJECT, HVDT_ZONES=f"{ZONE_A},{ZONE_B}",
            HVDT_LABELS="hvdt-role=worker", HVDT_STORE=str(store), HVDT_SLOTS="2",
            HVDT_COMPUTE_API=fake.base_url, HVDT_COMPUTE_ANONYMOUS="1",
        )
        result = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (result.returncode, result.stdout) == (0, "w0:2\nw1:2\nw4:2\n"), result.stderr
        # arguments given to the script come after the environment's: single-valued ones win,
        # --label adds a condition
        result = subprocess.run([str(SCRIPT), "--slots", "1", "--label", "tier=none"], env=env,
                                capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (result.returncode, result.stdout) == (0, ""), result.stderr
        result = subprocess.run([str(SCRIPT), "--slots", "1"], env=env, capture_output=True, text=True,
                                timeout=60, cwd=tmp_path)
        assert (result.returncode, result.stdout) == (0, "w0:1\nw1:1\nw4:1\n"), result.stderr


def test_discover_hosts_script_reports_misconfiguration(tmp_path):
    env = _script_env(HVDT_DISCOVERY_BACKEND="file", HVDT_HOSTS_FILE=str(tmp_path / "missing"))
    result = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "does not exist" in result.stderr


def test_discovery_does_not_import_heavy_modules():
    """It runs every second on the launcher: a local store's records need no HTTP client either."""
    code = (
        "import sys, io, contextlib\n"
        "from hvd_transient.discovery import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--backend', 'local', '--hosts', 'a', '--store', sys.argv[1]])\n"
        "heavy = [m for m in ('tensorflow', 'horovod', 'zarr', 'numpy', 'google.cloud.storage', 'requests')\n"
        "         if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, "/nonexistent-store-dir"], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


# ---- gs:// stores: listed through the JSON API, without google-cloud-storage ------------------


def test_gcs_store_exclusion_against_fake_gcs_server(gcs_emulator_session, capsys):
    from ckpt_service.stores import open_store

    emu = gcs_emulator_session
    bucket = emu.new_bucket("leave")
    publish_leaving(open_store(f"gs://{bucket}/runs/r1"), "w2")
    publish_leaving(open_store(f"gs://{bucket}/runs/r2"), "w1")  # another run's notice must not count
    argv = ["--backend", "local", "--hosts", "w1,w2,w3", "--store", f"gs://{bucket}/runs/r1"]
    assert run(argv, capsys)[:2] == (0, "w1:1\nw3:1\n")
    code, out, err = run(["--backend", "local", "--hosts", "w1", "--store", "gs://no-such-bucket-hvdt/r"], capsys)
    assert (code, out) == (2, "") and "no-such-bucket-hvdt" in err

    script = (
        "import sys\n"
        "from hvd_transient.discovery.cli import main\n"
        "code = main(['--backend', 'local', '--hosts', 'w1,w2', '--store', sys.argv[1]])\n"
        "sys.stderr.write('google.cloud.storage' if 'google.cloud.storage' in sys.modules else 'light')\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, f"gs://{bucket}/runs/r1"], capture_output=True,
                            text=True, timeout=60, cwd=REPO, env={**os.environ, **emu.env})
    assert (result.returncode, result.stdout) == (0, "w1:1\n"), result.stderr
    assert result.stderr.endswith("light")


# ---- the join gate: a new VM is listed once its standby worker is ready -------------------------


def _vm(name: str, started_at: float | None, instance_id: str | None = None, aliases: tuple[str, ...] = ()) -> Host:
    incarnation = Incarnation(instance_id=instance_id, started_at=started_at) if started_at or instance_id else None
    return Host(name, 1, frozenset(aliases), incarnation)


def test_join_gate_holds_back_only_new_vms_without_a_ready_standby():
    from hvd_transient.discovery.ready import JoinGate, ReadyRecord

    gate = JoinGate(standby_since=1000.0, join_timeout_s=120.0)
    at_launch, unknown, new = _vm("a", 900.0), _vm("b", None), _vm("c", 1010.0)
    now = 1050.0
    assert not gate.awaits(at_launch, now) and not gate.awaits(unknown, now) and gate.awaits(new, now)
    assert gate.admit([at_launch, unknown, new], [], now) == [at_launch, unknown]
    assert gate.admit([new], [ReadyRecord("c", ready_at=1040.0)], now) == [new]
    # a record of an earlier incarnation (ready before this VM started) does not count
    assert gate.admit([new], [ReadyRecord("c", ready_at=1005.0)], now) == []
    # the join timeout: listed anyway, standby or not
    assert gate.admit([new], [], 1010.0 + 120.0) == [new]
    assert gate.awaits(new, 1129.9) and not gate.awaits(new, 1130.0)


def test_join_gate_matches_instance_ids_and_aliases():
    from hvd_transient.discovery.ready import JoinGate, ReadyRecord

    gate = JoinGate(standby_since=1000.0)
    vm = _vm("10.0.0.7", 1010.0, instance_id="42", aliases=("w-3",))
    assert gate.admit([vm], [ReadyRecord("w-3", 1020.0, instance_id="42")], 1030.0) == [vm]
    assert gate.admit([vm], [ReadyRecord("w-3", 1020.0, instance_id="41")], 1030.0) == []  # a recreated VM
    assert gate.admit([vm], [ReadyRecord("w-3", 1020.0)], 1030.0) == [vm]  # id unknown: the time decides
    assert gate.admit([vm], [ReadyRecord("w-4", 1020.0)], 1030.0) == []


def test_join_gate_gathers_vms_that_started_together():
    """VMs that started within gather_s of each other are listed together: the first ready waits for the others,
    at most gather_s after the first of them was ready; one that started apart, or gather_s 0, does not wait."""
    from hvd_transient.discovery.ready import JoinGate, ReadyRecord

    gate = JoinGate(standby_since=1000.0, join_timeout_s=120.0, gather_s=10.0)
    a, b, far = _vm("a", 1010.0), _vm("b", 1014.0), _vm("c", 1030.0)
    a_ready = [ReadyRecord("a", ready_at=1040.0)]
    assert gate.admit([a, b], a_ready, 1045.0) == []  # a waits for b, which started 4 s after it
    assert gate.admit([a, b], a_ready + [ReadyRecord("b", ready_at=1046.0)], 1046.5) == [a, b]  # together
    assert gate.admit([a, b], a_ready, 1049.9) == [] and gate.admit([a, b], a_ready, 1050.0) == [a]  # at most 10 s
    assert gate.admit([a, far], a_ready, 1045.0) == [a]  # 20 s apart: not a group
    assert JoinGate(standby_since=1000.0, gather_s=0.0).admit([a, b], a_ready, 1045.0) == [a]
    # the hold runs from the first of the group to be ready: one ready later is not held longer
    b_ready = [ReadyRecord("b", ready_at=1048.0)]
    assert gate.admit([a, b, _vm("d", 1012.0)], a_ready + b_ready, 1049.0) == []
    assert gate.admit([a, b, _vm("d", 1012.0)], a_ready + b_ready, 1050.0) == [a, b]
    # a VM present at launch, or one past its join timeout (listed anyway), holds nobody back
    assert gate.admit([a, _vm("e", 990.0)], a_ready, 1045.0) == [a, _vm("e", 990.0)]
    late = JoinGate(standby_since=1000.0, join_timeout_s=40.0, gather_s=10.0)
    assert late.admit([a, _vm("f", 1004.0)], a_ready, 1045.0) == [a, _vm("f", 1004.0)]  # f waited 41 s: listed


def test_ready_records_round_trip_and_unreadable_ones_admit_nobody(tmp_path):
    from hvd_transient.discovery.ready import ReadyRecord, publish_ready, read_ready
    from hvd_transient.store_keys import ready_key

    store = LocalStore(tmp_path / "store")
    record = publish_ready(store, "w-3", pid=4242, instance_id="42", now=1234.5)
    assert read_ready(store) == [record] == [ReadyRecord("w-3", 1234.5, 4242, "42")]
    store.put(ready_key("w-4"), b"{not json")
    store.put(ready_key("w-5"), json.dumps({"ready_at": True}).encode())
    assert [r.host for r in read_ready(store)] == ["w-3"]


def test_discover_gates_a_new_vm_until_its_standby_is_ready(tmp_path, capsys, monkeypatch):
    import time as _time

    from hvd_transient.discovery.ready import publish_ready

    now = _time.time()
    store_dir, state = tmp_path / "store", tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": [{"host": "localhost", "started_at": now - 100},
                                           {"host": "127.0.1", "started_at": now - 5}]}))
    argv = ["--backend", "local", "--state-file", str(state), "--store", str(store_dir)]
    assert run(argv, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")  # no gate unless asked for
    gated = argv + ["--standby-since", str(now - 50)]
    assert run(gated, capsys)[:2] == (0, "localhost:1\n")
    assert run(gated + ["--join-timeout", "4"], capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")  # waited enough
    publish_ready(LocalStore(store_dir), "127.0.1")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    # discovery lists a VM it let through the gate for a job whatever it reads later
    LocalStore(store_dir).delete("hosts/ready/127.0.1.json")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    # the environment, as the simulator and a launch script set it (another job)
    monkeypatch.setenv("HVDT_STANDBY_SINCE", str(now - 51))
    assert run(argv, capsys)[:2] == (0, "localhost:1\n")
    monkeypatch.setenv("HVDT_JOIN_TIMEOUT_S", "4")
    assert run(argv, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    code, out, err = run(["--backend", "local", "--hosts", "a", "--standby-since", "1"], capsys)
    assert (code, out) == (2, "") and "needs --store" in err


def test_discover_lists_vms_that_started_together_once_all_are_ready(tmp_path, capsys, monkeypatch):
    import time as _time

    from hvd_transient.discovery.ready import publish_ready

    now = _time.time()
    store_dir, state = tmp_path / "store", tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": [{"host": "localhost", "started_at": now - 100},
                                           {"host": "127.0.1", "started_at": now - 5},
                                           {"host": "127.0.2", "started_at": now - 4}]}))
    gated = ["--backend", "local", "--state-file", str(state), "--store", str(store_dir),
             "--standby-since", str(now - 50)]
    publish_ready(LocalStore(store_dir), "127.0.1")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n")  # 127.0.2 started with it and is warming up
    assert run(gated + ["--join-gather", "0"], capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    monkeypatch.setenv("HVDT_JOIN_GATHER_S", "0")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    monkeypatch.delenv("HVDT_JOIN_GATHER_S")
    publish_ready(LocalStore(store_dir), "127.0.2")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n127.0.2:1\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(gated + ["--join-gather", "-1"])
    assert exit_.value.code == 2 and "--join-gather: expected a number of seconds >= 0" in capsys.readouterr().err


def test_discover_remembers_whom_it_let_through_in_its_listed_file_and_survives_a_bad_one(tmp_path, capsys, caplog):
    """The VMs let through the gate go to --listed-file (kept while their join timeout runs); a file that cannot
    be read is none, and one that cannot be written costs the memory, never the listing."""
    import time as _time

    from hvd_transient.discovery.ready import publish_ready

    now = _time.time()
    store_dir, state, listed = tmp_path / "store", tmp_path / "hosts.json", tmp_path / "listed.json"
    state.write_text(json.dumps({"hosts": [{"host": "localhost", "started_at": now - 100},
                                           {"host": "127.0.1", "started_at": now - 5, "instance_id": "9"}]}))
    gated = ["--backend", "local", "--state-file", str(state), "--store", str(store_dir),
             "--standby-since", str(now - 50), "--listed-file", str(listed)]
    assert run(gated, capsys)[:2] == (0, "localhost:1\n") and not listed.exists()
    publish_ready(LocalStore(store_dir), "127.0.1", instance_id="9")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n")
    assert json.loads(listed.read_text()) == [["127.0.1", "9", now - 5]]
    listed.write_text("[[[not json")
    LocalStore(store_dir).delete("hosts/ready/127.0.1.json")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n") and "treating it as empty" in caplog.text
    listed.unlink()
    listed.mkdir()  # cannot be replaced: the listing goes on
    publish_ready(LocalStore(store_dir), "127.0.1", instance_id="9")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n127.0.1:1\n") and "cannot write" in caplog.text


def test_discover_never_lists_a_new_vm_under_notice_ready_or_not(tmp_path, capsys):
    """A standby that saw a notice publishes its host as leaving: past the join gate's timeout (when a VM with
    no ready record is listed anyway), and with a ready record published before the notice came, the host
    stays out until its record is over."""
    import time as _time

    from hvd_transient.core.membership import publish_leaving
    from hvd_transient.discovery.ready import publish_ready

    now = _time.time()
    store_dir, state = tmp_path / "store", tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": [{"host": "localhost", "started_at": now - 100},
                                           {"host": "127.0.1", "started_at": now - 5}]}))
    gated = ["--backend", "local", "--state-file", str(state), "--store", str(store_dir),
             "--standby-since", str(now - 50)]
    publish_leaving(LocalStore(store_dir), "127.0.1", deadline=now + 25)
    assert run(gated, capsys)[:2] == (0, "localhost:1\n")
    assert run(gated + ["--join-timeout", "4"], capsys)[:2] == (0, "localhost:1\n")  # past the gate's timeout
    publish_ready(LocalStore(store_dir), "127.0.1")
    assert run(gated, capsys)[:2] == (0, "localhost:1\n")


def test_discover_script_gates_through_the_environment(tmp_path):
    import time as _time

    from hvd_transient.discovery.ready import publish_ready

    now = _time.time()
    state = tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": [{"host": "localhost", "started_at": now - 100},
                                           {"host": "127.0.1", "started_at": now - 1}]}))
    env = {**os.environ, "HVDT_DISCOVERY_BACKEND": "local", "HVDT_STATE_FILE": str(state),
           "HVDT_STORE": str(tmp_path / "store"), "HVDT_STANDBY_SINCE": str(now - 50),
           "HVDT_CLI": f"{sys.executable} -m hvd_transient.cli"}
    result = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "localhost:1\n"), result.stderr
    publish_ready(LocalStore(tmp_path / "store"), "127.0.1")
    result = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "localhost:1\n127.0.1:1\n"), result.stderr


def test_gcs_store_ready_records_against_fake_gcs_server(gcs_emulator_session, capsys, tmp_path):
    import time as _time

    from ckpt_service.stores import open_store
    from hvd_transient.discovery.ready import publish_ready

    bucket = gcs_emulator_session.new_bucket("ready")
    now = _time.time()
    state = tmp_path / "hosts.json"
    state.write_text(json.dumps({"hosts": [{"host": "w1", "started_at": now - 100},
                                           {"host": "w2", "started_at": now - 5}]}))
    argv = ["--backend", "local", "--state-file", str(state), "--store", f"gs://{bucket}/runs/r1",
            "--standby-since", str(now - 50)]
    publish_ready(open_store(f"gs://{bucket}/runs/r2"), "w2")  # another run's standby must not count
    assert run(argv, capsys)[:2] == (0, "w1:1\n")
    publish_ready(open_store(f"gs://{bucket}/runs/r1"), "w2")
    assert run(argv, capsys)[:2] == (0, "w1:1\nw2:1\n")
