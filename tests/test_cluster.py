"""`hvd-transient cluster`: pure request builders, dry runs, and up/status/down against the Compute stand-in."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_compute_api import FakeComputeAPI

from hvd_transient.cli import main as cli_main
from hvd_transient.cluster import cli
from hvd_transient.cluster.gcloud import create_command, render
from hvd_transient.cluster.rest_plan import instance_body, up_requests
from hvd_transient.cluster.spec import ClusterSpec, ClusterSpecError, parse_label_items, plan_instances
from hvd_transient.discovery import cli as discover_cli
from hvd_transient.gcp.compute_api import DEFAULT_API_URL

REPO = Path(__file__).resolve().parent.parent
PROJECT, ZA, ZB = "proj-1", "us-central1-a", "us-central1-b"


def spec(**overrides):
    values = dict(name="exp", project=PROJECT, zones=(ZA, ZB), workers=3, startup_script="#!/bin/bash\necho hi\n",
                  labels=(("team", "ml"),), store="gs://bucket/run")
    values.update(overrides)
    return ClusterSpec(**values)


def metadata(body):
    return {item["key"]: item["value"] for item in body["metadata"]["items"]}


# ---- pure -----------------------------------------------------------------------------------


def test_plan_is_one_on_demand_driver_plus_spot_workers_round_robin():
    plans = plan_instances(spec())
    assert [(p.name, p.zone, p.role, p.spot, p.gpu_count) for p in plans] == [
        ("exp-driver", ZA, "driver", False, 0),
        ("exp-worker-0", ZA, "worker", True, 1),
        ("exp-worker-1", ZB, "worker", True, 1),
        ("exp-worker-2", ZA, "worker", True, 1),
    ]
    assert plan_instances(spec(driver_zone=ZB, workers=0))[0].zone == ZB


def test_worker_body_is_spot_gpu_vm_with_startup_script():
    worker = plan_instances(spec(termination_action="DELETE"))[2]
    body = instance_body(worker, spec(termination_action="DELETE"))
    assert body["scheduling"] == {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                                  "onHostMaintenance": "TERMINATE", "automaticRestart": False}
    assert body["machineType"] == f"zones/{ZB}/machineTypes/n1-standard-8"
    assert body["guestAccelerators"] == [{"acceleratorType": f"zones/{ZB}/acceleratorTypes/nvidia-tesla-t4",
                                          "acceleratorCount": 1}]
    assert body["labels"] == {"team": "ml", "hvdt-cluster": "exp", "hvdt-role": "worker"}
    assert body["disks"][0]["initializeParams"]["sourceImage"] == "projects/debian-cloud/global/images/family/debian-12"
    meta = metadata(body)
    assert meta["startup-script"] == "#!/bin/bash\necho hi\n"
    assert meta["hvdt-role"] == "worker" and meta["hvdt-store"] == "gs://bucket/run"
    assert meta["install-nvidia-driver"] == "True"


def test_driver_body_is_on_demand_cpu_vm():
    body = instance_body(plan_instances(spec())[0], spec())
    assert body["scheduling"] == {"provisioningModel": "STANDARD", "onHostMaintenance": "MIGRATE",
                                  "automaticRestart": True}
    assert "guestAccelerators" not in body
    assert body["machineType"].endswith("/n1-standard-4")
    assert "install-nvidia-driver" not in metadata(body)


def test_built_in_gpu_machine_types_and_cpu_only_workers():
    g2 = spec(machine_type="g2-standard-8", gpu_type="nvidia-l4")
    body = instance_body(plan_instances(g2)[1], g2)
    assert "guestAccelerators" not in body  # G2 machine types come with their L4
    assert body["scheduling"]["onHostMaintenance"] == "TERMINATE"
    cpu = spec(gpu_type=None)
    body = instance_body(plan_instances(cpu)[1], cpu)
    assert "guestAccelerators" not in body and "install-nvidia-driver" not in metadata(body)
    assert body["scheduling"]["provisioningModel"] == "SPOT"


def test_ssh_key_and_optional_network_settings():
    s = spec(ssh_public_key="ssh-ed25519 AAAAC3Nza me@laptop", external_ip=False,
             subnetwork="regions/us-central1/subnetworks/train")
    body = instance_body(plan_instances(s)[1], s)
    assert metadata(body)["ssh-keys"] == "hvdt:ssh-ed25519 AAAAC3Nza me@laptop"
    assert body["networkInterfaces"] == [{"network": "global/networks/default",
                                          "subnetwork": "regions/us-central1/subnetworks/train"}]


@pytest.mark.parametrize("overrides, message", [
    ({"name": "Exp"}, "--name"), ({"name": "x" * 41}, "--name"), ({"zones": ()}, "--zones"),
    ({"workers": -1}, "--workers"), ({"termination_action": "HIBERNATE"}, "--termination-action"),
    ({"labels": (("hvdt-role", "x"),)}, "set by the cluster command"), ({"labels": (("Team", "x"),)}, "label"),
    ({"project": ""}, "--project"), ({"boot_disk_gb": 5}, "--boot-disk-gb"),
    ({"standby": "train.py", "store": None}, "--standby needs --store"), ({"standby": " "}, "--standby"),
    ({"standby": "train.py", "job_dir": "srv/job"}, "--job-dir"),
])
def test_invalid_specs_name_the_option(overrides, message):
    with pytest.raises(ClusterSpecError, match=message):
        spec(**overrides)


def test_standby_reaches_the_workers_metadata_only():
    s = spec(standby="train.py --epochs 90", job_dir="/srv/job")
    driver, worker = (metadata(instance_body(p, s)) for p in plan_instances(s)[:2])
    assert worker["hvdt-standby"] == "train.py --epochs 90" and worker["hvdt-job-dir"] == "/srv/job"
    assert "hvdt-standby" not in driver and "hvdt-job-dir" not in driver
    assert "hvdt-standby" not in metadata(instance_body(plan_instances(spec())[1], spec()))


STUBS = {  # what the startup script calls that would change the machine: each logs its argv
    "apt-get": "", "useradd": "", "chown": "", "logger": "", "systemctl": "",
    "systemd-run": 'printf "%s\\0" "$@" > "$HVDT_ROOT/systemd-run.args"',
    "getent": 'echo "hvdt:x:1000:1000::$HVDT_ROOT/home/hvdt:/bin/bash"',
}


def run_startup_script(tmp_path: Path, attributes: dict[str, str]) -> Path:
    """launch/startup_script.sh on this machine: metadata from the emulator, files under a scratch root,
    and stubs for the commands that install packages, add users or start services. Horovod's install is
    skipped as on a VM's later boots (the venv is there with what the metadata asks for)."""
    from hvd_transient.testing.metadata_emulator import MetadataEmulator

    root, bin_dir = tmp_path / "root", tmp_path / "bin"
    venv_python = root / "opt/hvdt/venv/bin/python"
    for path in (bin_dir, venv_python.parent, root / "var/lib/hvdt", root / "home/hvdt"):
        path.mkdir(parents=True, exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    venv_python.write_text("#!/bin/bash\n")
    venv_python.chmod(0o755)
    ready = venv_python.parent / "hvd-transient"  # logs its argv, as the systemd-run stub does
    ready.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$HVDT_ROOT/hvd-transient.args"\n')
    ready.chmod(0o755)
    role = attributes.get("hvdt-role", "worker")
    tf = "tensorflow-cpu==2.15.1" if role == "driver" else "tensorflow==2.15.1"
    (root / "var/lib/hvdt/installed").write_text(f"{tf}|horovod==0.28.1||hvd-transient")
    with MetadataEmulator(instances=["vm"]) as emu:
        for key, value in attributes.items():
            emu.set_attribute("vm", key, value)
        env = {**os.environ, "HVDT_ROOT": str(root), "HVDT_METADATA_URL": emu.root_url("vm"),
               "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        out = subprocess.run(["bash", str(REPO / "launch" / "startup_script.sh")], env=env,
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (root / "var/lib/hvdt/ready").exists()
    return root


def test_startup_script_starts_the_jobs_standby_on_workers(tmp_path):
    root = run_startup_script(tmp_path, {"hvdt-role": "worker", "hvdt-store": "gs://b/run", "hvdt-cluster": "exp",
                                         "hvdt-standby": "train.py --epochs 90 --name 'my run'",
                                         "hvdt-job-dir": "/srv/job"})
    assert "HVDT_STORE=gs://b/run" in (root / "etc/hvdt/env").read_text()
    args = (root / "systemd-run.args").read_text().split("\0")[:-1]
    options, command = args[:args.index("/bin/bash")], args[args.index("/bin/bash"):]
    assert {"--unit", "hvdt-standby", "--uid", "hvdt", "--working-directory", "/srv/job",
            f"--property=EnvironmentFile={root}/etc/hvdt/env"} <= set(options)
    instance_id = command[5]
    assert instance_id.isdigit()  # the metadata server's instance/id
    assert command[1] == "-c" and command[3:] == [f"{root}/opt/hvdt/venv/bin/python", "gs://b/run", instance_id]
    # the unit's command line, with a program that prints its arguments in the venv's python's place
    show = tmp_path / "show-args"
    show.write_text('#!/bin/bash\nprintf "%s\\0" "$@"\n')
    show.chmod(0o755)
    standby = ["-m", "hvd_transient.worker", "--standby", "--store", "gs://b/run"]
    job = ["train.py", "--epochs", "90", "--name", "my run"]
    for ids, given in (([instance_id], ["--instance-id", instance_id]), ([], []), ([""], [])):
        shown = subprocess.run(["/bin/bash", "-c", command[2], str(show), "gs://b/run", *ids], capture_output=True,
                               text=True, timeout=30)
        assert shown.stdout.split("\0")[:-1] == [*standby, *given, *job], shown.stderr


def test_startup_script_starts_no_standby_on_the_driver_or_without_one(tmp_path):
    for i, attributes in enumerate(({"hvdt-role": "driver", "hvdt-store": "gs://b/run", "hvdt-standby": "train.py"},
                                    {"hvdt-role": "worker", "hvdt-store": "gs://b/run"})):
        root = run_startup_script(tmp_path / str(i), attributes)
        assert not (root / "systemd-run.args").exists()


def test_startup_script_publishes_a_worker_without_a_standby_as_ready_at_the_end_of_its_boot(tmp_path):
    root = run_startup_script(tmp_path / "w", {"hvdt-role": "worker", "hvdt-store": "gs://b/run"})
    args = (root / "hvd-transient.args").read_text().split("\0")[:-1]
    assert args[:6] == ["ready", "--store", "gs://b/run", "--host", "vm", "--instance-id"]  # the instance's name
    assert args[6].isdigit() and len(args) == 7
    for name, attributes in (("standby", {"hvdt-store": "gs://b/run", "hvdt-standby": "train.py"}),  # it publishes
                             ("driver", {"hvdt-role": "driver", "hvdt-store": "gs://b/run"}),
                             ("no-store", {"hvdt-role": "worker"})):
        assert not (run_startup_script(tmp_path / name, attributes) / "hvd-transient.args").exists(), name


def test_ready_command_publishes_the_record_discovery_reads(tmp_path, capsys):
    from ckpt_service.stores import LocalStore
    from hvd_transient.discovery.ready import read_ready

    assert cli_main(["ready", "--store", str(tmp_path / "run"), "--host", "w-1", "--instance-id", "42"]) == 0
    [record] = read_ready(LocalStore(str(tmp_path / "run")))
    assert (record.host, record.instance_id, record.pid) == ("w-1", "42", None)
    assert "w-1 is ready to join" in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(SystemExit) as refused:  # a store path below a file is refused as an argument
        cli_main(["ready", "--store", str(blocked / "run")])
    assert refused.value.code == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_label_items():
    assert parse_label_items(["b=2,a=1", "c="]) == (("a", "1"), ("b", "2"), ("c", ""))
    with pytest.raises(ClusterSpecError):
        parse_label_items(["novalue"])


def test_gcloud_equivalent_of_a_worker():
    s = spec(package="hvd-transient[gcs,plot]", startup_script_path="launch/startup_script.sh")
    command = render(create_command(s, plan_instances(s)[1]))
    for flag in ("gcloud compute instances create exp-worker-0", "--provisioning-model=SPOT",
                 "--instance-termination-action=STOP", "--maintenance-policy=TERMINATE",
                 "--accelerator=type=nvidia-tesla-t4,count=1", "--zone=us-central1-a",
                 "--labels=hvdt-cluster=exp,hvdt-role=worker,team=ml",
                 "--metadata-from-file=startup-script=launch/startup_script.sh"):
        assert flag in command
    # a metadata value with a comma switches gcloud to another delimiter
    assert "'--metadata=^|^hvdt-cluster=exp|hvdt-role=worker|hvdt-package=hvd-transient[gcs,plot]|" in command
    driver = render(create_command(s, plan_instances(s)[0]))
    assert "--provisioning-model=STANDARD" in driver and "--accelerator" not in driver


# ---- dry run: no credentials, no network --------------------------------------------------------


UP = ["up", "--name", "exp", "--project", PROJECT, "--zones", f"{ZA},{ZB}", "--workers", "2",
      "--label", "team=ml", "--store", "gs://bucket/run"]


def test_dry_run_prints_exact_requests_and_gcloud_without_credentials(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDT_", "GOOGLE_", "CLOUDSDK_"))}
    env.update(PYTHONPATH=str(REPO), GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "no-such-key.json"),
               HOME=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "hvd_transient.cli", "cluster", *UP, "--dry-run",
                             "--format", "json"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    script = (REPO / "launch" / "startup_script.sh").read_text()
    expected = up_requests(DEFAULT_API_URL, spec(workers=2, startup_script=script,
                                                 startup_script_path=str(REPO / "launch" / "startup_script.sh")))
    assert out["requests"] == [json.loads(json.dumps(r.to_dict())) for r in expected]
    assert [r["url"].rsplit("/", 2)[-2] for r in out["requests"]] == [ZA, ZA, ZB]
    assert len(out["gcloud"]) == 3 and all(c.startswith("gcloud compute instances create") for c in out["gcloud"])

    text = subprocess.run([sys.executable, "-m", "hvd_transient.cli", "cluster", *UP, "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert f"POST {DEFAULT_API_URL}/projects/{PROJECT}/zones/{ZB}/instances" in text.stdout
    assert '"provisioningModel": "SPOT"' in text.stdout and "gcloud compute instances create exp-driver" in text.stdout


def test_down_dry_run_lists_then_deletes(capsys):
    assert cli.main(["down", "--name", "exp", "--project", PROJECT, "--zones", ZA, "--workers", "1",
                     "--keep-driver", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "aggregated/instances?filter=%28labels.hvdt-cluster%20%3D%20%22exp%22%29" in out
    assert f"DELETE {DEFAULT_API_URL}/projects/{PROJECT}/zones/{ZA}/instances/exp-worker-0" in out
    assert "exp-driver" not in out.split("# equivalent gcloud")[0].split("aggregated")[1]


def test_bad_arguments_exit_2(capsys, tmp_path):
    assert cli.main(["up", "--name", "exp", "--project", PROJECT, "--workers", "1", "--dry-run"]) == 2
    assert "--zones" in capsys.readouterr().err
    assert cli.main([*UP, "--ssh-public-key", str(tmp_path / "nope.pub"), "--dry-run"]) == 2
    assert "cannot read ssh public key" in capsys.readouterr().err


# ---- against the fake Compute API ---------------------------------------------------------------


@pytest.fixture
def compute(monkeypatch):
    with FakeComputeAPI(page_size=2, operation_polls=2) as fake:
        monkeypatch.setenv("HVDT_COMPUTE_API", fake.base_url)
        monkeypatch.setenv("HVDT_COMPUTE_ANONYMOUS", "1")
        yield fake


def names(fake):
    return sorted(i["name"] for i in fake.instances(PROJECT))


def test_up_status_down_lifecycle(compute, capsys):
    compute.add_instance(PROJECT, ZA, "other-vm", labels={"hvdt-cluster": "other"})
    assert cli.main(UP) == 0
    out = capsys.readouterr().out
    assert "created exp-driver (driver, on-demand, us-central1-a)" in out
    assert "--label hvdt-cluster=exp --label hvdt-role=worker --use-ip" in out
    assert names(compute) == ["exp-driver", "exp-worker-0", "exp-worker-1", "other-vm"]
    created = {i["name"]: i for i in compute.instances(PROJECT)}
    assert all(i["status"] == "RUNNING" for i in created.values())  # operations were waited for
    assert created["exp-worker-1"]["zone"].endswith(ZB)
    assert created["exp-worker-1"]["scheduling"]["provisioningModel"] == "SPOT"
    assert "startup-script" in metadata(created["exp-worker-0"])
    assert compute.requests_matching("POST", "/wait")  # operations stayed RUNNING for two polls

    assert cli.main(["status", "--name", "exp", "--project", PROJECT, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["role"], r["status"], r["provisioning"], r["gpus"]) for r in rows] == [
        ("exp-driver", "driver", "RUNNING", "on-demand", 0),
        ("exp-worker-0", "worker", "RUNNING", "spot", 1),
        ("exp-worker-1", "worker", "RUNNING", "spot", 1),
    ]
    assert cli.main(["status", "--name", "exp", "--project", PROJECT]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "ZONE", "ROLE", "STATUS", "PROVISIONING", "MACHINE_TYPE", "GPUS",
                                "INTERNAL_IP"]
    assert table[2].split()[:5] == ["exp-worker-0", ZA, "worker", "RUNNING", "spot"]

    # discovery finds exactly the workers, by the labels `up` printed
    assert discover_cli.main(["--backend", "gce", "--project", PROJECT, "--zone", f"{ZA},{ZB}",
                              "--label", "hvdt-cluster=exp", "--label", "hvdt-role=worker"]) == 0
    assert capsys.readouterr().out == "exp-worker-0:1\nexp-worker-1:1\n"

    assert cli.main(["down", "--name", "exp", "--project", PROJECT, "--keep-driver"]) == 0
    assert names(compute) == ["exp-driver", "other-vm"]
    assert cli.main(["down", "--name", "exp", "--project", PROJECT, "--zones", f"{ZA},{ZB}"]) == 0
    assert "deleted exp-driver" in capsys.readouterr().out
    assert names(compute) == ["other-vm"]  # another cluster's VM is never touched
    assert cli.main(["down", "--name", "exp", "--project", PROJECT]) == 0
    assert "no VMs labelled hvdt-cluster=exp" in capsys.readouterr().out


def test_longer_preemption_notice_goes_to_the_beta_api_and_into_the_metadata(compute, capsys):
    """`--preemption-notice-duration` sets the beta scheduling field (v1 would reject it) on the Spot
    workers only, and writes the duration where the watchers read it."""
    from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE

    assert cli.main([*UP, "--preemption-notice-duration", "120s"]) == 0
    created = {i["name"]: i for i in compute.instances(PROJECT)}
    worker, driver = created["exp-worker-0"], created["exp-driver"]
    assert worker["scheduling"]["preemptionNoticeDuration"] == {"seconds": 120}
    assert metadata(worker)[NOTICE_ATTRIBUTE] == "120"
    assert "preemptionNoticeDuration" not in driver["scheduling"] and NOTICE_ATTRIBUTE not in metadata(driver)
    inserts = {r.body["name"]: r.version for r in compute.requests_matching("POST", "/instances")}
    assert inserts == {"exp-driver": "v1", "exp-worker-0": "beta", "exp-worker-1": "beta"}

    # the v1 API refuses the field: the client must not send it there
    from hvd_transient.gcp.compute_api import ComputeAPI, ComputeAPIError

    body = instance_body(plan_instances(spec(preemption_notice_s=120))[1], spec(preemption_notice_s=120))
    with pytest.raises(ComputeAPIError, match="preemptionNoticeDuration"):
        ComputeAPI.connect(api_url=compute.base_url, anonymous=True).call(
            "POST", f"projects/{PROJECT}/zones/{ZA}/instances", body={**body, "name": "exp-worker-9"})


def test_longer_notice_dry_run_shows_the_beta_request_and_gcloud_flag(capsys):
    assert cli.main([*UP, "--preemption-notice-duration", "90", "--dry-run"]) == 0
    out = capsys.readouterr().out
    beta = DEFAULT_API_URL.replace("/v1", "/beta")
    assert f"POST {beta}/projects/{PROJECT}/zones/{ZA}/instances" in out  # the Spot workers
    assert f"POST {DEFAULT_API_URL}/projects/{PROJECT}/zones/{ZA}/instances" in out  # the driver
    assert '"seconds": 90' in out
    assert "gcloud beta compute instances create exp-worker-0" in out and "--preemption-notice-duration=90s" in out
    for bad in ("0", "-5", "2m", "1.5"):
        with pytest.raises(SystemExit) as exited:  # argparse's usage error
            cli.main([*UP, f"--preemption-notice-duration={bad}", "--dry-run"])
        assert exited.value.code == 2
        assert "--preemption-notice-duration" in capsys.readouterr().err


def test_up_again_refills_preempted_workers(compute, capsys):
    assert cli.main(UP) == 0
    inserts = len(compute.requests_matching("POST", "/instances"))
    compute.set_status(PROJECT, ZA, "exp-worker-0", "TERMINATED")  # preempted, termination action STOP
    assert cli.main(["down", "--name", "exp", "--project", PROJECT, "--keep-driver", "--zones", ZB]) == 0  # lost
    capsys.readouterr()

    assert cli.main(UP) == 0
    out = capsys.readouterr().out
    assert "started exp-worker-0 (worker, Spot, was TERMINATED)" in out
    assert "created exp-worker-1" in out and "exists  exp-driver (RUNNING)" in out
    assert len(compute.requests_matching("POST", "/instances")) == inserts + 1  # only the missing one
    assert all(i["status"] == "RUNNING" for i in compute.instances(PROJECT))


def test_spot_worker_preempted_then_started_by_up_is_discovered_again(compute, capsys, tmp_path):
    """A Spot VM preempted with termination action STOP keeps its name and id; once `up` starts it
    again it is a new incarnation, and its leaving record (still inside deadline + grace) no longer
    excludes it. A worker deleted and recreated under its name gets a new id: listed at once too."""
    from ckpt_service.stores import LocalStore
    from hvd_transient.core.membership import publish_leaving

    assert cli.main(UP) == 0
    store = tmp_path / "store"
    discover = ["--backend", "gce", "--project", PROJECT, "--zone", f"{ZA},{ZB}", "--label", "hvdt-cluster=exp",
                "--label", "hvdt-role=worker", "--store", str(store)]
    ids = {i["name"]: i["id"] for i in compute.instances(PROJECT)}
    capsys.readouterr()
    # both workers get a notice and publish themselves, as TransientImpl does, with their instance id
    for name in ("exp-worker-0", "exp-worker-1"):
        publish_leaving(LocalStore(store), name, deadline=time.time() + 30, instance_id=ids[name])
    assert discover_cli.main(discover) == 0
    assert capsys.readouterr().out == ""  # both still RUNNING inside their notice window: excluded

    compute.preempt(PROJECT, ZA, "exp-worker-0")  # the window ends: Compute Engine stops it
    assert cli.main(["down", "--name", "exp", "--project", PROJECT, "--keep-driver", "--zones", ZB]) == 0  # lost
    capsys.readouterr()
    assert discover_cli.main(discover) == 0
    assert capsys.readouterr().out == ""

    assert cli.main(UP) == 0  # restarts exp-worker-0, recreates exp-worker-1
    out = capsys.readouterr().out
    assert "started exp-worker-0 (worker, Spot, was TERMINATED)" in out and "created exp-worker-1" in out
    after = {i["name"]: i for i in compute.instances(PROJECT)}
    assert after["exp-worker-0"]["id"] == ids["exp-worker-0"]  # the same VM, started again
    assert after["exp-worker-1"]["id"] != ids["exp-worker-1"]  # a new VM under the old name
    assert discover_cli.main(discover) == 0
    assert capsys.readouterr().out == "exp-worker-0:1\nexp-worker-1:1\n"


def test_api_failure_is_reported_with_status_1(compute, capsys):
    compute.fail_next(20, status=500)
    assert cli.main(["status", "--name", "exp", "--project", PROJECT]) == 1
    assert "HTTP 500" in capsys.readouterr().err


def test_failed_operation_raises_with_the_operations_errors():
    from hvd_transient.gcp.compute_api import ComputeAPI, ComputeAPIError

    api = ComputeAPI(session=None, base_url="http://127.0.0.1:9/compute/v1")  # a DONE operation needs no call
    done = {"name": "op-1", "status": "DONE", "operationType": "insert", "targetLink": ".../instances/exp-worker-0",
            "error": {"errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": "no T4 in us-central1-a"}]}}
    with pytest.raises(ComputeAPIError, match="insert on .*exp-worker-0 failed: ZONE_RESOURCE_POOL_EXHAUSTED"):
        api.wait_operation(done)
    assert api.wait_operation({**done, "error": None})["status"] == "DONE"


def test_describe_marks_spot_and_legacy_preemptible():
    assert cli.describe({"name": "a", "scheduling": {"preemptible": True}})["provisioning"] == "spot"
    assert cli.describe({"name": "b", "scheduling": {"provisioningModel": "SPOT"}})["provisioning"] == "spot"
    assert cli.describe({"name": "c", "scheduling": {}})["provisioning"] == "on-demand"


def test_up_reports_each_failed_operation_and_exits_1(compute, capsys):
    compute.rejected_inserts["exp-worker-1"] = ("ZONE_RESOURCE_POOL_EXHAUSTED", "no Spot T4 capacity")
    assert cli.main(UP) == 1
    out, err = capsys.readouterr()
    assert "created exp-driver" in out and "created exp-worker-0" in out  # the others still completed
    assert "FAILED  exp-worker-1" in err and "ZONE_RESOURCE_POOL_EXHAUSTED" in err
    assert "1 of 3 VM operations failed" in err
    assert names(compute) == ["exp-driver", "exp-worker-0"]
    del compute.rejected_inserts["exp-worker-1"]
    assert cli.main(UP) == 0  # rerunning fills the gap
    assert names(compute) == ["exp-driver", "exp-worker-0", "exp-worker-1"]
