"""Which watcher fits this machine: ``choose_kind`` (pure) and ``make_watcher``.

Auto-detection reads only the environment and DMI files under
/sys/class/dmi/id; it never probes the network (a probe to a link-local
address can hang for seconds on a machine that has no metadata server).
"""
from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from .aws import ENDPOINT_ENV as AWS_ENDPOINT_ENV
from .aws import AwsWatcher
from .azure import ENDPOINT_ENV as AZURE_ENDPOINT_ENV
from .azure import AzureWatcher
from .base import Watcher
from .errors import WatcherConfigError
from .gce import GceWatcher, gce_base_url
from .local import NOTICE_FILE_ENV, LocalWatcher

log = logging.getLogger(__name__)

KIND_ENV = "HVDT_WATCHER"
WATCHERS: dict[str, type[Watcher]] = {
    "gce": GceWatcher, "aws": AwsWatcher, "azure": AzureWatcher, "local": LocalWatcher,
}
DMI_DIR = "/sys/class/dmi/id"
DMI_FIELDS = ("sys_vendor", "product_name", "bios_vendor", "bios_version", "chassis_asset_tag")
# Every Azure VM carries this chassis asset tag.
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


def choose_kind(env: Mapping[str, str], dmi: Mapping[str, str]) -> str:
    """Pick ``gce``, ``aws``, ``azure`` or ``local`` from environment and DMI strings.

    Order: ``HVDT_WATCHER`` (if not ``auto``), then an explicit metadata endpoint in
    the environment (``GCE_METADATA_HOST``, ``AWS_EC2_METADATA_SERVICE_ENDPOINT``,
    ``HVDT_AZURE_METADATA_ENDPOINT``), then DMI vendor strings, else ``local``.
    """
    forced = (env.get(KIND_ENV) or "").strip().lower()
    if forced and forced != "auto":
        if forced not in WATCHERS:
            raise WatcherConfigError(f"{KIND_ENV}={forced!r} is not a watcher kind: "
                                     f"use one of auto, {', '.join(WATCHERS)}")
        return forced
    if env.get("GCE_METADATA_HOST"):
        return "gce"
    if env.get(AWS_ENDPOINT_ENV):
        return "aws"
    if env.get(AZURE_ENDPOINT_ENV):
        return "azure"
    field = {k: (dmi.get(k) or "").strip().lower() for k in DMI_FIELDS}
    if "google" in field["product_name"] or field["sys_vendor"] == "google":
        return "gce"
    if "amazon" in field["sys_vendor"] or "amazon" in field["bios_vendor"] \
            or "amazon" in field["bios_version"]:
        return "aws"
    if field["chassis_asset_tag"] == AZURE_ASSET_TAG:
        return "azure"
    # Without a readable asset tag, Hyper-V's strings are the best hint left.
    if "chassis_asset_tag" not in dmi and field["sys_vendor"] == "microsoft corporation" \
            and field["product_name"] == "virtual machine":
        return "azure"
    return "local"


def read_dmi(root: str | os.PathLike[str] = DMI_DIR) -> dict[str, str]:
    """The DMI strings ``choose_kind`` looks at (missing or unreadable ones are left out)."""
    found = {}
    for name in DMI_FIELDS:
        try:
            found[name] = (Path(root) / name).read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue
    return found


def make_watcher(kind: str = "auto", *, env: Mapping[str, str] | None = None,
                 dmi: Mapping[str, str] | None = None, **opts: Any) -> Watcher:
    """A watcher of ``kind`` (or the one ``choose_kind`` picks for ``auto``), not yet started.

    ``opts`` go to the watcher's constructor; with ``auto`` the caller cannot know
    which class it gets, so options that class does not take are dropped (logged).
    """
    env = os.environ if env is None else env
    kind = (kind or "auto").lower()
    if kind == "auto":
        kind = choose_kind(env, read_dmi() if dmi is None else dmi)
        log.info("preemption watcher: %s (auto-detected)", kind)
    if kind not in WATCHERS:
        raise WatcherConfigError(f"unknown watcher kind {kind!r}: use one of auto, {', '.join(WATCHERS)}")
    cls = WATCHERS[kind]
    # The watchers read these variables themselves from os.environ; resolve them from
    # ``env`` here so the choice and the endpoint always come from the same place.
    where = {"gce": ("base_url", gce_base_url(None, env) if env.get("GCE_METADATA_HOST") else None),
             "aws": ("endpoint", env.get(AWS_ENDPOINT_ENV)),
             "azure": ("endpoint", env.get(AZURE_ENDPOINT_ENV)),
             "local": ("path", env.get(NOTICE_FILE_ENV))}[kind]
    if where[1] and opts.get(where[0]) is None:
        opts[where[0]] = where[1]
    accepted = inspect.signature(cls.__init__).parameters
    dropped = sorted(set(opts) - set(accepted))
    if dropped:
        log.debug("%s watcher ignores options %s", kind, ", ".join(dropped))
    return cls(**{k: v for k, v in opts.items() if k in accepted})
