"""The workers the keeper manages: the :class:`Fleet` protocol, and :class:`ComputeFleet`, which
implements it over the Compute REST API (:class:`hvd_transient.testing.local_fleet.LocalFleet` is the
local simulator's)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

from hvd_transient.cluster.keeper_actions import Create, Outcome, Start, VMAction
from hvd_transient.cluster.rest_plan import worker_body
from hvd_transient.cluster.spec import CLUSTER_LABEL, ROLE_LABEL, WORKER, ClusterSpec
from hvd_transient.cluster.vm_failures import ERROR, QUOTA, classify_failure
from hvd_transient.cluster.worker_vms import WorkerVM, worker_from_resource

if TYPE_CHECKING:
    from hvd_transient.gcp.compute_api import ComputeAPI


class Fleet(Protocol):
    """The workers the keeper manages, wherever they run."""

    def observe(self) -> tuple[WorkerVM, ...]:
        """Every worker of the cluster now, whatever its status."""
        ...

    def apply(self, actions: Sequence[VMAction]) -> list[Outcome]:
        """Do the actions (together where possible), wait for them, one outcome each, in order."""
        ...


class ComputeFleet:
    """The cluster's workers through the Compute REST API: the VMs labelled
    ``hvdt-cluster=<name>`` and ``hvdt-role=worker``, in any zone."""

    def __init__(self, api: "ComputeAPI", spec: ClusterSpec, *, operation_timeout: float = 900.0) -> None:
        self.api, self.spec, self.operation_timeout = api, spec, operation_timeout

    def observe(self) -> tuple[WorkerVM, ...]:
        from hvd_transient.cluster.rest_plan import cluster_filter

        found = self.api.aggregated_instances(self.spec.project, filter=cluster_filter(self.spec.name))
        # the server filtered already; check again so a lenient filter never widens what is managed
        return tuple(sorted(
            (worker_from_resource(i) for i in found
             if (i.get("labels") or {}).get(CLUSTER_LABEL) == self.spec.name
             and (i.get("labels") or {}).get(ROLE_LABEL) == WORKER),
            key=lambda w: (w.zone, w.name)))

    def apply(self, actions: Sequence[VMAction]) -> list[Outcome]:
        from hvd_transient.gcp.compute_api import ComputeAPIError, ComputeConflictError

        outcomes: list[Outcome | None] = [None] * len(actions)
        pending: list[tuple[int, dict[str, Any]]] = []
        for index, action in enumerate(actions):  # send every request first: the operations overlap
            try:
                pending.append((index, self._submit(action)))
            except ComputeConflictError:  # a retried insert was applied, or another keeper made it
                outcomes[index] = Outcome(action)
            except ComputeAPIError as exc:
                _reraise_unless_capacity(exc)
                outcomes[index] = Outcome(action, str(exc), exc.reason or ERROR)
        for index, operation in pending:
            try:
                self.api.wait_operation(operation, timeout=self.operation_timeout)
                outcomes[index] = Outcome(actions[index])
            except ComputeAPIError as exc:
                outcomes[index] = Outcome(actions[index], str(exc), exc.reason or ERROR)
        return [o for o in outcomes if o is not None]

    def _submit(self, action: VMAction) -> dict[str, Any]:
        project = self.spec.project
        if isinstance(action, Create):
            return self.api.insert_instance(project, action.zone,
                                            worker_body(self.spec, action.name, action.zone, action.spot))
        if isinstance(action, Start):
            return self.api.start_instance(project, action.zone, action.name)
        return self.api.delete_instance(project, action.zone, action.name)


def _reraise_unless_capacity(exc: Exception) -> None:
    """Credentials or permissions that fail must stop the keeper (exit 2); a quota 403 must not."""
    from hvd_transient.gcp.compute_api import ComputeAuthError

    if isinstance(exc, ComputeAuthError) and classify_failure(exc.reason) != QUOTA:
        raise exc



__all__ = ["ComputeFleet", "Fleet"]
