"""Fixtures shared by the whole suite."""
from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest

# The store suite ships in the package; its asserts still get pytest's detailed messages.
pytest.register_assert_rewrite("ckpt_service.testing.store_conformance")

# Nothing in the tests may probe the real GCE metadata address.
os.environ.setdefault("NO_GCE_CHECK", "true")

# Horovod's background loop wakes every HOROVOD_CYCLE_TIME ms (default 1) and, over Gloo, talks to
# every rank even when idle: three or four ranks on a 2-core machine spend half a core in syscalls.
# A 10 ms cycle gives that CPU back to the work the end-to-end tests wait for.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "10")

# A suite started in the background by a shell without job control (`make test &`) inherits
# SIGINT ignored, and so would every process it starts; the tests that send SIGINT need its
# default action in those processes (a handler, unlike SIG_IGN, is reset by exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: the markers that make test's passes select modules by (pyproject.toml): a module marks its tests with
#: ``pytest.mark.<name>``
RUN_MARKERS = ("horovod", "mpi", "solo", "twins", "timed")


@functools.cache
def selects_unmarked(markexpr: str) -> bool:
    """Whether the ``-m`` expression selects a test that carries none of the markers (True where it cannot
    tell: pytest's own -m handling reports a bad expression)."""
    try:
        from _pytest.mark.expression import Expression

        return Expression.compile(markexpr).evaluate(lambda name, **kwargs: False)
    except Exception:
        return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A pass whose ``-m`` selects no test without those markers (the timed, end-to-end and solo passes) does not import
    the modules that mark none: each of its processes would import TensorFlow and PyTorch for them, about 5 CPU-s,
    to run none of their tests."""
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if selects_unmarked(markexpr):
        return None
    text = collection_path.read_text(errors="replace")
    return None if any(f"mark.{name}" in text for name in RUN_MARKERS) else True


#: the longest tests of a pass, in that order, started first, so that the pass's processes end together on
#: short tests rather than one of them running a long one that started last, alone: the end-to-end runs (1-2.5
#: minutes each on 2 cores), then the timed pass's (20-45 s; its processes import no framework, so their
#: start loads none of them much). The other unit tests keep their own order.
LONGEST_FIRST = (
    "test_whole_run_through_metadata_faults_leave_join_master_leave_loss_and_relaunch",
    "test_demo_with_pytorch_plays_the_same_story_and_reports",
    "test_demo_plays_the_default_story_and_reports",
    "test_the_master_then_a_worker_under_notice_train_through_their_windows_and_leave_with_nothing_rolled_back",
    "test_scale_bench_on_rings_of_2_and_4",
    "test_preemption_cost_join_both_variants",
    "test_wave_takes_every_worker_and_the_keeper_relaunches_the_run_at_the_exact_step",
    "test_goodput_bench_with_pytorch_plays_plain_horovod_elastic",
    "test_whole_cluster_notice_during_async_save_then_cold_restart",
    "test_a_worker_under_notice_trains_through_its_window_then_leaves_gracefully",
    "test_a_step_saved_again_after_its_master_was_killed_commits_one_attempt",
    "test_near_deadline_interleavings",
    "test_a_notice_after_errors_or_hangs_is_seen_within_2_s",
    "test_many_deadline_saves_under_mixed_faults",
    "test_deadline_saves_under_mixed_faults_end_in_time",
    "test_interleavings_memory_store",
    "test_found_out_fence_whose_write_on_top_fails",
)


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what this pass does not run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each of the pass's processes starts with its share of the longest tests. pytest-xdist's worksteal hands
    process k the k-th consecutive share of the collection (N // n, then the rest evenly); a process that runs
    out takes tests from the end of another's queue."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def name(item: pytest.Item) -> str:  # a test function's, or a stateful search's class (its test is runTest)
        return item.nodeid.split("::")[1].split("[")[0] if "::" in item.nodeid else item.nodeid

    longest = sorted((i for i in items if name(i) in rank), key=lambda i: rank[name(i)])
    rest = [i for i in items if name(i) not in rank]
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    order: list[pytest.Item] = []
    for k in range(workers):
        share = (len(items) - len(order)) // (workers - k)
        mine = longest[k::workers]
        order += mine + rest[:share - len(mine)]
        rest = rest[max(0, share - len(mine)):]
    items[:] = order + rest


@pytest.fixture(scope="session")
def hvd():
    """Horovod's Keras API in a world of one (this test process, rank 0), for tests that compile with it."""
    import horovod.tensorflow.keras as hvd

    hvd.init()
    return hvd


from gcs_emulator import gcs_emulator_session  # noqa: E402,F401  (session fixture for every module)
