"""GCE facts that the notice watcher, the cluster's instance bodies and the local cluster share."""
from __future__ import annotations

#: the length of GCE's preemption notice for Spot VMs, unless an instance asks for another
GCE_NOTICE_WINDOW_S = 30.0

#: the instance metadata attribute by which a VM learns its own notice length (the cluster sets it
#: from ``preemptionNoticeDuration``; the metadata server does not expose that field)
NOTICE_ATTRIBUTE = "hvdt-preemption-notice-s"
