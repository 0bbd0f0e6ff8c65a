"""`PlanFollower`: the hooks any training loop calls to follow a Kareus schedule.

Our own pipeline executor uses it, and so can a Megatron- or TorchTitan-style loop that keeps its
own model: call `on_step_begin()` at the start of an iteration and `on_instruction_begin(kind)` /
`on_instruction_end(kind)` around every forward/backward of a microbatch, and ask
`current_partition_config(key)` (or `current_instruction`) inside the instruction to learn how to
run it.

Clocks are requested *ahead*, never by synchronising the device (DESIGN.md §2.8): the first
instruction's clock at `on_step_begin`, every later one at the end of the instruction before it,
so the switch (milliseconds) overlaps the tail of the previous instruction's GPU work. The request
is non-blocking; the client (`kareus.daemon_client`) forwards it to the node daemon, which
coalesces repeats of the clock already set. `log` keeps (instruction, clock, time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kareus.daemon_client import ClockClient, NullClockClient
from kareus.errors import KareusError
from kareus.runtime.schedule import RunInstruction
from kareus.workload.partitions import PartitionConfig


@dataclass(frozen=True)
class ClockRequest:
    """One clock request the follower made: for which instruction, which clock, when (monotonic)."""

    instruction: str
    clock_mhz: int
    time_s: float


class PlanFollower:
    """Walks one stage's instruction list, iteration after iteration."""

    def __init__(self, instructions: tuple[RunInstruction, ...], *, stage: int = 0,
                 clock: ClockClient | None = None) -> None:
        if not instructions:
            raise KareusError(f"stage {stage}: the schedule has no instructions")
        self.instructions = instructions
        self.stage = stage
        self.clock = clock or NullClockClient()
        self.log: list[ClockRequest] = []
        self.step = -1
        self._index = -1  # the running instruction, -1 between instructions
        self._next = 0

    @property
    def current_instruction(self) -> RunInstruction | None:
        return self.instructions[self._index] if self._index >= 0 else None

    def on_step_begin(self, step: int | None = None) -> None:
        if self._index >= 0:
            raise KareusError(f"stage {self.stage}: step began inside instruction {self._label(self._index)}")
        self.step = self.step + 1 if step is None else step
        self._next = 0
        self._request(0)

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
        return expected

    def on_instruction_end(self, kind: str | None = None) -> None:
        current = self.current_instruction
        if current is None or (kind is not None and kind != current.kind):
            raise KareusError(f"stage {self.stage}: on_instruction_end({kind!r}) outside that instruction")
        self._next = self._index + 1
        self._index = -1
        if self._next < len(self.instructions):
            self._request(self._next)

    def switch(self, instructions: tuple[RunInstruction, ...]) -> None:
        """Follow another instruction list from the next step on (a plan roll-out); only between
        steps, so no instruction ever mixes two plans. The log goes on."""
        if self._index >= 0 or 0 < self._next < len(self.instructions):
            raise KareusError(f"stage {self.stage}: a new plan can only take effect between steps")
        if not instructions:
            raise KareusError(f"stage {self.stage}: the schedule has no instructions")
        self.instructions = instructions
        self._next = 0

    def current_partition_config(self, key: str) -> PartitionConfig | None:
        """The running instruction's config for partition type `key` (recompute types are looked up
        in the recompute configs as `recompute:<key>`); None when sequential or unset."""
        current = self.current_instruction
        if current is None or current.mode != "partitioned":
            return None
        if key.startswith("recompute:"):
            return current.recompute_configs.get(key.split(":", 1)[1])
        return current.configs.get(key)

    def _request(self, index: int) -> None:
        clock_mhz = self.instructions[index].clock_mhz
        if clock_mhz is None:
            return
        label = self._label(index)
        self.clock.request_clock(clock_mhz, instruction=label)
        self.log.append(ClockRequest(label, clock_mhz, time.monotonic()))

    def _label(self, index: int) -> str:
        return self.instructions[index].label(self.stage)
