"""`PlanFollower`: the hooks any training loop calls to follow a Kareus schedule.

Our own pipeline executor uses it, and so can a Megatron- or TorchTitan-style loop that keeps its
own model: call `on_step_begin()` at the start of an iteration and `on_instruction_begin(kind)` /
`on_instruction_end(kind)` around every forward/backward of a microbatch, and ask
`current_partition_config(key)` (or `current_instruction`) inside the instruction to learn how to
run it.

Clocks follow the GPU, not the CPU (`kareus.runtime.clocking`), and never synchronise the device
(DESIGN.md §2.8): every hook records a marker on the device stream, and instruction i+1's clock
is sent when the GPU reaches the end of instruction i — or `lead_s` before it, once the previous
step measured how long i takes — so the switch (milliseconds) overlaps i's tail. The first
instruction's clock goes out when the GPU reaches `on_step_begin`. On CPU (`HostProgress`) the
requests go out inline. The client (`kareus.daemon_client`) forwards them to the node daemon, which
applies them in order. `log` keeps (instruction, clock, time sent); `close()` sends what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from kareus.daemon_client import ClockClient, NullClockClient
from kareus.errors import KareusError
from kareus.runtime.clocking import ClockDispatcher, HostProgress, Marker, ProgressSource
from kareus.runtime.schedule import RunInstruction
from kareus.workload.partitions import PartitionConfig


@dataclass(frozen=True)
class ClockRequest:
    """One clock request the follower sent: for which instruction, which clock, when (monotonic)."""

    instruction: str
    clock_mhz: int
    time_s: float


class PlanFollower:
    """Walks one stage's instruction list, iteration after iteration."""

    def __init__(self, instructions: tuple[RunInstruction, ...], *, stage: int = 0,
                 clock: ClockClient | None = None, progress: ProgressSource | None = None,
                 lead_s: float = 0.0) -> None:
        if not instructions:
            raise KareusError(f"stage {stage}: the schedule has no instructions")
        self.instructions = instructions
        self.stage = stage
        self.clock = clock or NullClockClient()
        self.log: list[ClockRequest] = []
        self.step = -1
        self._index = -1  # the running instruction, -1 between instructions
        self._next = 0
        self.progress = progress or HostProgress()
        self._dispatcher = ClockDispatcher(self.clock, self.progress, lead_s=lead_s, on_sent=self._sent)
        self._begins: list[Marker | None] = [None] * len(instructions)  # this step's markers
        self._ends: list[Marker | None] = [None] * len(instructions)
        self._expected_s: list[float | None] = [None] * len(instructions)  # measured in the previous step

    @property
    def current_instruction(self) -> RunInstruction | None:
        return self.instructions[self._index] if self._index >= 0 else None

    def on_step_begin(self, step: int | None = None) -> None:
        if self._index >= 0:
            raise KareusError(f"stage {self.stage}: step began inside instruction {self._label(self._index)}")
        self.step = self.step + 1 if step is None else step
        self._next = 0
        self._measure_previous_step()
        self._request(0, anchor=self.progress.mark())

    def on_instruction_begin(self, kind: str, microbatch: int | None = None) -> RunInstruction:
        """Enter the next instruction; `kind` (and `microbatch` if given) must match the schedule."""
        if self._next >= len(self.instructions):
            raise KareusError(f"stage {self.stage}: more instructions than the schedule's "
                              f"{len(self.instructions)} in one step")
        expected = self.instructions[self._next]
        if kind != expected.kind or (microbatch is not None and microbatch != expected.microbatch):
            raise KareusError(f"stage {self.stage}: instruction {self._next} is {expected.kind} of microbatch "
                              f"{expected.microbatch}, the loop ran {kind} of microbatch {microbatch}")
        self._index = self._next
        self._begins[self._index] = self.progress.mark()
        return expected

    def on_instruction_end(self, kind: str | None = None) -> None:
        current = self.current_instruction
        if current is None or (kind is not None and kind != current.kind):
            raise KareusError(f"stage {self.stage}: on_instruction_end({kind!r}) outside that instruction")
        done = self._index
        self._ends[done] = self.progress.mark()
        self._next = done + 1
        self._index = -1
        if self._next < len(self.instructions):
            self._request(self._next, anchor=self._begins[done], end=self._ends[done],
                          expected_s=self._expected_s[done])

    def switch(self, instructions: tuple[RunInstruction, ...]) -> None:
        """Follow another instruction list from the next step on (a plan roll-out); only between
        steps, so no instruction ever mixes two plans. The log goes on."""
        if self._index >= 0 or 0 < self._next < len(self.instructions):
            raise KareusError(f"stage {self.stage}: a new plan can only take effect between steps")
        if not instructions:
            raise KareusError(f"stage {self.stage}: the schedule has no instructions")
        self.instructions = instructions
        self._next = 0
        self._begins, self._ends = [None] * len(instructions), [None] * len(instructions)
        self._expected_s = [None] * len(instructions)  # other instructions: measure them afresh

    def settle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every clock whose boundary the GPU has reached was sent."""
        return self._dispatcher.settle(timeout_s)

    def close(self) -> None:
        """Send the requests still waiting for the GPU (the step's host sync has passed them)."""
        self._dispatcher.close()

    def current_partition_config(self, key: str) -> PartitionConfig | None:
        """The running instruction's config for partition type `key` (recompute types are looked up
        in the recompute configs as `recompute:<key>`); None when sequential or unset."""
        current = self.current_instruction
        if current is None or current.mode != "partitioned":
            return None
        if key.startswith("recompute:"):
            return current.recompute_configs.get(key.split(":", 1)[1])
        return current.configs.get(key)

    def _request(self, index: int, *, anchor: Marker, end: Marker | None = None,
                 expected_s: float | None = None) -> None:
        clock_mhz = self.instructions[index].clock_mhz
        if clock_mhz is None:
            return
        self._dispatcher.submit(self._label(index), clock_mhz, anchor=anchor, end=end, expected_s=expected_s,
                                stale_in_s=self._expected_s[index])

    def _sent(self, label: str, clock_mhz: int, time_s: float) -> None:
        self.log.append(ClockRequest(label, clock_mhz, time_s))

    def _measure_previous_step(self) -> None:
        """Each instruction's device time in the step that just ended (where the GPU is past it);
        on the host there is nothing to lead, so nothing is measured."""
        if self.progress.synchronous:
            return
        for i, (begin, end) in enumerate(zip(self._begins, self._ends, strict=True)):
            if begin is not None and end is not None and end.reached():
                self._expected_s[i] = end.elapsed_s(begin)
        self._begins, self._ends = [None] * len(self.instructions), [None] * len(self.instructions)

    def _label(self, index: int) -> str:
        return self.instructions[index].label(self.stage)
