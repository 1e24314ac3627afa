"""Property tests of the pure save plan: coverage, determinism, balance."""
from __future__ import annotations

import heapq
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_service.errors import BadTensorNameError
from ckpt_service.plan import (
    MIN_PIECE_BYTES,
    BadTensorSpecError,
    TensorSpec,
    TensorSpecs,
    UnsupportedDtypeError,
    make_save_plan,
    plan_reads,
    spec_of,
)

DTYPES = ["float32", "float16", "int64", "uint8", "bool", "float64"]

spec_lists = st.lists(
    st.tuples(
        st.lists(st.integers(0, 70), min_size=0, max_size=3),
        st.sampled_from(DTYPES),
    ),
    min_size=1, max_size=12,
).map(lambda xs: [TensorSpec(f"t{i}/w", tuple(shape), dt) for i, (shape, dt) in enumerate(xs)])


def _assert_exact_cover(plan) -> None:
    """Per dtype group, the pieces tile [0, group size) with no gap and no overlap."""
    sizes = plan.group_sizes()
    for group in {i.group for i in plan.items} | {g for g, n in sizes.items() if n}:
        items = sorted((i for i in plan.items if i.group == group), key=lambda i: i.start)
        cursor = 0
        for item in items:
            assert item.start == cursor, f"gap or overlap in {group} at {cursor}"
            assert item.stop > item.start
            cursor = item.stop
        assert cursor == sizes.get(group, 0)


@settings(max_examples=60, deadline=None)
@given(specs=spec_lists, world=st.integers(1, 6), piece=st.sampled_from([None, 8, 64, 1000]))
def test_every_element_is_assigned_exactly_once(specs, world, piece) -> None:
    plan = make_save_plan(specs, world, piece_bytes=piece, chunk_bytes=32)
    _assert_exact_cover(plan)
    assert sum(p.spec.size for p in plan.placements) == sum(i.stop - i.start for i in plan.items)
    assert all(0 <= i.rank < world for i in plan.items)
    # placements tile each group too: tensors do not overlap each other
    for group, size in plan.group_sizes().items():
        ps = sorted((p for p in plan.placements if p.spec.dtype == group), key=lambda p: (p.offset, p.stop))
        assert all(a.stop <= b.offset for a, b in zip(ps, ps[1:])) and ps[-1].stop == size
    # pieces are whole chunks, except the last piece of a group
    for item in plan.items:
        assert item.start % item.chunk_elements == 0


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists, world=st.integers(1, 6), seed=st.integers(0, 1000))
def test_plan_does_not_depend_on_input_order(specs, world, seed) -> None:
    shuffled = list(specs)
    random.Random(seed).shuffle(shuffled)
    assert make_save_plan(specs, world) == make_save_plan(shuffled, world)


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, world=st.integers(1, 8), piece=st.sampled_from([None, 16, 256, 4096]))
def test_balance_bound(specs, world, piece) -> None:
    plan = make_save_plan(specs, world, piece_bytes=piece)
    loads = plan.bytes_per_rank()
    assert sum(loads) == plan.total_bytes
    largest_piece = max((i.nbytes for i in plan.items), default=0)
    assert largest_piece <= plan.piece_bytes or largest_piece <= max(np.dtype(d).itemsize for d in DTYPES)
    assert max(loads) <= plan.total_bytes / world + largest_piece


def _touched(plan, rank: int) -> int:
    """Tensor slices in ``rank``'s pieces (a tensor cut by two of its pieces counts twice)."""
    return sum(1 for item in plan.for_rank(rank) for p in plan.placements
               if p.spec.dtype == item.group and p.spec.size and p.offset < item.stop and item.start < p.stop)


@settings(max_examples=60, deadline=None)
@given(specs=spec_lists, world=st.integers(1, 6), piece=st.sampled_from([None, 8, 64, 1000]))
def test_each_rank_writes_the_bytes_lpt_gives_it(specs, world, piece) -> None:
    """Spreading the tensors only swaps pieces of equal size: every rank's bytes are LPT's."""
    plan = make_save_plan(specs, world, piece_bytes=piece, chunk_bytes=32)
    heap = [(0, rank) for rank in range(world)]
    for item in sorted(plan.items, key=lambda i: (-i.nbytes, i.group, i.index)):
        load, rank = heapq.heappop(heap)
        heapq.heappush(heap, (load + item.nbytes, rank))
    assert plan.bytes_per_rank() == [load for load, _ in sorted(heap, key=lambda h: h[1])]


def test_many_small_tensors_are_spread_over_the_ranks() -> None:
    # as a Keras state: the weights, then the optimizer's slots, each many small tensors (biases,
    # BN) followed by a few large ones. LPT alone gives rank 0 both dense pieces (126 vs 6 tensors).
    specs = [TensorSpec(f"{part}/{i:03d}", (16,), "float32") for part in ("model", "optimizer") for i in range(60)]
    specs += [TensorSpec(f"{part}/z{i}", (24000,), "float32") for part in ("model", "optimizer") for i in range(3)]
    plan = make_save_plan(specs, 2)
    assert [_touched(plan, r) for r in range(2)] == [66, 66]
    for world in (3, 4):
        plan = make_save_plan(specs, world)
        touched = [_touched(plan, r) for r in range(world)]
        most_in_a_piece = max(_touched_piece(plan, item) for item in plan.items)
        assert max(touched) <= sum(touched) / world + most_in_a_piece, touched


def _touched_piece(plan, item) -> int:
    return sum(1 for p in plan.placements
               if p.spec.dtype == item.group and p.spec.size and p.offset < item.stop and item.start < p.stop)


def test_default_plan_is_within_a_quarter_of_ideal_for_large_states() -> None:
    specs = [TensorSpec(f"layer{i}/kernel", (1000 + 37 * i, 256), "float32") for i in range(20)]
    specs += [TensorSpec(f"layer{i}/bias", (256,), "float32") for i in range(20)]
    for world in (2, 3, 4, 7):
        plan = make_save_plan(specs, world)
        ideal = plan.total_bytes / world
        assert max(plan.bytes_per_rank()) <= 1.25 * ideal + MIN_PIECE_BYTES


def test_tensors_for_rank_covers_all_nonempty_tensors() -> None:
    specs = [TensorSpec("a", (1000,), "float32"), TensorSpec("b", (10,), "int64"), TensorSpec("c", (0,), "float32")]
    plan = make_save_plan(specs, 3, piece_bytes=400)
    union = set().union(*(plan.tensors_for_rank(r) for r in range(3)))
    assert union == {"a", "b"}


def test_read_partition_is_disjoint_and_complete() -> None:
    plan = make_save_plan([TensorSpec(f"t{i}", (i * 10 + 1,), "float32") for i in range(9)], 1)
    parts = plan_reads(plan.placements, 4)
    names = [n for rank in range(4) for n in parts[rank]]
    assert sorted(names) == sorted(p.spec.name for p in plan.placements)


@pytest.mark.parametrize("name", ["", "/abs", "../up", "a/../b", "a\\b", "nul\x00"])
def test_escaping_names_are_rejected(name: str) -> None:
    with pytest.raises(BadTensorNameError):
        spec_of(name, np.zeros(2))


def test_object_dtype_is_rejected_with_a_clear_error() -> None:
    with pytest.raises(UnsupportedDtypeError, match="numeric"):
        spec_of("x", np.array(["a", "b"], dtype=object))


def test_duplicate_names_rejected() -> None:
    with pytest.raises(BadTensorNameError):
        make_save_plan([TensorSpec("a", (1,), "float32"), TensorSpec("a", (2,), "int64")], 1)


def test_tensor_specs_are_checked_once_and_normalised() -> None:
    specs = TensorSpecs({"a/w": TensorSpec("a/w", (2, 3), "float32"), "b": np.zeros((4,), ">i8"),
                         "c": TensorSpec("other", [5], np.dtype("<f8"))})
    assert specs["a/w"] == TensorSpec("a/w", (2, 3), "float32")
    assert specs["b"] == TensorSpec("b", (4,), "int64")  # from an array, little-endian
    assert specs["c"] == TensorSpec("c", (5,), "float64")  # renamed to its key, shape a tuple
    assert list(specs) == ["a/w", "b", "c"] and len(specs) == 3
    assert specs.specs == tuple(specs.values())


@pytest.mark.parametrize("tensors,error,match", [
    ({"../x": TensorSpec("../x", (1,), "float32")}, BadTensorNameError, "relative name"),
    ({"x": TensorSpec("x", (1,), "object")}, UnsupportedDtypeError, "only bool, integer"),
    ({"x": TensorSpec("x", (2, -1), "float32")}, BadTensorSpecError, "negative size"),
])
def test_bad_tensor_specs_are_refused_when_made(tensors, error, match) -> None:
    with pytest.raises(error, match=match):
        TensorSpecs(tensors)


def test_tensor_specs_compare_by_content_and_cannot_be_changed() -> None:
    a = TensorSpecs({"x": TensorSpec("x", (3,), "float32"), "y": np.zeros(2, np.int32)})
    b = TensorSpecs({"x": TensorSpec("x", (3,), "float32"), "y": TensorSpec("y", (2,), "int32")})
    c = TensorSpecs({"x": TensorSpec("x", (4,), "float32"), "y": TensorSpec("y", (2,), "int32")})
    assert a == b and hash(a) == hash(b) and a != c
    assert a == dict(a)  # still a Mapping to anyone comparing it with a dict
    with pytest.raises(TypeError):
        a["x"] = TensorSpec("x", (9,), "float32")  # type: ignore[index]
    with pytest.raises(AttributeError):
        a.extra = 1  # type: ignore[attr-defined]
