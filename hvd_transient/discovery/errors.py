"""Typed errors of host discovery; the command maps them to exit statuses."""
from __future__ import annotations


class DiscoveryError(Exception):
    """Hosts could not be determined (exit status 1: Horovod keeps its current hosts)."""
    cli_exit_status = 1  # the command ran and failed


class DiscoveryConfigError(DiscoveryError, ValueError):
    """The discovery command is misconfigured (exit status 2: fix the arguments)."""
    cli_exit_status = 2  # the command line or configuration must change
