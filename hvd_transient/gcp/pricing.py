"""What a training run cost, billed per second, and what it would have cost on demand.

The price table ships as package data (``hvd_transient/data/prices.json``): the
ICAC'19 paper's Table II and a dated snapshot of GCE list prices. List prices
change, so a user JSON file of the same layout can add or replace entries
(``load_price_table(path)`` or the ``HVDT_PRICES`` environment variable).

The paper's comparison (its Table I) is three numbers for one workload:

* the run as it happened on transient (spot) VMs, each VM billed for its lifetime;
* the same VM-seconds billed at on-demand rates;
* one on-demand VM running the whole job alone (given how long that takes).

Everything here is pure arithmetic over frozen dataclasses except
:func:`load_price_table`, which reads JSON.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence, Union

log = logging.getLogger(__name__)

PRICES_ENV = "HVDT_PRICES"
GPU_PREFIX = "gpu/"

# "n1-standard-8+nvidia-tesla-t4" or "n1-standard-8+2xnvidia-tesla-t4"
_COMPOSITE = re.compile(r"^(?P<machine>[^+]+)\+(?:(?P<count>\d+)x)?(?P<gpu>[^+]+)$")


class PriceTableError(ValueError):
    """A price file is unreadable or malformed, or an instance type has no price."""
    cli_exit_status = 2  # the command line or configuration must change


@dataclass(frozen=True)
class InstancePrice:
    name: str
    on_demand_per_hour: float
    spot_per_hour: float
    min_billed_seconds: int = 60
    source: str = ""
    description: str = ""

    def per_hour(self, spot: bool) -> float:
        return self.spot_per_hour if spot else self.on_demand_per_hour


@dataclass(frozen=True)
class PriceTable:
    entries: Mapping[str, InstancePrice]
    currency: str = "USD"
    sources: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: MappingProxyType({}))

    def price(self, instance_type: str) -> InstancePrice:
        """The price of a named entry, or of ``MACHINE+[Nx]GPU`` composed from its parts."""
        if instance_type in self.entries:
            return self.entries[instance_type]
        match = _COMPOSITE.match(instance_type)
        if match:
            machine = self.entries.get(match["machine"])
            gpu = self.entries.get(GPU_PREFIX + match["gpu"])
            if machine is not None and gpu is not None:
                count = int(match["count"] or 1)
                return InstancePrice(
                    name=instance_type,
                    on_demand_per_hour=machine.on_demand_per_hour + count * gpu.on_demand_per_hour,
                    spot_per_hour=machine.spot_per_hour + count * gpu.spot_per_hour,
                    min_billed_seconds=max(machine.min_billed_seconds, gpu.min_billed_seconds),
                    source=machine.source,
                    description=f"{machine.name} + {count} x {gpu.name}",
                )
        known = ", ".join(sorted(self.entries))
        raise PriceTableError(
            f"no price for instance type {instance_type!r}; known: {known}. "
            f"Add it to a price file given with {PRICES_ENV}=path or load_price_table(path)."
        )

    def hourly_rate(self, instance_type: str, spot: bool) -> float:
        return self.price(instance_type).per_hour(spot)


@dataclass(frozen=True)
class WorkerLifetime:
    """One VM's billed life: its type, whether it was spot, and how long it lived."""

    instance_type: str
    spot: bool
    seconds: float


LifetimeLike = Union[WorkerLifetime, Sequence[object]]


@dataclass(frozen=True)
class LineItem:
    lifetime: WorkerLifetime
    billed_seconds: int
    rate_per_hour: float
    cost: float


@dataclass(frozen=True)
class RunCost:
    items: tuple[LineItem, ...]

    @property
    def total(self) -> float:
        return sum(item.cost for item in self.items)

    @property
    def vm_seconds(self) -> int:
        return sum(item.billed_seconds for item in self.items)


@dataclass(frozen=True)
class CostComparison:
    """The paper's three-way comparison for one workload."""

    transient: RunCost  # the run as it happened
    same_on_demand: RunCost  # the same VM-seconds at on-demand rates
    single_on_demand: RunCost  # one on-demand VM doing the whole job
    run_seconds: float | None  # wall time of the transient run, if known
    single_seconds: float  # wall time of the single-VM baseline

    @property
    def savings_vs_same_on_demand(self) -> float:
        """Fraction saved by running on spot instead of on demand (0.629 = 62.9 %)."""
        return _savings(self.transient.total, self.same_on_demand.total)

    @property
    def savings_vs_single_on_demand(self) -> float:
        return _savings(self.transient.total, self.single_on_demand.total)

    @property
    def speedup_vs_single(self) -> float | None:
        if not self.run_seconds:
            return None
        return self.single_seconds / self.run_seconds


def _savings(cost: float, reference: float) -> float:
    return 1.0 - cost / reference if reference > 0 else 0.0


def billed_seconds(seconds: float, min_billed_seconds: int) -> int:
    """Per-second billing: whole seconds rounded up, with the provider's minimum."""
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"a VM lifetime cannot be {seconds!r} seconds")
    if seconds == 0:
        return 0
    return max(math.ceil(seconds), min_billed_seconds)


def as_lifetime(value: LifetimeLike) -> WorkerLifetime:
    if isinstance(value, WorkerLifetime):
        return value
    try:
        instance_type, spot, seconds = value
    except (TypeError, ValueError):
        raise ValueError(
            f"a lifetime is (instance_type, spot, seconds) or a WorkerLifetime, not {value!r}"
        ) from None
    return WorkerLifetime(str(instance_type), bool(spot), float(seconds))  # type: ignore[arg-type]


def run_cost(lifetimes: Iterable[LifetimeLike], table: PriceTable) -> RunCost:
    items = []
    for lifetime in map(as_lifetime, lifetimes):
        price = table.price(lifetime.instance_type)
        billed = billed_seconds(lifetime.seconds, price.min_billed_seconds)
        rate = price.per_hour(lifetime.spot)
        items.append(LineItem(lifetime, billed, rate, rate * billed / 3600.0))
    return RunCost(tuple(items))


def compare_costs(
    lifetimes: Iterable[LifetimeLike],
    table: PriceTable,
    *,
    single_instance_type: str,
    single_seconds: float,
    run_seconds: float | None = None,
) -> CostComparison:
    """This run on transient VMs vs the same VM-seconds on demand vs one on-demand VM.

    ``lifetimes`` lists every VM of the run, the on-demand driver included
    (``spot=False``); ``single_seconds`` is how long the job takes on one
    on-demand ``single_instance_type`` VM (measured, or the paper's figure).
    """
    actual = [as_lifetime(x) for x in lifetimes]
    on_demand = [WorkerLifetime(x.instance_type, False, x.seconds) for x in actual]
    single = [WorkerLifetime(single_instance_type, False, single_seconds)]
    return CostComparison(
        transient=run_cost(actual, table),
        same_on_demand=run_cost(on_demand, table),
        single_on_demand=run_cost(single, table),
        run_seconds=run_seconds,
        single_seconds=single_seconds,
    )


def instance_type_key(machine_type: str, gpu_type: str | None = None, gpu_count: int = 0) -> str:
    """The price-table name of a VM shape: ``n1-standard-8+nvidia-tesla-t4`` and the like."""
    if not gpu_type or gpu_count <= 0:
        return machine_type
    return f"{machine_type}+{gpu_type}" if gpu_count == 1 else f"{machine_type}+{gpu_count}x{gpu_type}"


# ---- loading ------------------------------------------------------------------------------


def parse_price_document(doc: object, *, origin: str) -> PriceTable:
    """Validate one prices.json document (pure)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("instance_types"), dict):
        raise PriceTableError(f"{origin}: expected a JSON object with an 'instance_types' object")
    entries: dict[str, InstancePrice] = {}
    for name, raw in doc["instance_types"].items():
        if not isinstance(raw, dict):
            raise PriceTableError(f"{origin}: instance type {name!r} must be an object")
        try:
            price = InstancePrice(
                name=name,
                on_demand_per_hour=float(raw["on_demand_per_hour"]),
                spot_per_hour=float(raw["spot_per_hour"]),
                min_billed_seconds=int(raw.get("min_billed_seconds", 60)),
                source=str(raw.get("source", "")),
                description=str(raw.get("description", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PriceTableError(
                f"{origin}: instance type {name!r} needs numeric on_demand_per_hour and "
                f"spot_per_hour ({exc})"
            ) from None
        if min(price.on_demand_per_hour, price.spot_per_hour, price.min_billed_seconds) < 0:
            raise PriceTableError(f"{origin}: instance type {name!r} has a negative price or minimum")
        entries[name] = price
    sources = doc.get("sources", {})
    return PriceTable(
        entries=MappingProxyType(entries),
        currency=str(doc.get("currency", "USD")),
        sources=MappingProxyType(dict(sources) if isinstance(sources, dict) else {}),
    )


def merge_tables(base: PriceTable, override: PriceTable) -> PriceTable:
    if override.currency != base.currency:
        raise PriceTableError(
            f"price files disagree on currency ({base.currency} vs {override.currency}); use one currency"
        )
    return PriceTable(
        entries=MappingProxyType({**base.entries, **override.entries}),
        currency=base.currency,
        sources=MappingProxyType({**base.sources, **override.sources}),
    )


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise PriceTableError(f"cannot read price file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PriceTableError(f"price file {path} is not valid JSON: {exc}") from None


def load_price_table(path: str | os.PathLike[str] | None = None) -> PriceTable:
    """The packaged table, overridden by ``path`` (or ``$HVDT_PRICES``) when given."""
    packaged = resources.files("hvd_transient").joinpath("data/prices.json").read_text()
    table = parse_price_document(json.loads(packaged), origin="hvd_transient/data/prices.json")
    user = path if path is not None else os.environ.get(PRICES_ENV) or None
    if user is not None:
        user_path = Path(user).expanduser()
        table = merge_tables(table, parse_price_document(_read_json(user_path), origin=str(user_path)))
        log.debug("price table: %s overrides the packaged prices", user_path)
    return table
