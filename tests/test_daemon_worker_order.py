"""The daemon's clock worker applies requests in order and skips only stale ones (counted)."""

from __future__ import annotations

import threading
import time

from kareus_node.journal import Journal
from kareus_node.worker import ClockWorker

from kareus.gpu import discover


class GatedGPU:
    """A simulated GPU whose first lock blocks until the test opens the gate, so requests queue up
    behind it exactly as behind a slow driver call."""

    def __init__(self) -> None:
        self._gpu = discover("sim", count=1)[0]
        self.uuid = self._gpu.uuid
        self.entered, self.gate = threading.Event(), threading.Event()
        self.locks_mhz: list[int] = []

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        self.entered.set()
        self.gate.wait()
        self._gpu.lock_sm_clock(min_mhz, max_mhz)
        self.locks_mhz.append(max_mhz)

    def reset_sm_clock(self) -> None:
        self._gpu.reset_sm_clock()


def _queued_behind_a_slow_lock(tmp_path, wants) -> tuple[ClockWorker, GatedGPU]:
    gpu = GatedGPU()
    worker = ClockWorker(gpu, Journal(tmp_path))
    worker.want(1410)
    assert gpu.entered.wait(5)  # the worker is inside the first (slow) lock
    tickets = [worker.want(clock) if stale is None else worker.want(clock, stale_after_s=stale) for clock, stale in wants]
    gpu.gate.set()
    assert worker.wait_applied(tickets[-1], 5)
    return worker, gpu


def test_every_clock_is_applied_in_order(tmp_path):
    """Fails on a worker that applies only the newest want: 1200 and 1100 would be skipped."""
    worker, gpu = _queued_behind_a_slow_lock(tmp_path, [(1200, None), (1110, None), (1005, None)])
    assert gpu.locks_mhz == [1410, 1200, 1110, 1005]
    assert worker.stale_skipped == 0 and worker.clock_changes == 4
    worker.stop()


def test_only_stale_wants_with_a_newer_one_behind_them_are_skipped(tmp_path):
    past, future = time.monotonic() - 1.0, time.monotonic() + 3600.0
    worker, gpu = _queued_behind_a_slow_lock(tmp_path, [(1200, past), (1110, future), (1005, past)])
    # 1200 is over and 1110 waits behind it: skipped. 1005 is stale too, but nothing newer is due.
    assert gpu.locks_mhz == [1410, 1110, 1005]
    assert worker.stale_skipped == 1
    worker.stop()
