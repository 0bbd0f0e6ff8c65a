"""Straggler-aware re-selection in a running job (the decisions: `kareus.straggler.StragglerWatch`).

Every step each rank contributes the time its replica took *before* the gradient all-reduce (which
makes every replica wait for the slowest): on the simulated GPU the modelled pipeline time, on a
real GPU the device time of the step's forward and backward work (CUDA events, no extra sync).
One `all_gather` of one number per rank over the default group gives every rank every replica's
time (a replica's time is the largest over its ranks). Every rank feeds the same numbers to the
same `StragglerWatch`, so all ranks of a replica switch at the same step boundary without another
message; the switch itself is the roll-out mechanism's (`trainer._Running`).

`KAREUS_SIM_STRAGGLER` (also `TrainConfig.sim_straggler`) is the test and demo knob: with energy on
the simulated GPU, one replica's GPUs get the clock ceiling that makes its starting plan a fraction
slower (`kareus.sim.replica.ceiling_for_slowdown`), for some steps:

    KAREUS_SIM_STRAGGLER=REPLICA:SLOWDOWN[@FIRST-END]      e.g. 1:0.15@4-12

(replica 1, 15 % slower, for steps 4..11; without `@` for the whole run). It changes modelled
times and energies only; the model trains exactly as without it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kareus.errors import KareusError
from kareus.runtime.parallel import DistContext
from kareus.straggler import Decision, StragglerPolicy, StragglerWatch, objective_max_time_s

SIM_STRAGGLER_ENV = "KAREUS_SIM_STRAGGLER"
_KNOB = re.compile(r"^(?P<replica>\d+):(?P<slowdown>[0-9.]+)(@(?P<first>\d+)-(?P<end>\d+))?$")


@dataclass(frozen=True)
class SimStraggler:
    """One simulated replica slower by `slowdown` for steps `first_step` ≤ step < `end_step`."""

    replica: int
    slowdown: float
    first_step: int = 0
    end_step: int | None = None

    def active(self, step: int) -> bool:
        return self.first_step <= step and (self.end_step is None or step < self.end_step)

    @classmethod
    def parse(cls, text: str | None) -> SimStraggler | None:
        if not text:
            return None
        match = _KNOB.match(text.strip())
        if match is None:
            raise KareusError(f"{SIM_STRAGGLER_ENV}: expected REPLICA:SLOWDOWN[@FIRST-END] such as 1:0.15@4-12, "
                              f"got {text!r}")
        slowdown = float(match["slowdown"])
        if not 0 <= slowdown < 10:
            raise KareusError(f"{SIM_STRAGGLER_ENV}: the slowdown must be a fraction in [0, 10), got {slowdown}")
        first, end = match["first"], match["end"]
        knob = cls(int(match["replica"]), slowdown, int(first or 0), int(end) if end else None)
        if knob.end_step is not None and knob.end_step <= knob.first_step:
            raise KareusError(f"{SIM_STRAGGLER_ENV}: END must be after FIRST, got {text!r}")
        return knob


class BusyTimer:
    """The replica's own share of a step: from its start to the end of its forward/backward work."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._events: tuple | None = None
        self._start_s = self._end_s = 0.0

    def start(self) -> None:
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events = (begin, None)
        self._start_s = time.perf_counter()

    def stop(self) -> None:
        if self.cuda and self._events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._events[0], end)
        self._end_s = time.perf_counter()

    def seconds(self) -> float:
        """Read after the step's synchronisation (CUDA events are then complete)."""
        if self.cuda and self._events is not None and self._events[1] is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._end_s - self._start_s


class StragglerRuntime:
    """The per-step exchange of replica times and the watch that decides re-selections."""

    def __init__(self, ctx: DistContext, *, dp: int, plan, policy: StragglerPolicy, enabled: bool,
                 knob: SimStraggler | None) -> None:
        self.ctx = ctx
        self.dp = dp
        self.knob = knob
        self.policy, self.enabled = policy, enabled
        if knob is not None and not 0 <= knob.replica < dp:
            raise KareusError(f"{SIM_STRAGGLER_ENV}: replica {knob.replica} does not exist "
                              f"(spec.parallelism.data is {dp})")
        self.watch = self._watch(plan)
        self.reselections = 0

    def _watch(self, plan) -> StragglerWatch | None:
        if not (self.enabled and self.dp > 1 and plan is not None and len(plan.frontier.rows) > 1):
            return None
        return StragglerWatch(plan.frontier.points(), plan.selected_row, self.dp, self.policy,
                              objective_max_time_s(plan))

    @property
    def exchanges(self) -> bool:
        """Whether replica times are gathered each step (data parallel, and something needs them)."""
        return self.dp > 1 and (self.watch is not None or self.knob is not None)

    def slowed(self, step: int) -> bool:
        """Whether this rank's replica is the simulated straggler at `step`."""
        return self.knob is not None and self.knob.replica == self.ctx.dp_rank and self.knob.active(step)

    def replica_times(self, my_time_s: float) -> list[float]:
        """Collective: every replica's time (the largest over its ranks)."""
        mine = torch.tensor([my_time_s], dtype=torch.float64, device=self.ctx.device)
        gathered = [torch.empty_like(mine) for _ in range(self.ctx.layout.world_size)]
        dist.all_gather(gathered, mine)
        times = [0.0] * self.dp
        for rank, value in enumerate(gathered):
            replica = self.ctx.layout.coords(rank)[0]
            times[replica] = max(times[replica], float(value[0]))
        return times

    def observe(self, step: int, times_s: list[float]) -> Decision | None:
        if self.watch is None:
            return None
        decision = self.watch.observe(step, times_s)
        if decision is not None:
            self.reselections += 1
        return decision

    def rolled_out(self, plan) -> None:
        """A new plan file took effect: it is every replica's point now."""
        self.watch = self._watch(plan)

    @property
    def rows(self) -> list[int] | None:
        return list(self.watch.rows) if self.watch is not None else None

    @property
    def straggler(self) -> int | None:
        """The replica slower than the others by more than the threshold at the last step, if any."""
        return self.watch.straggler if self.watch is not None else None

    @property
    def slowdown(self) -> float | None:
        """How much slower the slowest replica was than the next at the last step (a fraction)."""
        return self.watch.slowdown if self.watch is not None else None
