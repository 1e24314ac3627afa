"""The worker launcher and the standby it hands a job to, with a tiny script (no TensorFlow, no hvd.init).

The script stops at Horovod's elastic entry point (``horovod.common.elastic.run_fn``) like a
training script's ``@hvd.elastic.run`` function, so the standby's handoff is exercised for real:
the launcher's environment, working directory, stdin/stdout/stderr, exit status and signals.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Iterator

import pytest

from hvd_transient.join import standby, wire
from hvd_transient.join.launcher import find_socket, hand_off

pytestmark = pytest.mark.timed  # bounds wall-clock times

TINY = """\
import os, sys, time
from horovod.common.elastic import run_fn

if os.environ.get("FAIL_EARLY"):
    raise SystemExit("failing before the elastic function")

class State:
    def sync(self): pass
    def on_hosts_updated(self, timestamp, result): pass

def train(state):
    print(f"job in {os.getpid()} X={os.environ.get('X')} cwd={os.getcwd()} argv={sys.argv[1:]}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    mode = os.environ.get("MODE", "exit")
    if mode == "stdin":
        print("read", sys.stdin.readline().strip(), flush=True)
    elif mode == "wait":  # until a signal ends it (short sleeps: a handler runs between them)
        while True:
            time.sleep(0.05)
    sys.exit(int(os.environ.get("CODE", "0")))

print(f"name={__name__} pid={os.getpid()} argv={sys.argv}", flush=True)
run_fn(train, lambda: None)(State())
"""
HOST = "h1"
TIMEOUT = 60


class Lines:
    """A pipe read line by line in the background, so a test can wait for a line with a timeout."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> str:
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                raise AssertionError(f"ended without {text!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            if text in line:
                return line


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    short = tempfile.mkdtemp(prefix="sb-")  # unix socket paths are short
    yield {**os.environ, "HOROVOD_HOSTNAME": HOST, wire.DIR_ENV: short, "PYTHONUNBUFFERED": "1"}
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return path


def launcher(script: Path, *args: str, env: dict[str, str], cwd: Path, **kw: object) -> subprocess.Popen[str]:
    proc: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
        [sys.executable, "-m", "hvd_transient.worker", str(script), *args], env=env, cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    return proc


def start_standby(script: Path, *args: str, env: dict[str, str], store: Path | None = None,
                  ready: bool = True) -> tuple[subprocess.Popen[str], Lines]:
    cmd = [sys.executable, "-m", "hvd_transient.worker", "--standby", *(["--store", str(store)] if store else []),
           str(script), *args]
    proc = subprocess.Popen(cmd, env=env, cwd=script.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    log = Lines(proc.stderr)  # type: ignore[arg-type]
    if ready:
        log.wait_for("ready for a job")
    return proc, log


def end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=TIMEOUT)


# ---- no standby: the launcher is the script ------------------------------------------------------


def test_without_a_standby_the_launcher_runs_the_script_itself(script: Path, env: dict[str, str],
                                                               tmp_path: Path) -> None:
    proc = launcher(script, "a", "--flag", env={**env, "CODE": "5"}, cwd=tmp_path)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 5, err
    assert f"name=__main__ pid={proc.pid} argv=['{script}', 'a', '--flag']" in out
    assert f"job in {proc.pid} " in out


# ---- the handoff ---------------------------------------------------------------------------------


def test_handoff_gives_the_standby_the_launchers_environment_stdio_cwd_and_takes_its_exit_status(
        script: Path, env: dict[str, str], tmp_path: Path) -> None:
    from ckpt_service.stores import LocalStore
    from hvd_transient.discovery.ready import read_ready

    store = tmp_path / "store"
    sb, _ = start_standby(script, "a", env=env, store=store)
    try:
        [record] = read_ready(LocalStore(store))  # published before it said it was ready
        assert record.host == HOST and record.pid not in (None, sb.pid)
        elsewhere = tmp_path / "job-dir"
        elsewhere.mkdir()
        proc = launcher(script, "a", env={**env, "X": "42", "MODE": "stdin", "CODE": "3"}, cwd=elsewhere,
                        stdin=subprocess.PIPE)
        out, err = proc.communicate("hello standby\n", timeout=TIMEOUT)
        assert proc.returncode == 3, err
        # the standby's worker ran the job, in the launcher's place
        assert f"job in {record.pid} X=42 cwd={elsewhere} argv=['a']" in out
        assert "read hello standby" in out and "to stderr" in err
        assert "name=__main__" not in out  # the script's start-up ran in the standby, before the job came
        assert sb.wait(timeout=TIMEOUT) == 3
        assert not list(Path(env[wire.DIR_ENV]).glob("*.sock"))  # one job per standby
    finally:
        end(sb)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_launcher_reach_the_worker_and_its_death_is_the_launchers(
        script: Path, env: dict[str, str], tmp_path: Path, sig: int) -> None:
    sb, _ = start_standby(script, env=env)
    try:
        proc = launcher(script, env={**env, "MODE": "wait"}, cwd=tmp_path)
        Lines(proc.stdout).wait_for("job in")  # type: ignore[arg-type]
        proc.send_signal(sig)
        assert proc.wait(timeout=TIMEOUT) == -sig  # as the worker ended: by the signal
        assert sb.wait(timeout=TIMEOUT) == -sig
    finally:
        end(sb)


def test_a_launcher_that_dies_takes_the_worker_with_it(script: Path, env: dict[str, str], tmp_path: Path) -> None:
    sb, log = start_standby(script, env=env)
    try:
        proc = launcher(script, env={**env, "MODE": "wait"}, cwd=tmp_path)
        Lines(proc.stdout).wait_for("job in")  # type: ignore[arg-type]
        proc.kill()  # as the driver's process-tree kill would, which the standby is not part of
        proc.wait(timeout=TIMEOUT)
        assert sb.wait(timeout=TIMEOUT) == -signal.SIGKILL
        log.wait_for("the launcher went away")
    finally:
        end(sb)


def test_a_standby_serves_only_its_own_command(script: Path, env: dict[str, str], tmp_path: Path) -> None:
    sb, _ = start_standby(script, "a", env=env)
    try:
        proc = launcher(script, "b", env=env, cwd=tmp_path)
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        assert f"job in {proc.pid} " in out  # ran here: the standby waits for another command
        assert sb.poll() is None
    finally:
        end(sb)


def test_a_standby_that_ended_before_its_job_is_not_used(script: Path, env: dict[str, str], tmp_path: Path) -> None:
    sb, log = start_standby(script, env={**env, "FAIL_EARLY": "1"}, ready=False)
    assert sb.wait(timeout=TIMEOUT) == 1
    log.wait_for("ended before any handoff")
    proc = launcher(script, env=env, cwd=tmp_path)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0 and f"job in {proc.pid} " in out, err


def test_one_standby_per_host_slot_and_command(script: Path, env: dict[str, str]) -> None:
    sb, _ = start_standby(script, env=env)
    try:
        second = subprocess.run([sys.executable, "-m", "hvd_transient.worker", "--standby", str(script)], env=env,
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert second.returncode == 2 and "another standby already waits" in second.stderr
    finally:
        end(sb)


def test_a_standby_named_as_the_machine_serves_a_launcher_horovod_knows_by_ip(
        script: Path, env: dict[str, str], tmp_path: Path) -> None:
    """A VM's startup script starts the standby without knowing that discovery lists hosts by IP
    (a multi-zone cluster): the launcher finds it under the machine's name."""
    at_boot = {k: v for k, v in env.items() if k != "HOROVOD_HOSTNAME"}
    sb, _ = start_standby(script, env=at_boot)
    try:
        assert [p.name.split(".")[0] for p in Path(env[wire.DIR_ENV]).glob("*.sock")] == \
            [socket.gethostname().split(".")[0]]
        proc = launcher(script, env={**env, "HOROVOD_HOSTNAME": "10.128.0.7"}, cwd=tmp_path)
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        assert "job in " in out and f"job in {proc.pid} " not in out and "name=__main__" not in out
        assert sb.wait(timeout=TIMEOUT) == 0
    finally:
        end(sb)


# ---- pure parts --------------------------------------------------------------------------------


def test_the_command_key_names_the_script_absolutely(tmp_path: Path) -> None:
    key = wire.command_key("tiny.py", ["--a", "1"], str(tmp_path))
    assert key == wire.command_key(str(tmp_path / "tiny.py"), ["--a", "1"], "/elsewhere")
    assert key != wire.command_key("tiny.py", ["--a", "2"], str(tmp_path))
    assert key != wire.command_key("tiny.py", ["--a", "1"], "/elsewhere")


def test_socket_paths_are_checked() -> None:
    path = wire.socket_path(Path("/tmp/d"), "127.0.1", 2, "k" * 16)
    assert path == Path(f"/tmp/d/127.0.1.2.{'k' * 16}.sock")
    with pytest.raises(wire.StandbyError, match="too long"):
        wire.socket_path(Path("/tmp/" + "d" * 100), "h", 0, "k" * 16)
    with pytest.raises(wire.StandbyError, match="invalid host"):
        wire.socket_path(Path("/tmp/d"), "a/b", 0, "k")


def test_the_socket_is_looked_for_under_each_name_of_the_host(tmp_path: Path) -> None:
    assert find_socket(tmp_path, ("10.0.0.7", "vm-1"), 0, "k") == tmp_path / "10.0.0.7.0.k.sock"
    (tmp_path / "vm-1.0.k.sock").touch()
    assert find_socket(tmp_path, ("10.0.0.7", "vm-1", "a/b"), 0, "k") == tmp_path / "vm-1.0.k.sock"
    (tmp_path / "10.0.0.7.0.k.sock").touch()
    assert find_socket(tmp_path, ("10.0.0.7", "vm-1"), 0, "k") == tmp_path / "10.0.0.7.0.k.sock"
    with pytest.raises(wire.StandbyError, match="invalid host"):
        find_socket(tmp_path, ("a/b", "vm-1"), 0, "k")


def test_handoff_checks() -> None:
    good = {"type": "handoff", "version": wire.PROTOCOL_VERSION, "key": "k", "env": {}, "cwd": "/", "fds": [0, 1, 2]}
    assert wire.check_handoff(good, "k") is None
    assert "another command" in str(wire.check_handoff(good, "other"))
    assert "protocol version" in str(wire.check_handoff({**good, "version": 99}, "k"))
    assert "file descriptors" in str(wire.check_handoff({**good, "fds": [0, 7]}, "k"))
    assert "expected a handoff" in str(wire.check_handoff({**good, "type": "signal"}, "k"))


def test_exit_status_round_trips_codes_and_signals() -> None:
    assert wire.ExitStatus.from_wait_status(3 << 8) == wire.ExitStatus(3)
    killed = wire.ExitStatus.from_wait_status(signal.SIGTERM)
    assert killed == wire.ExitStatus(128 + signal.SIGTERM, signal.SIGTERM)
    assert wire.ExitStatus.from_message(json.loads(json.dumps(killed.to_message()))) == killed


def test_deferred_horovod_answers_until_the_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Basics:
        def init(self, comm: object = None) -> None:
            calls.append(f"init {comm}")

        def shutdown(self) -> None:
            calls.append("shutdown")

        def is_initialized(self) -> bool:
            return calls[-1].startswith("init") if calls else False

        def size(self) -> int:
            return 8

        def rank(self) -> int:
            return 5

        def local_rank(self) -> int:
            return 1

    monkeypatch.setattr(standby, "_STATE", standby._Standby())  # noqa: SLF001
    standby._STATE.pending = True  # noqa: SLF001
    standby._defer_basics(Basics, {"size": 1, "rank": 0, "local_rank": 3})  # noqa: SLF001
    basics = Basics()
    assert (basics.size(), basics.rank(), basics.local_rank(), basics.is_initialized()) == (1, 0, 3, False)
    basics.init([0, 1])
    basics.shutdown()
    basics.init("comm")
    assert calls == [] and basics.is_initialized() is True
    ran: list[str] = []
    standby.after_handoff(lambda: ran.append("cold start"))
    assert ran == [] and standby.pending()
    standby._STATE.pending = False  # noqa: SLF001 - what the handoff does, then it runs the recorded init
    standby._STATE.deferred_init()  # type: ignore[misc]  # noqa: SLF001
    assert calls == ["init comm"]
    assert (basics.size(), basics.rank(), basics.local_rank(), basics.is_initialized()) == (8, 5, 1, True)
    basics.shutdown()
    assert calls[-1] == "shutdown" and basics.is_initialized() is False
    standby.after_handoff(lambda: ran.append("now"))
    assert ran == ["now"]


def test_local_cluster_in_standby_mode_runs_the_job_through_the_launcher(tmp_path: Path) -> None:
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec

    spec = LocalClusterSpec(store=str(tmp_path / "store"), hosts=("localhost",), command=("python", "train.py", "-x"),
                            workdir=tmp_path / "w", standby=True, join_timeout_s=30)
    cluster = LocalCluster(spec)
    cluster.emulator.start()  # the environment names its port
    try:
        assert cluster.job_command() == ("python", "-m", "hvd_transient.worker", "train.py", "-x")
        assert cluster.horovodrun_command()[-5:] == list(cluster.job_command())
        assert cluster.standby_command("127.0.1") == (
            "python", "-m", "hvd_transient.worker", "--standby", "--host", "127.0.1", "train.py", "-x")
        env = cluster.environment()
        assert env[wire.DIR_ENV] == str(cluster.standby_dir) and env["HVDT_JOIN_TIMEOUT_S"] == "30"
        assert "HVDT_STANDBY_SINCE" in env
        plain = LocalCluster(LocalClusterSpec(**{**spec.__dict__, "standby": False}))
        assert plain.job_command() == spec.command and plain.standby_dir is None
    finally:
        cluster.emulator.stop()
        if cluster.standby_dir is not None:
            shutil.rmtree(cluster.standby_dir, ignore_errors=True)
    with pytest.raises(ValueError, match="standby workers need an elastic cluster"):
        LocalCluster(LocalClusterSpec(**{**spec.__dict__, "elastic": False}))


def test_a_standby_under_notice_publishes_its_host_as_leaving_and_not_as_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_service.stores import LocalStore
    from hvd_transient.core.membership import read_leaving
    from hvd_transient.discovery.ready import read_ready
    from hvd_transient.join.options import StandbyOptions
    from hvd_transient.watchers.base import Notice

    now = time.time()
    notice = Notice(source="gce", instance="127.0.1", detected_at=now, deadline=now + 28.0, reason="preempted")

    class Watcher:
        instance_id = "id-7"

        def __init__(self) -> None:
            self.notice: Notice | None = None

        def stop(self) -> None:
            pass

    monkeypatch.setattr(standby, "_STATE", standby._Standby())  # noqa: SLF001
    state = standby._STATE  # noqa: SLF001
    state.pending, state.watcher = True, Watcher()
    options = StandbyOptions(script="train.py", args=(), host="127.0.1", store=str(tmp_path / "store"))
    watching = threading.Thread(target=standby._watch_until_handoff, args=(options,))  # noqa: SLF001
    watching.start()
    state.watcher.notice = notice  # during the warm-up
    watching.join(10)
    assert not watching.is_alive()
    assert standby._notice_before_ready() is notice  # noqa: SLF001 - so no ready record follows
    standby._publish_leaving(options, notice)  # noqa: SLF001 - once only
    store = LocalStore(str(tmp_path / "store"))
    [record] = read_leaving(store)
    assert (record.host, record.deadline, record.leave_at, record.instance_id) == ("127.0.1", now + 28.0, None, "id-7")
    assert read_ready(store) == []


# ---- a standby's deferred cold start (real TensorFlow and a one-process Horovod) -----------------


def test_a_standby_that_becomes_rank_0_restores_the_checkpoint_at_the_handoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the handoff says a standby's rank; as rank 0 of a ring without survivors it cold-starts then."""
    import horovod.tensorflow.keras as hvd
    import numpy as np
    import tensorflow as tf

    import hvd_transient.keras as hvdt

    hvd.init()  # a world of one: rank 0

    def model() -> tf.keras.Model:
        tf.random.set_seed(3)
        m = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2, name="out")])
        m.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    store = str(tmp_path / "store")
    x, y = np.ones((16, 3), np.float32), np.zeros(16, np.int64)
    trained = model()
    state = hvdt.elastic_state(trained, store=store)
    saver = hvdt.TransientCallback(state, store=store, save_every_steps=None, watcher="local")
    trained.fit(hvdt.elastic_dataset(state, (x, y), 4), steps_per_epoch=3, epochs=1, verbose=0, callbacks=[saver])
    assert saver.impl is not None
    saver.impl.close()

    monkeypatch.setattr(standby, "_STATE", standby._Standby())  # noqa: SLF001
    standby._STATE.pending = True  # noqa: SLF001
    fresh = model()
    state = hvdt.elastic_state(fresh, store=store)
    assert state.hvdt_restored is None and int(fresh.optimizer.iterations.numpy()) == 0  # nothing read yet
    standby._STATE.pending = False  # noqa: SLF001 - the handoff, then its callbacks
    for callback in standby._STATE.callbacks:  # noqa: SLF001
        callback()
    assert state.hvdt_restored is not None and state.hvdt_restored["step"] == 3
    assert int(fresh.optimizer.iterations.numpy()) == 3 and state.samples == 12
    assert state._saved_state["samples"] == 12  # noqa: SLF001 - what a rollback or sync would use
    assert hvdt.weights_crc(fresh) == hvdt.weights_crc(trained)


def test_the_launcher_gives_up_on_a_standby_that_never_answers(tmp_path: Path) -> None:
    path = tmp_path / "stuck.sock"
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # listens, never accepts: a stuck standby
    stuck.bind(os.fspath(path))
    stuck.listen(1)
    try:
        t0 = time.monotonic()
        assert hand_off(path, "job.py", [], env={}, cwd=str(tmp_path), accept_timeout_s=0.5) is None
        assert 0.5 <= time.monotonic() - t0 < 10
    finally:
        stuck.close()


def test_a_torch_optimizer_made_before_the_handoff_reduces_its_gradients(tmp_path: Path) -> None:
    """horovod.torch's DistributedOptimizer registers its gradient hooks only where the global process set
    includes this rank; before the real init it lists no rank, so a standby's optimizer (made by the script
    before the handoff) would train alone once it joined while the ring waited for its allreduces."""
    pytest.importorskip("horovod.torch")
    script = (
        "import os\n"
        "os.environ['HOROVOD_ELASTIC'] = '1'\n"
        "from hvd_transient.join import standby\n"
        "standby._STATE.pending = True\n"
        "standby.install_hooks(0)\n"
        "import torch, horovod.torch as hvd\n"
        "hvd.init()  # deferred\n"
        "model = torch.nn.Linear(3, 2)\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "                               named_parameters=model.named_parameters())\n"
        "print('hooks', len(opt._grad_accs), hvd.size(), hvd.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["hooks", "2", "1", "True"], out.stdout
