"""The step counted between exact reads (pure): exact wherever the protocol does more than the plain
path, and read at every batch once a count differs from the optimizer's step."""
from __future__ import annotations

from hvd_transient.frontend.step_counter import StepCounter


class Optimizer:
    def __init__(self, per_batch: int = 1) -> None:
        self.step, self.per_batch, self.reads = 0, per_batch, 0

    def train(self) -> None:
        self.step += self.per_batch

    def read(self) -> int:
        self.reads += 1
        return self.step


def run(opt: Optimizer, counter: StepCounter, batches: int, start_batch: int = 0) -> list[int]:
    seen = []
    for batch in range(start_batch, start_batch + batches):
        opt.train()
        seen.append(counter.at(batch))
    return seen


def test_counts_plain_steps_and_reads_where_the_protocol_acts() -> None:
    opt = Optimizer()
    due = {10, 20, 30}
    counter = StepCounter(opt.read, lambda step: step not in due)
    assert run(opt, counter, 30) == list(range(1, 31))
    assert opt.reads == 1 + len(due)  # the first batch, then each step at which the protocol acts
    counter.reset()  # a new epoch: batches count from 0 again
    assert run(opt, counter, 5) == list(range(31, 36)) and opt.reads == 5
    assert counter.counts


def test_a_step_that_is_not_one_per_batch_is_read_at_every_batch_from_then_on() -> None:
    """An optimizer that steps twice per batch: the count lags, the first exact read (the next due step
    by the count) shows it, and from then on every batch is read."""
    opt = Optimizer(per_batch=2)
    counter = StepCounter(opt.read, lambda step: step % 10 != 0)
    # counted 3..9 after the first read, then the count says 10 (due): read, 18, and read from then on
    assert run(opt, counter, 12) == [2, 3, 4, 5, 6, 7, 8, 9, 18, 20, 22, 24]
    assert not counter.counts
    assert run(opt, counter, 3, start_batch=12) == [26, 28, 30] and opt.reads == 2 + 3 + 3


def test_a_skipped_step_moves_the_count_back_at_the_next_exact_read() -> None:
    """An optimizer step skipped (a train step that did not apply): the count runs ahead, reads early (never
    late), and sees the lag."""
    opt = Optimizer()
    counter = StepCounter(opt.read, lambda step: step % 10 != 0)
    run(opt, counter, 4)
    opt.step -= 1  # one step skipped
    assert run(opt, counter, 8, start_batch=4) == [5, 6, 7, 8, 9, 10, 11, 12][:5] + [9, 10, 11]
    assert not counter.counts
