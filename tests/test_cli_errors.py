"""Every `hvd-transient` subcommand answers bad arguments with one line, a status and no traceback.

Each case runs the installed console script as a real process, so what is checked is
what an operator sees: exactly one line on stderr, ``hvd-transient ...: error: ...``,
naming the bad value; nothing on stdout; exit status 2 for a command line or
configuration to fix (as argparse does), 1 for a command that ran and failed. Only
argument-validation paths run: no demo, benchmark or emulator is really started.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

CLI = str(Path(sys.executable).parent / "hvd-transient")
REPORT_LOG = Path(__file__).resolve().parent / "data" / "report_events"
ERROR_LINE = re.compile(r"^hvd-transient(?: [a-z-]+)*: error: \S")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "empty").mkdir()
    (root / "afile").write_text("not a directory\n")
    return {"tmp": str(root), "empty": str(root / "empty"), "file": str(root / "afile"),
            "missing": str(root / "no-such-dir"), "log": str(REPORT_LOG)}


@pytest.fixture(scope="module")
def busy_port() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


def hvdt(*args: str, module: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hvd_transient.cli"] if module else [CLI]
    # the timeout only guards against a case that starts something long instead of refusing it
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(out: subprocess.CompletedProcess[str], bad: str, status: int) -> str:
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{out.stderr}"
    line = lines[0]
    assert ERROR_LINE.match(line), line
    assert bad in line, f"{bad!r} not named in: {line}"
    assert out.stdout == "", out.stdout
    assert out.returncode == status, (out.returncode, line)
    return line


C = ("--name", "exp", "--project", "p", "--zones", "us-central1-a")
UP = ("cluster", "up", *C, "--dry-run")

CASES = [
    # the dispatcher
    pytest.param(("nope",), "'nope'", 2, id="unknown-command"),
    # stop: the store must be one that can exist, and for a local path it must exist already
    pytest.param(("stop", "s3://bucket/run"), "s3://bucket/run", 2, id="stop-s3"),
    pytest.param(("stop", ""), "empty store URL", 2, id="stop-empty-url"),
    pytest.param(("stop", "gs://"), "gs://", 2, id="stop-gs-no-bucket"),
    pytest.param(("stop", "file://host/run"), "file://host/run", 2, id="stop-file-url-with-host"),
    pytest.param(("stop", "{missing}"), "no-such-dir", 2, id="stop-missing-dir"),
    pytest.param(("stop", "{file}"), "afile", 2, id="stop-not-a-dir"),
    pytest.param(("stop",), "url", 2, id="stop-no-url"),
    # ckpt
    pytest.param(("ckpt", "inspect", "{empty}", "--step", "-1"), "'-1'", 2, id="ckpt-negative-step"),
    pytest.param(("ckpt", "inspect", "{empty}", "--step", "abc"), "'abc'", 2, id="ckpt-non-numeric-step"),
    pytest.param(("ckpt", "verify", "{empty}", "--step", "1.5"), "'1.5'", 2, id="ckpt-fractional-step"),
    pytest.param(("ckpt", "export", "{empty}", "--step", "-3", "{tmp}/x.npz"), "'-3'", 2,
                 id="ckpt-export-negative-step"),
    pytest.param(("ckpt", "ls", "s3://bucket/x"), "s3://bucket/x", 2, id="ckpt-s3"),
    pytest.param(("ckpt", "ls", "gs://"), "gs://", 2, id="ckpt-gs-no-bucket"),
    pytest.param(("ckpt", "ls", "{missing}"), "no-such-dir", 2, id="ckpt-ls-missing-dir"),
    pytest.param(("ckpt", "gc", "{missing}", "--keep", "2"), "no-such-dir", 2, id="ckpt-gc-missing-dir"),
    pytest.param(("ckpt", "ls", "{file}"), "afile", 2, id="ckpt-not-a-dir"),
    pytest.param(("ckpt", "inspect", "{empty}"), "empty", 2, id="ckpt-inspect-no-checkpoint"),
    pytest.param(("ckpt", "verify", "{empty}"), "empty", 2, id="ckpt-verify-no-checkpoint"),
    pytest.param(("ckpt", "export", "{empty}", "--step", "3", "{tmp}/x.npz"), "step 3", 2,
                 id="ckpt-export-step-not-committed"),
    pytest.param(("ckpt", "export", "{empty}", "--step", "3", "{missing}/x.npz"), "no-such-dir", 2,
                 id="ckpt-export-out-dir-missing"),
    pytest.param(("ckpt", "export", "{empty}", "--step", "3", "{tmp}"), "cli-errors", 2,
                 id="ckpt-export-out-is-dir"),
    pytest.param(("ckpt", "gc", "{empty}", "--keep", "0"), "'0'", 2, id="ckpt-gc-keep-0"),
    pytest.param(("ckpt", "frob", "{empty}"), "'frob'", 2, id="ckpt-unknown-subcommand"),
    pytest.param(("ckpt",), "command", 2, id="ckpt-no-subcommand"),
    # report
    pytest.param(("report", "s3://bucket/run"), "s3://bucket/run", 2, id="report-s3"),
    pytest.param(("report", "{missing}"), "no-such-dir", 2, id="report-missing-dir"),
    pytest.param(("report", "{empty}"), "empty", 2, id="report-no-events"),
    pytest.param(("report", "{log}", "--json", "{missing}/r.json"), "no-such-dir", 2, id="report-json-dir-missing"),
    pytest.param(("report", "{log}", "--plot", "{tmp}"), "cli-errors", 2, id="report-plot-is-dir"),
    pytest.param(("report", "{log}", "--instance-type", "no-such-vm"), "'no-such-vm'", 2,
                 id="report-unknown-instance-type"),
    pytest.param(("report", "{log}", "--prices", "{missing}.json"), "no-such-dir.json", 2,
                 id="report-prices-missing"),
    pytest.param(("report", "{log}", "--prices", "{file}"), "afile", 2, id="report-prices-not-json"),
    # cluster (dry runs: no credentials, no network)
    pytest.param((*UP, "--workers", "-1"), "'-1'", 2, id="cluster-negative-workers"),
    pytest.param((*UP, "--workers", "two"), "'two'", 2, id="cluster-non-numeric-workers"),
    pytest.param((*UP, "--workers", "1", "--api-url", "compute.example"), "'compute.example'", 2,
                 id="cluster-bad-api-url"),
    pytest.param((*UP, "--workers", "1", "--store", "s3://bucket/run"), "s3://bucket/run", 2, id="cluster-s3-store"),
    pytest.param((*UP, "--workers", "1", "--label", "oops"), "'oops'", 2, id="cluster-bad-label"),
    pytest.param((*UP, "--workers", "1", "--timeout", "0"), "'0'", 2, id="cluster-zero-timeout"),
    pytest.param((*UP, "--workers", "1", "--boot-disk-gb", "5"), "5", 2, id="cluster-small-disk"),
    pytest.param((*UP, "--workers", "1", "--ssh-public-key", "{missing}.pub"), "no-such-dir.pub", 2,
                 id="cluster-ssh-key-missing"),
    pytest.param(("cluster", "up", "--name", "Bad_Name", "--project", "p", "--zones", "z", "--workers", "1",
                  "--dry-run"), "'Bad_Name'", 2, id="cluster-bad-name"),
    pytest.param(("cluster", "down", *C, "--workers", "-3", "--dry-run"), "'-3'", 2, id="cluster-down-negative"),
    pytest.param(("cluster", "status", "--name", "exp"), "--project", 2, id="cluster-missing-project"),
    # bench (nothing is run)
    pytest.param(("bench", "no-such-bench"), "'no-such-bench'", 2, id="bench-unknown"),
    pytest.param(("bench", "../tests/conftest"), "'../tests/conftest'", 2, id="bench-path"),
    pytest.param(("bench", "all", "--repeats", "1"), "--repeats", 2, id="bench-all-with-args"),
    pytest.param(("bench", "list", "extra"), "'extra'", 2, id="bench-list-with-args"),
    pytest.param(("bench",), "name a benchmark", 2, id="bench-no-name"),
    # metadata-emulator (refused before it serves)
    pytest.param(("metadata-emulator", "--port", "-1"), "'-1'", 2, id="emulator-negative-port"),
    pytest.param(("metadata-emulator", "--port", "70000"), "'70000'", 2, id="emulator-port-too-big"),
    pytest.param(("metadata-emulator", "--port", "http"), "'http'", 2, id="emulator-non-numeric-port"),
    pytest.param(("metadata-emulator", "--port", "{busy_port}"), "{busy_port}", 2, id="emulator-port-in-use"),
    pytest.param(("metadata-emulator", "--instances", ",,"), "',,'", 2, id="emulator-no-instances"),
    pytest.param(("metadata-emulator", "--instances", "a,b,a"), "'a'", 2, id="emulator-duplicate-instance"),
    pytest.param(("metadata-emulator", "--instances", "a/b"), "'a/b'", 2, id="emulator-bad-instance-name"),
    # discover (hvd_transient/discovery/cli.py)
    pytest.param(("discover", "--backend", "file", "--hosts-file", "{missing}"), "no-such-dir", 2,
                 id="discover-hosts-file-missing"),
    pytest.param(("discover", "--backend", "local", "--hosts", "a:x"), "'x'", 2, id="discover-bad-slots"),
    pytest.param(("discover", "--backend", "local", "--hosts", "a", "--store", "s3://b/r"), "s3://b/r", 2,
                 id="discover-s3-store"),
    pytest.param(("discover", "--backend", "gce"), "--project", 2, id="discover-gce-no-project"),
    pytest.param(("discover", "--backend", "ec2"), "'ec2'", 2, id="discover-unknown-backend"),
    pytest.param(("discover", "--backend", "local", "--hosts", "a", "--leaving-grace", "abc"), "'abc'", 2,
                 id="discover-bad-grace"),
    pytest.param(("discover", "--backend", "local", "--hosts", "a", "--timeout", "-1"), "'-1'", 2,
                 id="discover-negative-timeout"),
    pytest.param(("discover", "--backend", "gce", "--project", "p", "--api-url", "compute.example"),
                 "'compute.example'", 2, id="discover-bad-api-url"),
    # demo (only what is refused before anything starts)
    pytest.param(("demo", "--workers", "0", "--workdir", "{tmp}/demo"), "0", 2, id="demo-zero-workers"),
    pytest.param(("demo", "--schedule", "{missing}.json", "--workdir", "{tmp}/demo"), "no-such-dir.json", 2,
                 id="demo-schedule-missing"),
    pytest.param(("demo", "--workers", "abc"), "'abc'", 2, id="demo-non-numeric-workers"),
    pytest.param(("demo", "--model", "nope"), "'nope'", 2, id="demo-unknown-model"),
]


@pytest.mark.parametrize("args, bad, status", CASES)
def test_bad_arguments_get_one_line(args: tuple[str, ...], bad: str, status: int, paths: dict[str, str],
                                    busy_port: str) -> None:
    values = {**paths, "busy_port": busy_port}
    assert_one_line_error(hvdt(*(a.format(**values) for a in args)), bad.format(**values), status)


def test_a_missing_store_is_not_created(paths: dict[str, str]) -> None:
    target = Path(paths["missing"]) / "run"
    assert_one_line_error(hvdt("stop", str(target)), "no-such-dir", 2)
    assert_one_line_error(hvdt("ckpt", "gc", str(target), "--keep", "1"), "no-such-dir", 2)
    assert not Path(paths["missing"]).exists()


def test_a_bad_compute_api_url_in_the_environment_is_a_setup_error() -> None:
    env = {"HVDT_COMPUTE_API": "compute.example", "HVDT_COMPUTE_ANONYMOUS": "1"}
    for args in (("discover", "--backend", "gce", "--project", "p", "--label", "a=b"),
                 ("cluster", "status", "--name", "exp", "--project", "p")):
        assert_one_line_error(hvdt(*args, env=env), "HVDT_COMPUTE_API", 2)


def test_python_dash_m_answers_the_same_way(paths: dict[str, str]) -> None:
    assert_one_line_error(hvdt("stop", "s3://bucket/run", module=True), "s3://bucket/run", 2)
    assert_one_line_error(hvdt("bench", "list", "extra", module=True), "'extra'", 2)


def test_good_arguments_still_work(tmp_path: Path) -> None:
    out = hvdt("stop", str(tmp_path), "--reason", "test")
    assert out.returncode == 0 and "stop requested" in out.stderr
    assert (tmp_path / "control" / "stop").is_file()
