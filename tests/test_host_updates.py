"""Every reset syncs the state: Horovod's 'removals only, skip the sync' cannot see a host the driver
adds in the same reset (the end-to-end case: tests/test_torch_elastic_e2e.py)."""
from __future__ import annotations

import pytest

from hvd_transient.frontend.host_updates import check_host_updates_and_sync


class HostsUpdated(RuntimeError):  # Horovod's HostsUpdatedInterrupt has this one field
    def __init__(self, skip_sync: bool) -> None:
        self.skip_sync = skip_sync


@pytest.mark.parametrize("skip", [True, False])
def test_an_interrupt_never_asks_to_skip_the_sync(skip: bool) -> None:
    def check() -> None:
        raise HostsUpdated(skip)

    with pytest.raises(HostsUpdated) as info:
        check_host_updates_and_sync(check)
    assert info.value.skip_sync is False


def test_no_update_and_other_errors_pass_through() -> None:
    check_host_updates_and_sync(lambda: None)
    with pytest.raises(ValueError):
        check_host_updates_and_sync(lambda: (_ for _ in ()).throw(ValueError("x")))
