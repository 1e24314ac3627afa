"""Host discovery for elastic ``horovodrun --host-discovery-script ... --min-np N --max-np M``.

Horovod runs the discovery script about once a second and reads ``host:slots``
lines from its standard output. ``hvd-transient discover`` prints them from one
of three backends (``gce``, ``file``, ``local``) and drops every host the run's
store lists as leaving (:func:`hvd_transient.core.membership.leaving_hosts`), which
is what turns a preemption notice into Horovod's graceful shrink. A record with a
``leave_at`` drops its host only from then on: the VM trains through its notice window.

Exit status is part of the contract: empty output with status 0 means "no host
is available right now"; a non-zero status means "could not tell". Horovod
treats a failing first call as fatal (a misconfiguration) and later failures as
transient (it keeps the hosts it had), so an unreachable API must never be
reported as an empty host list.

With ``--standby-since`` (``HVDT_STANDBY_SINCE``), a VM that boots while the job
runs is listed only once its pre-warmed standby worker is ready, or after
``--join-timeout`` (:mod:`.ready`), so a join no longer stalls the ring for the
newcomer's start-up (:mod:`hvd_transient.join.worker`).

Modules: :mod:`.hosts` (parse, filter, format - pure), :mod:`.gce` (Compute
Engine instances to hosts), :mod:`.sources` (file and local backends),
:mod:`.leaving` (store records read cheaply), :mod:`.ready` (the join gate),
:mod:`.cli` (the command).
"""
