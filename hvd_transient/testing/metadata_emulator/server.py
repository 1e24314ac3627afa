"""``MetadataEmulator``: a real HTTP metadata server for several virtual instances at once.

Usage::

    with MetadataEmulator(instances=["a", "b"], port=0) as emu:
        os.environ["GCE_METADATA_HOST"] = emu.metadata_host("a")   # 127.0.0.1:PORT/i/a
        emu.preempt("a", delay=1.0, window=30.0, kill_pid=worker.pid)
        emu.set_fault("b", "hang")                      # until set_fault("b", "ok")
        emu.set_fault("a", "503", duration=25.0)        # 25 s of 503s on every API of a
        emu.set_fault("a", "trickle", trickle_s=0.5)    # replies a byte every 0.5 s
        emu.preempt("b", ago=15.0)                      # a notice that came 15 s ago
        emu.set_vm_name("a", "spot-vm-7")               # the VM's own name, not the host's
        emu.start_azure_event("a")                      # Azure: EventStatus Started, no NotBefore

Every control method also exists over HTTP under ``/control/`` (see handler.py),
so processes that did not start the emulator can drive it.

A path without the ``/i/<name>`` prefix is answered by the default instance:
``default_instance`` if given, else the first of ``instances`` (``default`` in
``GET /control/instances``); the Host header never selects one.
"""
from __future__ import annotations

import logging
import threading
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping

from .handler import MetadataRequestHandler
from .model import DEFAULT_WINDOW_S, Fault, InstanceSnapshot
from .registry import Registry

log = logging.getLogger(__name__)

DEFAULT_INSTANCES = ("instance-1",)


class _EmulatorHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog of 5 drops connections when many clients poll at once (each
    # lost or hung request holds one); a dropped SYN costs a client a 1 s retransmission
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], registry: Registry) -> None:
        self.registry = registry
        super().__init__(address, MetadataRequestHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that time out on a hung request close their socket; writing the
        # late reply then fails. That is expected, not worth a traceback on stderr.
        log.debug("request from %s failed", client_address, exc_info=True)


class MetadataEmulator:
    """GCE metadata server, AWS IMDSv2 and Azure Scheduled Events for named instances.

    ``start()`` binds (``port=0`` picks a free port, see ``.port``) and serves on
    background threads; ``stop()`` releases hung and long-polling requests and
    joins every thread. Thread-safe.
    """

    def __init__(self, instances: Iterable[str] = DEFAULT_INSTANCES, port: int = 0,
                 host: str = "127.0.0.1", default_instance: str | None = None) -> None:
        self.registry = Registry(instances, default=default_instance)
        self._address = (host, port)
        self._server: _EmulatorHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> "MetadataEmulator":
        if self._server is not None:
            return self
        self.registry.reopen()
        self._server = _EmulatorHTTPServer(self._address, self.registry)
        self._threads = [
            threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                             name="metadata-emulator-http", daemon=True),
            threading.Thread(target=self.registry.run_scheduler,
                             name="metadata-emulator-scheduler", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("metadata emulator serving %s on %s", ", ".join(self.registry.snapshots()), self.url)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self.registry.stop()
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
        self._server = None
        log.info("metadata emulator stopped")

    def __enter__(self) -> "MetadataEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- addresses ----------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the emulator is not running: call start() (or use it as a context manager)")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def root_url(self, instance: str | None = None) -> str:
        """Where an instance's metadata APIs live; append ``/computeMetadata/v1/``,
        ``/latest/...`` or ``/metadata/...``. None: the default instance's plain root."""
        return self.url if instance is None else f"{self.url}/i/{instance}"

    def metadata_host(self, instance: str | None = None) -> str:
        """The value for ``GCE_METADATA_HOST`` (host[:port][/path], no scheme)."""
        return self.root_url(instance).split("://", 1)[1]

    def gce_base_url(self, instance: str | None = None) -> str:
        return f"{self.root_url(instance)}/computeMetadata/v1/"

    # ---- control (the same as /control/ over HTTP) -----------------------------------------
    def add_instance(self, name: str, *, hostname: str | None = None, zone: str | None = None,
                     project_id: str | None = None, vm_name: str | None = None) -> InstanceSnapshot:
        return self.registry.add(name, hostname=hostname, zone=zone, project_id=project_id, vm_name=vm_name)

    def preempt(self, instance: str, *, at: float | None = None, delay: float | None = None,
                ago: float | None = None, window: float = DEFAULT_WINDOW_S, kill_pid: int | None = None,
                kill_signal: int | str | None = None, aws_time_format: str = "iso8601") -> InstanceSnapshot:
        """A notice at ``at`` (epoch), after ``delay`` seconds, now, or one that came ``ago``
        seconds before now; ``aws_time_format``: how AWS writes its ``time`` (``AWS_TIME_FORMATS``)."""
        return self.registry.preempt(instance, at=at, delay=delay, ago=ago, window=window,
                                     kill_pid=kill_pid, kill_signal=kill_signal,
                                     aws_time_format=aws_time_format)

    def set_vm_name(self, instance: str, vm_name: str) -> InstanceSnapshot:
        """The VM's own name (GCE ``instance/name``, Azure ``compute/name`` and event
        ``Resources``), apart from ``instance``, its host name."""
        return self.registry.set_vm_name(instance, vm_name)

    def start_azure_event(self, instance: str) -> InstanceSnapshot:
        """Azure: the eviction event starts now (``EventStatus: Started``, blank ``NotBefore``)."""
        return self.registry.start_azure_event(instance)

    def set_attribute(self, instance: str, key: str, value: str) -> InstanceSnapshot:
        return self.registry.set_attribute(instance, key, value)

    def recommend_rebalance(self, instance: str) -> InstanceSnapshot:
        return self.registry.recommend_rebalance(instance)

    def set_maintenance(self, instance: str, event: str) -> InstanceSnapshot:
        return self.registry.set_maintenance(instance, event)

    def set_fault(self, instance: str, mode: str | Fault, *, duration: float | None = None,
                  trickle_s: float | None = None) -> InstanceSnapshot:
        """Make every metadata reply of ``instance`` fail as ``mode`` says (``Fault``: ``hang``,
        ``lose``, ``500``, ``503``, ``garbage``, ``trickle``; ``ok`` clears it), until cleared or,
        with ``duration``, for that many seconds from now; ``trickle_s``: seconds between two
        bytes of a trickled reply (0.5 unless set)."""
        return self.registry.set_fault(instance, mode, duration=duration, trickle_s=trickle_s)

    def reset(self, instance: str) -> InstanceSnapshot:
        return self.registry.reset(instance)

    def instance(self, name: str) -> InstanceSnapshot:
        return self.registry.snapshot(name)

    def state(self) -> dict[str, InstanceSnapshot]:
        return self.registry.snapshots()

    def wait_for(self, predicate: Callable[[Mapping[str, InstanceSnapshot]], bool],
                 timeout: float | None = None) -> bool:
        """Block until ``predicate(state)`` holds (re-checked on every state change or request)."""
        return self.registry.wait_for(predicate, timeout)
