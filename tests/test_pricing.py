"""Per-second cost arithmetic and the paper's transient vs on-demand comparison."""
from __future__ import annotations

import json

import pytest

from hvd_transient.gcp.pricing import (
    PriceTableError,
    WorkerLifetime,
    billed_seconds,
    compare_costs,
    instance_type_key,
    load_price_table,
    run_cost,
)

HOUR = 3600.0


@pytest.fixture
def table():
    return load_price_table()


def test_packaged_table_carries_the_papers_table_ii(table):
    expected = {  # ICAC'19 Table II: (on-demand, transient) $/hour
        "icac19/K80": (0.723, 0.256),
        "icac19/P100": (1.43, 0.551),
        "icac19/V100": (2.144, 0.861),
        "icac19/PS": (0.143, 0.041),
    }
    for name, (on_demand, transient) in expected.items():
        price = table.price(name)
        assert (price.on_demand_per_hour, price.spot_per_hour) == (on_demand, transient)
        assert price.min_billed_seconds == 0  # the paper billed pure per-second


def test_packaged_file_is_dated_and_says_prices_change():
    from importlib import resources

    doc = json.loads(resources.files("hvd_transient").joinpath("data/prices.json").read_text())
    assert all(source.get("as_of") for source in doc["sources"].values())
    assert any("change" in note for note in doc["notes"])
    assert any("replaces" in note for note in doc["notes"])


def test_gpu_vm_is_priced_as_machine_plus_gpus(table):
    machine, gpu = table.price("n1-standard-8"), table.price("gpu/nvidia-tesla-t4")
    one = table.price("n1-standard-8+nvidia-tesla-t4")
    two = table.price(instance_type_key("n1-standard-8", "nvidia-tesla-t4", 2))
    assert one.spot_per_hour == pytest.approx(machine.spot_per_hour + gpu.spot_per_hour)
    assert two.on_demand_per_hour == pytest.approx(machine.on_demand_per_hour + 2 * gpu.on_demand_per_hour)
    # spot must actually be cheaper for every shipped GCE shape
    for name in ("n1-standard-8+nvidia-tesla-t4", "n1-standard-8+nvidia-tesla-v100", "g2-standard-8"):
        price = table.price(name)
        assert 0 < price.spot_per_hour < price.on_demand_per_hour


def test_unknown_instance_type_names_the_known_ones(table):
    with pytest.raises(PriceTableError, match="no price for instance type 'x9-huge'.*icac19/K80"):
        table.price("x9-huge")
    with pytest.raises(PriceTableError):
        table.price("n1-standard-8+nvidia-unknown")


@pytest.mark.parametrize(
    "seconds, minimum, expected",
    [(0, 60, 0), (1, 60, 60), (59.2, 60, 60), (3600.2, 60, 3601), (3601, 0, 3601), (0.4, 0, 1)],
)
def test_billed_seconds_rounds_up_with_minimum(seconds, minimum, expected):
    assert billed_seconds(seconds, minimum) == expected


def test_billed_seconds_rejects_negative():
    with pytest.raises(ValueError):
        billed_seconds(-1, 60)


def test_run_cost_sums_per_vm_lifetimes(table):
    cost = run_cost(
        [("icac19/K80", True, HOUR), WorkerLifetime("icac19/K80", True, HOUR / 2), ("icac19/PS", False, HOUR)],
        table,
    )
    assert cost.total == pytest.approx(0.256 + 0.128 + 0.143)
    assert cost.vm_seconds == int(2.5 * HOUR)
    assert [item.rate_per_hour for item in cost.items] == [0.256, 0.256, 0.143]


def test_run_cost_rejects_malformed_lifetime(table):
    with pytest.raises(ValueError, match="instance_type, spot, seconds"):
        run_cost([("icac19/K80", True)], table)


def test_reproduces_papers_table_i(table):
    """Table I: 1 K80 on demand 3.91 h = $2.83; 4 K80 transient (r=0) 0.98 h = $1.04.

    The paper's 4-K80 totals come out when its PS is billed at the Table II
    transient rate ($0.041/h), so that is how the PS is listed here.
    """
    run_hours = 0.98
    lifetimes = [("icac19/K80", True, run_hours * HOUR)] * 4 + [("icac19/PS", True, run_hours * HOUR)]
    result = compare_costs(
        lifetimes, table, single_instance_type="icac19/K80", single_seconds=3.91 * HOUR,
        run_seconds=run_hours * HOUR,
    )
    assert result.single_on_demand.total == pytest.approx(2.83, abs=0.005)
    assert result.transient.total == pytest.approx(1.04, abs=0.01)
    assert result.speedup_vs_single == pytest.approx(3.91 / 0.98)
    assert 0.62 < result.savings_vs_single_on_demand < 0.64  # the paper's "62.9 % savings" headline
    # the same VM-seconds on demand: K80s at 0.723, the PS at 0.143
    assert result.same_on_demand.total == pytest.approx(run_hours * (4 * 0.723 + 0.143))
    assert result.savings_vs_same_on_demand == pytest.approx(
        1 - result.transient.total / result.same_on_demand.total
    )


def test_revoked_worker_is_billed_only_until_revocation(table):
    full, revoked = 3600.0, 1200.0
    result = compare_costs(
        [("n1-standard-8+nvidia-tesla-t4", True, full), ("n1-standard-8+nvidia-tesla-t4", True, revoked),
         ("n1-standard-4", False, full)],
        table, single_instance_type="n1-standard-8+nvidia-tesla-t4", single_seconds=2 * full,
    )
    worker = table.price("n1-standard-8+nvidia-tesla-t4")
    driver = table.price("n1-standard-4")
    assert result.transient.total == pytest.approx(
        worker.spot_per_hour * (full + revoked) / 3600 + driver.on_demand_per_hour
    )
    # the on-demand driver costs the same in both columns
    assert result.same_on_demand.items[2].cost == result.transient.items[2].cost
    assert result.speedup_vs_single is None


def test_user_file_overrides_and_extends(tmp_path, monkeypatch, table):
    user = tmp_path / "prices.json"
    user.write_text(json.dumps({
        "currency": "USD",
        "instance_types": {
            "gpu/nvidia-tesla-t4": {"on_demand_per_hour": 0.5, "spot_per_hour": 0.1},
            "my-shape": {"on_demand_per_hour": 1.0, "spot_per_hour": 0.3, "min_billed_seconds": 0},
        },
    }))
    merged = load_price_table(user)
    assert merged.price("gpu/nvidia-tesla-t4").spot_per_hour == 0.1
    assert merged.price("my-shape").min_billed_seconds == 0
    assert merged.price("icac19/K80") == table.price("icac19/K80")  # untouched entries stay
    composite = merged.price("n1-standard-8+nvidia-tesla-t4")
    assert composite.spot_per_hour == pytest.approx(table.price("n1-standard-8").spot_per_hour + 0.1)
    monkeypatch.setenv("HVDT_PRICES", str(user))
    assert load_price_table().price("my-shape").on_demand_per_hour == 1.0


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"instance_types": {"a": {"spot_per_hour": 1}}}), "needs numeric"),
        (json.dumps({"instance_types": {"a": {"on_demand_per_hour": -1, "spot_per_hour": 1}}}), "negative"),
        (json.dumps({"currency": "EUR", "instance_types": {}}), "currency"),
        (json.dumps([1, 2]), "instance_types"),
    ],
)
def test_bad_user_file_is_a_clear_error(tmp_path, content, message):
    user = tmp_path / "prices.json"
    user.write_text(content)
    with pytest.raises(PriceTableError, match=message):
        load_price_table(user)


def test_missing_user_file_is_a_clear_error(tmp_path):
    with pytest.raises(PriceTableError, match="cannot read price file"):
        load_price_table(tmp_path / "absent.json")
