"""Clock requests aligned with GPU execution, not with the CPU that enqueues it.

The CPU runs ahead of the GPU: it enqueues instruction i+1 while the GPU is still on instruction i
or earlier (only a host sync, at the step end, stops it). A clock request sent when the CPU has
*enqueued* a boundary lands while the GPU runs an earlier instruction, so the plan is not what
runs. Instead the follower records a **marker** on the device stream at every instruction
boundary, and the `ClockDispatcher`'s helper thread waits until the GPU reaches it before it
sends the next instruction's clock. Requests go out in order, one per instruction, and the node
daemon applies them in order (it skips one only when it is already stale).

**Lead.** A lock takes a few milliseconds to take effect. Once the GPU has *started* instruction i,
the helper sends the clock of i+1 `lead_s` before i is expected to end — i's duration in the
previous step, measured between its markers — or when the GPU reaches i's end marker, whichever
comes first. In the first step (nothing measured yet) it sends at the end marker. Each request
also says when it becomes stale (`stale_after_s`: expected end of its own instruction), so a
daemon that fell behind skips it rather than delay the clock that is due.

**Waiting without the GIL.** The training thread launches kernels in a Python loop and holds the
GIL almost all the time; a thread that wants it back waits up to the interpreter's switch interval
(5 ms by default: the whole default lead). So the helper never polls: it blocks on markers
(blocking-sync CUDA events sleep in the driver, GIL released, no core spun) and, for a lead point,
in one timed wait that a **watcher** thread cuts short when the end marker is reached. Each send
then costs one or two GIL hand-overs, and while the helper thread lives the dispatcher lowers the
switch interval to `SWITCH_INTERVAL_S` (restored on `close`; a thread that does not want the GIL
costs the training thread nothing) and wakes early for a lead point: by the switch interval, or
by how late its wake-ups have been landing (a running mean; a loaded host adds its scheduling
delay to the GIL's), at most by the lead itself. So a lead request is not one switch interval late. Both threads call `ProgressSource.enter_thread` first: on CUDA that
selects the training thread's device, or their first event query would open a context on GPU 0.

Progress sources:
- `HostProgress` (CPU, gloo): the device is the host, every marker is reached when recorded, so
  requests go out inline on the calling thread (no helper thread, no lead).
- `CudaProgress`: timing, blocking-sync `torch.cuda.Event`s recorded on the current (compute) stream
  of the device that was current when it was made.
- Tests use a fake source whose markers they complete by hand, the CPU far ahead.
"""

from __future__ import annotations

import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kareus.daemon_client import ClockClient

SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval while a helper thread runs (CPython's default: 5 ms)
WAKE_MEAN_WEIGHT = 0.2  # weight of the newest wake-up delay in the running mean


class Marker(ABC):
    """A point on the device's stream."""

    @abstractmethod
    def reached(self) -> bool:
        """Whether the device has executed everything enqueued before the marker."""

    @abstractmethod
    def wait(self) -> None:
        """Block until `reached()`."""

    @abstractmethod
    def elapsed_s(self, earlier: Marker) -> float:
        """Device time from `earlier` to this marker; both must be reached."""


class ProgressSource(ABC):
    """Where markers come from; `synchronous` when the device finishes work as it is enqueued."""

    synchronous = False

    @abstractmethod
    def mark(self) -> Marker:
        """Record a marker at the current end of the device's stream."""

    def enter_thread(self) -> None:
        """Called first on every dispatcher thread (bind the thread to the device)."""
        return None


class _Reached(Marker):
    def reached(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def elapsed_s(self, earlier: Marker) -> float:
        return 0.0


class HostProgress(ProgressSource):
    """CPU execution: done as soon as it is issued."""

    synchronous = True
    _REACHED = _Reached()

    def mark(self) -> Marker:
        return self._REACHED


class _CudaMarker(Marker):
    def __init__(self, event) -> None:
        self.event = event

    def reached(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()

    def elapsed_s(self, earlier: Marker) -> float:
        return earlier.event.elapsed_time(self.event) / 1000.0  # torch reports milliseconds


class CudaProgress(ProgressSource):
    """Timing CUDA events on the current stream of the calling (training) thread, on the device
    current when the source is made (the rank's GPU: `init_distributed` set it)."""

    def __init__(self, device_index: int | None = None) -> None:
        import torch  # CUDA only; the module stays importable without it

        self.device_index = torch.cuda.current_device() if device_index is None else device_index

    def mark(self) -> Marker:
        import torch

        # blocking: `wait()` sleeps in the driver instead of spinning a core the launch loop needs
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(torch.cuda.current_stream())
        return _CudaMarker(event)

    def enter_thread(self) -> None:
        import torch

        # A new thread's current device is 0: an event query there would open a context on GPU 0.
        torch.cuda.set_device(self.device_index)


def send_delay_s(expected_s: float | None, lead_s: float) -> float | None:
    """After the GPU starts an instruction expected to last `expected_s`, how long to wait before
    sending the next instruction's clock; None: wait for the instruction's end marker."""
    if expected_s is None:
        return None
    return max(0.0, expected_s - lead_s)


@dataclass(frozen=True)
class _Request:
    label: str
    clock_mhz: int
    anchor: Marker  # the GPU must have reached this (the start of the instruction before)
    end: Marker | None  # and this, unless the lead point comes first (the end of that instruction)
    delay_s: float | None  # after the anchor; None: at `end`
    stale_in_s: float | None  # how long the requested instruction is expected to run


Sent = Callable[[str, int, float], None]  # (instruction label, clock_mhz, time.monotonic())


class _Watcher:
    """A thread that waits for end markers in stream order and signals each one reached, so the
    helper can sleep until a lead point *or* an end marker without polling."""

    def __init__(self, progress: ProgressSource) -> None:
        self._progress = progress
        self._queue: deque[tuple[Marker, threading.Event]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kareus-clock-watch", daemon=True)
        self._thread.start()

    def watch(self, marker: Marker) -> threading.Event:
        """An event set once `marker` is reached."""
        reached = threading.Event()
        with self._cond:
            self._queue.append((marker, reached))
            self._cond.notify_all()
        return reached

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        self._progress.enter_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                marker, reached = self._queue.popleft()
            marker.wait()
            reached.set()


class _SwitchInterval:
    """The interpreter's GIL switch interval (one per process), lowered while any dispatcher's
    helper runs and given back when the last one closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved_s: float | None = None

    def lower(self, interval_s: float) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved_s = sys.getswitchinterval()
            self._holders += 1
            if interval_s < sys.getswitchinterval():
                sys.setswitchinterval(interval_s)

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._saved_s is not None:
                sys.setswitchinterval(self._saved_s)
                self._saved_s = None


_SWITCH = _SwitchInterval()


class ClockDispatcher:
    """Sends clock requests to `clock` when the device reaches them, in submission order.

    `switch_interval_s`: the GIL switch interval while the helper thread runs (None: leave the
    interpreter's as it is)."""

    def __init__(self, clock: ClockClient, progress: ProgressSource, *, lead_s: float = 0.0,
                 on_sent: Sent | None = None, switch_interval_s: float | None = SWITCH_INTERVAL_S) -> None:
        self.clock, self.progress, self.lead_s = clock, progress, lead_s
        self._on_sent = on_sent
        self._queue: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._busy = False  # the helper holds a request it has not sent yet
        self._blocked_on: Marker | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._watcher: _Watcher | None = None
        self._switch_interval_s = switch_interval_s
        self._lowered = False  # this dispatcher holds the interpreter's switch interval lowered
        self._wake_delay_s = 0.0  # running mean of how late timed wake-ups land

    def submit(self, label: str, clock_mhz: int, *, anchor: Marker, end: Marker | None = None,
               expected_s: float | None = None, stale_in_s: float | None = None) -> None:
        """Request `clock_mhz` for instruction `label` once the device passes `anchor` (and `end`,
        or the lead point of an instruction expected to take `expected_s` after `anchor`)."""
        request = _Request(label, int(clock_mhz), anchor, end, send_delay_s(expected_s, self.lead_s), stale_in_s)
        if self.progress.synchronous:
            self._send(request)
            return
        with self._cond:
            self._queue.append(request)
            if self._thread is None:
                self._start()
            self._cond.notify_all()

    def settle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every request whose markers the device has reached was sent (False on
        timeout); what remains waits for the device."""
        def settled() -> bool:
            if not self._queue and not self._busy:
                return True
            return self._blocked_on is not None and not self._blocked_on.reached()

        with self._cond:
            return self._cond.wait_for(settled, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what the device has reached (a step ends with a host sync, so everything), then stop."""
        self.settle(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._watcher is not None:
            self._watcher.close(timeout_s)
        self._restore_switch_interval()

    def _start(self) -> None:
        if self._switch_interval_s is not None:
            _SWITCH.lower(self._switch_interval_s)
            self._lowered = True
        self._thread = threading.Thread(target=self._run, name="kareus-clock-dispatch", daemon=True)
        self._thread.start()

    def _restore_switch_interval(self) -> None:
        if self._lowered:
            _SWITCH.release()
            self._lowered = False

    # -- the helper thread --------------------------------------------------------------------
    def _run(self) -> None:
        self.progress.enter_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                request = self._queue.popleft()
                self._busy = True
            self._await(request.anchor)
            if request.end is not None:
                if request.delay_s is None:
                    self._await(request.end)
                else:
                    self._await_lead(request.end, time.monotonic() + request.delay_s)
            self._send(request)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _await(self, marker: Marker) -> None:
        if marker.reached():
            return
        self._blocked(marker)
        marker.wait()
        self._blocked(None)

    def _await_lead(self, end: Marker, deadline_s: float) -> None:
        """Until the GPU reaches `end` or the lead point passes, whichever first; woken one switch
        interval early, since taking the GIL back may cost that much."""
        if end.reached():
            return
        if self._watcher is None:
            self._watcher = _Watcher(self.progress)
        reached = self._watcher.watch(end)
        self._blocked(end)
        wake_s = deadline_s - self.wake_early_s()
        if not reached.wait(max(0.0, wake_s - time.monotonic())):
            delay_s = max(0.0, time.monotonic() - wake_s)
            self._wake_delay_s += WAKE_MEAN_WEIGHT * (delay_s - self._wake_delay_s)
        self._blocked(None)

    def wake_early_s(self) -> float:
        """How long before a lead point the helper wakes: the GIL switch interval, or the mean
        delay of its wake-ups if that is longer, never more than the lead."""
        return min(self.lead_s, max(sys.getswitchinterval(), self._wake_delay_s))

    def _blocked(self, marker: Marker | None) -> None:
        """What the helper waits for (`settle` reads it); None while it works."""
        with self._cond:
            self._blocked_on = marker
            self._cond.notify_all()

    def _send(self, request: _Request) -> None:
        now = time.monotonic()
        stale_after_s = None if request.stale_in_s is None else now + self.lead_s + request.stale_in_s
        self.clock.request_clock(request.clock_mhz, instruction=request.label, stale_after_s=stale_after_s)
        if self._on_sent is not None:
            self._on_sent(request.label, request.clock_mhz, now)
