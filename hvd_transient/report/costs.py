"""The run's cost, billed per second: transient VMs vs on demand vs one on-demand VM (pure).

Each worker process is billed as one spot VM of ``instance_type`` for its
lifetime in the log (first to last event: the VM's boot and shutdown are not in
the log, so this is a lower bound). The single-VM baseline follows the ICAC'19
paper's comparison: one on-demand VM does the same work alone in the sum of the
workers' seconds (perfect data-parallel scaling; see :data:`SINGLE_VM_ASSUMPTION`).
"""
from __future__ import annotations

from dataclasses import dataclass

from hvd_transient.gcp.pricing import CostComparison, PriceTable, WorkerLifetime, compare_costs
from hvd_transient.report.run_analysis import RunAnalysis

#: The GPU VM priced when none is named (an N1 VM with one T4, GCE us-central1 list prices).
DEFAULT_INSTANCE_TYPE = "n1-standard-8+nvidia-tesla-t4"

SINGLE_VM_ASSUMPTION = (
    "single on-demand VM time = sum of the workers' seconds (perfect scaling: one VM does the "
    "work of N in N times as long, as in the ICAC'19 comparison)")


@dataclass(frozen=True)
class CostEstimate:
    instance_type: str
    driver_instance_type: str | None
    comparison: CostComparison
    worker_seconds: float
    single_seconds: float
    currency: str
    assumption: str = SINGLE_VM_ASSUMPTION

    @property
    def transient_usd(self) -> float:
        return self.comparison.transient.total

    @property
    def on_demand_usd(self) -> float:
        return self.comparison.same_on_demand.total

    @property
    def single_on_demand_usd(self) -> float:
        return self.comparison.single_on_demand.total


def estimate_costs(analysis: RunAnalysis, table: PriceTable, instance_type: str = DEFAULT_INSTANCE_TYPE,
                   driver_instance_type: str | None = None) -> CostEstimate:
    """Price the run. ``driver_instance_type``: an on-demand driver VM billed for the wall time."""
    table.price(instance_type)  # an unknown name fails here, with the list of known ones
    lifetimes = [WorkerLifetime(instance_type, True, w.seconds) for w in analysis.workers]
    if driver_instance_type:
        lifetimes.append(WorkerLifetime(driver_instance_type, False, analysis.wall_s))
    single_seconds = analysis.worker_seconds
    comparison = compare_costs(lifetimes, table, single_instance_type=instance_type,
                               single_seconds=single_seconds, run_seconds=analysis.wall_s or None)
    return CostEstimate(instance_type=instance_type, driver_instance_type=driver_instance_type,
                        comparison=comparison, worker_seconds=analysis.worker_seconds,
                        single_seconds=single_seconds, currency=table.currency)


__all__ = ["CostEstimate", "DEFAULT_INSTANCE_TYPE", "SINGLE_VM_ASSUMPTION", "estimate_costs"]
