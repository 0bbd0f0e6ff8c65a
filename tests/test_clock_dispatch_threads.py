"""The clock dispatcher's threads: on the rank's GPU, blocking events, no polling under the GIL.

The CUDA parts run on CPU with torch.cuda's functions replaced by recorders: what is asserted is
which device the dispatcher's threads select and which events they create, not CUDA itself.
"""

from __future__ import annotations

import sys
import threading
from typing import ClassVar

import torch

from kareus.daemon_client import RecordingClockClient
from kareus.runtime import clocking
from kareus.runtime.clocking import ClockDispatcher, CudaProgress, Marker, ProgressSource


class CountingMarker(Marker):
    """A marker the test reaches by hand; counts how often anyone asks whether it is reached."""

    def __init__(self, reached: bool = False) -> None:
        self._event = threading.Event()
        if reached:
            self._event.set()
        self.queries = 0

    def reached(self) -> bool:
        self.queries += 1
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()

    def elapsed_s(self, earlier: Marker) -> float:
        return 0.0

    def reach(self) -> None:
        self._event.set()


class Source(ProgressSource):
    def __init__(self) -> None:
        self.threads: list[str] = []

    def mark(self) -> Marker:
        return CountingMarker(reached=True)

    def enter_thread(self) -> None:
        self.threads.append(threading.current_thread().name)


def test_the_lead_wait_sleeps_until_the_end_marker_instead_of_polling_it():
    """Fails on a helper that polls the end marker every 0.2 ms (each poll a GIL hand-over)."""
    clock, source = RecordingClockClient(), Source()
    dispatcher = ClockDispatcher(clock, source, lead_s=0.0)
    end = CountingMarker()
    # The lead point is far away, so only the end marker can release the request.
    dispatcher.submit("F0", 1200, anchor=CountingMarker(reached=True), end=end, expected_s=600.0)
    assert dispatcher.settle()  # blocked on `end`, which is not reached
    threading.Timer(0.2, end.reach).start()
    dispatcher.close(timeout_s=10.0)
    assert [(r.instruction, r.clock_mhz) for r in clock.log] == [("F0", 1200)]
    assert end.queries <= 8  # polling would have asked about a thousand times in 0.2 s
    assert sorted(source.threads) == ["kareus-clock-dispatch", "kareus-clock-watch"]


def test_the_switch_interval_is_lowered_while_the_helper_runs_and_restored_after():
    before = sys.getswitchinterval()
    dispatcher = ClockDispatcher(RecordingClockClient(), Source())
    dispatcher.submit("F0", 1200, anchor=CountingMarker(reached=True))
    assert sys.getswitchinterval() == clocking.SWITCH_INTERVAL_S < before
    dispatcher.close()
    assert sys.getswitchinterval() == before
    untouched = ClockDispatcher(RecordingClockClient(), Source(), switch_interval_s=None)
    untouched.submit("F0", 1200, anchor=CountingMarker(reached=True))
    assert sys.getswitchinterval() == before
    untouched.close()


class FakeCudaEvent:
    made: ClassVar[list[dict]] = []

    def __init__(self, **kwargs) -> None:
        FakeCudaEvent.made.append(kwargs)
        self.synchronized_on: list[str] = []

    def record(self, stream) -> None:
        pass

    def query(self) -> bool:
        return False  # never reached when asked: the helper must block on it

    def synchronize(self) -> None:
        self.synchronized_on.append(threading.current_thread().name)

    def elapsed_time(self, other) -> float:
        return 0.0


def test_cuda_markers_are_blocking_events_and_both_threads_select_the_ranks_gpu(monkeypatch):
    """Fails where the helper thread queries events on the default device 0 (a spurious context
    there for every rank), or where its events spin instead of blocking."""
    selected: list[tuple[str, int]] = []
    FakeCudaEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: "stream")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: selected.append((threading.current_thread().name, int(index))))
    progress = CudaProgress()
    clock = RecordingClockClient()
    dispatcher = ClockDispatcher(clock, progress, lead_s=0.0)
    anchor, end = progress.mark(), progress.mark()
    dispatcher.submit("F0", 1200, anchor=anchor, end=end, expected_s=600.0)
    dispatcher.close()
    assert FakeCudaEvent.made == [{"enable_timing": True, "blocking": True}] * 2
    assert sorted(selected) == [("kareus-clock-dispatch", 3), ("kareus-clock-watch", 3)]
    assert anchor.event.synchronized_on == ["kareus-clock-dispatch"]
    assert end.event.synchronized_on == ["kareus-clock-watch"]
    assert [r.clock_mhz for r in clock.log] == [1200]


def test_two_dispatchers_keep_the_interval_lowered_until_the_last_closes():
    before = sys.getswitchinterval()
    first, second = (ClockDispatcher(RecordingClockClient(), Source()) for _ in range(2))
    for dispatcher in (first, second):
        dispatcher.submit("F0", 1200, anchor=CountingMarker(reached=True))
    first.close()
    assert sys.getswitchinterval() == clocking.SWITCH_INTERVAL_S  # the second still runs
    second.close()
    assert sys.getswitchinterval() == before
