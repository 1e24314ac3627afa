"""The data position of the frontends' shared layer: the global sample stream (pure) and the cursor."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_transient.frontend.position import DataPosition
from hvd_transient.frontend.stream import pass_order, rank_batches


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_samples=st.integers(1, 40), batch=st.integers(1, 9),
       sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12)), min_size=1, max_size=5))
def test_the_stream_uses_each_sample_once_per_pass_whatever_the_ring_sizes(
        num_samples: int, batch: int, sizes: list[tuple[int, int]]) -> None:
    """Rings of several sizes, each resuming at the offset the previous one reached."""
    offset, taken = 0, []
    for size, steps in sizes:
        streams = [rank_batches(num_samples, batch, offset=offset, rank=r, size=size) for r in range(size)]
        for _ in range(steps):
            for s in streams:
                taken.extend(next(s).tolist())
        offset += steps * size * batch
    expected = np.concatenate([pass_order(num_samples, k) for k in range(len(taken) // num_samples + 1)])
    assert taken == expected[:len(taken)].tolist()


def test_the_stream_refuses_a_bad_position() -> None:
    with pytest.raises(ValueError):
        next(rank_batches(10, 2, offset=-1, rank=0, size=1))
    with pytest.raises(ValueError):
        next(rank_batches(10, 2, offset=0, rank=2, size=2))


def test_the_position_follows_the_ring_it_began_on() -> None:
    position = DataPosition()
    assert position.samples_at(5) is None
    position.track(3 * 8)
    position.begin(10, 400)
    assert position.samples_at(12) == 448 and position.samples_at(9) is None
