"""The ``file`` and ``local`` backends: hosts from a static file, a list, or a simulator state file."""
from __future__ import annotations

from pathlib import Path

from hvd_transient.discovery.errors import DiscoveryConfigError
from hvd_transient.discovery.hosts import Host, parse_host_lines, parse_host_list, parse_state_document


def read_text(path: str, what: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except FileNotFoundError:
        raise DiscoveryConfigError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DiscoveryConfigError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def file_hosts(path: str | None, default_slots: int) -> list[Host]:
    if not path:
        raise DiscoveryConfigError("the file backend needs --hosts-file PATH (or HVDT_HOSTS_FILE)")
    return parse_host_lines(read_text(path, "hosts file"), default_slots, origin=path)


def local_hosts(hosts: str | None, state_file: str | None, default_slots: int) -> list[Host]:
    """``--hosts a,b`` and/or the simulator's ``--state-file``, which it rewrites atomically.

    A state file that does not exist is an error, not "no hosts": the simulator
    creates it before starting horovodrun, so its absence means a wrong path.
    """
    if not hosts and not state_file:
        raise DiscoveryConfigError(
            "the local backend needs --hosts a,b,c or --state-file PATH (or HVDT_HOSTS / HVDT_STATE_FILE)"
        )
    result = parse_host_list(hosts, default_slots) if hosts else []
    if state_file:
        result += parse_state_document(read_text(state_file, "state file"), default_slots, origin=state_file)
    return result
