"""Clock requests follow the GPU, not the CPU that runs ahead of it.

A fake GPU stands behind a `PlanFollower`: its markers are reached only when the test runs the
GPU up to them, so the CPU enqueues a whole step before the GPU starts it (what a real CPU does
until the step's host sync). A fake daemon applies each request at once; at every instruction
start the GPU notes the clock in effect. That log must equal the plan instruction by instruction.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from kareus.daemon_client import RecordingClockClient
from kareus.runtime import PlanFollower, Schedule
from kareus.runtime.clocking import Marker, ProgressSource, send_delay_s

INSTRUCTION_DEVICE_S = 1000.0  # device time per instruction: the lead point is never reached in a test


class FakeMarker(Marker):
    def __init__(self) -> None:
        self._reached = threading.Event()
        self.device_time_s: float | None = None

    def reached(self) -> bool:
        return self._reached.is_set()

    def wait(self) -> None:
        self._reached.wait()

    def elapsed_s(self, earlier: Marker) -> float:
        return self.device_time_s - earlier.device_time_s

    def reach(self, device_time_s: float) -> None:
        self.device_time_s = device_time_s
        self._reached.set()


class LaggingGPU(ProgressSource):
    """Markers in stream order; `run_to(n)` lets the GPU execute up to marker n."""

    def __init__(self) -> None:
        self.markers: list[FakeMarker] = []
        self.device_time_s = 0.0

    def mark(self) -> Marker:
        self.markers.append(FakeMarker())
        return self.markers[-1]


class ApplyingDaemon(RecordingClockClient):
    """Applies every request the moment it arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.current_mhz: int | None = None
        self.stale_after_s: list[float | None] = []

    def request_clock(self, clock_mhz: int, *, instruction: str, stale_after_s: float | None = None) -> None:
        super().request_clock(clock_mhz, instruction=instruction)
        self.current_mhz = clock_mhz
        self.stale_after_s.append(stale_after_s)


def _schedule(num_stages: int, stage: int, microbatches: int, clocks_mhz=None):
    """Stage `stage` of a uniform 1F1B with a different clock on every instruction."""
    instructions = Schedule.uniform(num_stages, microbatches, mode="sequential").stages[stage]
    clocks_mhz = clocks_mhz or [1410 - 60 * i for i in range(len(instructions))]
    return tuple(replace(ins, clock_mhz=c) for ins, c in zip(instructions, clocks_mhz, strict=True))


def _follower(instructions, clock, gpu) -> PlanFollower:
    return PlanFollower(instructions, stage=1, clock=clock, progress=gpu, lead_s=0.005)


def _run_step(follower: PlanFollower, gpu: LaggingGPU, step: int) -> list[tuple[str, int | None]]:
    """The CPU enqueues the whole step, then the GPU executes it; returns (instruction, clock in
    effect when the GPU started it)."""
    first = len(gpu.markers)
    follower.on_step_begin(step)
    for ins in follower.instructions:
        follower.on_instruction_begin(ins.kind, ins.microbatch)
        follower.on_instruction_end(ins.kind)
    assert follower.settle()  # the CPU is done; the GPU has not started: nothing may be sent but...
    ran = []
    daemon = follower.clock
    markers = gpu.markers[first:]  # step begin, then (begin, end) per instruction
    for n, marker in enumerate(markers):
        marker.reach(gpu.device_time_s)
        gpu.device_time_s += INSTRUCTION_DEVICE_S if n % 2 else 0.0
        assert follower.settle()
        if n % 2 == 1:  # an instruction begins
            ran.append((follower.instructions[n // 2].label(follower.stage), daemon.current_mhz))
    return ran


@pytest.mark.parametrize("clocks_mhz", [None, [1410, 1410, 1200, 1200, 1005, 1410, 1410, 1005]], ids=["distinct", "repeats"])
def test_clock_in_effect_equals_the_plan_instruction_by_instruction(clocks_mhz):
    """Fails on CPU-timed requests: the CPU has asked for every clock before the GPU starts, so
    every instruction runs at the step's last clock."""
    instructions = _schedule(3, 1, 4, clocks_mhz)
    gpu, daemon = LaggingGPU(), ApplyingDaemon()
    follower = _follower(instructions, daemon, gpu)
    plan = [(ins.label(1), ins.clock_mhz) for ins in instructions]
    for step in range(3):  # step 0 waits for end markers; later steps lead by measured durations
        assert _run_step(follower, gpu, step) == plan, f"step {step}"
    follower.close()
    # One request per instruction, in order, none dropped.
    assert [(r.instruction, r.clock_mhz) for r in follower.log] == plan * 3
    assert [(r.instruction, r.clock_mhz) for r in daemon.log] == plan * 3


def test_nothing_is_sent_before_the_gpu_gets_there():
    instructions = _schedule(2, 0, 2)
    gpu, daemon = LaggingGPU(), ApplyingDaemon()
    follower = _follower(instructions, daemon, gpu)
    follower.on_step_begin(0)
    for ins in instructions:
        follower.on_instruction_begin(ins.kind, ins.microbatch)
        follower.on_instruction_end(ins.kind)
    assert follower.settle() and daemon.log == []
    gpu.markers[0].reach(0.0)  # the GPU starts the step: only the first instruction's clock
    assert follower.settle()
    assert [r.clock_mhz for r in daemon.log] == [instructions[0].clock_mhz]
    gpu.markers[1].reach(0.0)  # inside instruction 0: its successor waits for its end
    assert follower.settle() and len(daemon.log) == 1
    for marker in gpu.markers[2:]:
        marker.reach(1.0)
    follower.close()
    assert [r.clock_mhz for r in daemon.log] == [ins.clock_mhz for ins in instructions]


def test_later_steps_say_when_each_request_goes_stale():
    instructions = _schedule(1, 0, 2)
    gpu, daemon = LaggingGPU(), ApplyingDaemon()
    follower = _follower(instructions, daemon, gpu)
    _run_step(follower, gpu, 0)
    assert daemon.stale_after_s == [None] * len(instructions)  # nothing measured yet
    _run_step(follower, gpu, 1)
    stale = daemon.stale_after_s[len(instructions):]
    sent = [r.time_s for r in follower.log[len(instructions):]]
    # Stale once the instruction's measured device time (plus the lead) has passed after sending.
    assert [round(s - t, 6) for s, t in zip(stale, sent, strict=True)] == [INSTRUCTION_DEVICE_S + 0.005] * len(sent)
    follower.close()


def test_send_delay_leads_the_expected_end():
    assert send_delay_s(None, 0.005) is None  # nothing measured: wait for the end marker
    assert send_delay_s(0.120, 0.005) == pytest.approx(0.115)
    assert send_delay_s(0.002, 0.005) == 0.0  # shorter than the lock latency: right at its start


def test_on_the_host_requests_go_out_inline_without_a_thread():
    instructions = _schedule(1, 0, 2)
    daemon = ApplyingDaemon()
    follower = PlanFollower(instructions, clock=daemon)
    follower.on_step_begin(0)
    for ins in instructions:
        follower.on_instruction_begin(ins.kind, ins.microbatch)
        assert daemon.current_mhz == ins.clock_mhz
        follower.on_instruction_end(ins.kind)
    assert follower._dispatcher._thread is None
    assert daemon.stale_after_s == [None] * len(instructions)
