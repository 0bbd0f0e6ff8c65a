"""The progress ledger: every training step of a job counted once, across the pods that ran it.

A pod's `train.jsonl` lives in its own emptyDir and starts over in every pod; a job with a
checkpoint claim keeps its work across gang restarts, preemptions and suspensions, so its progress
must too. Rank 0's publisher copies each step it reads from `train.jsonl` (step, time, energy) to
`progress.jsonl` in the job's checkpoint directory on the claim, after a line naming its run (the
pod). Replaying the ledger gives the job's progress:

- a step counts once: a step logged again (a run resumed from a checkpoint before it) replaces the
  earlier run's copy of it and of every step after it, whose energy was spent on work the restart
  threw away (`redone_j`, kept apart from `energy_j`);
- `resumed_from_step` is the first step of the latest run that logged any, when an earlier run logged
  steps before it (a resumed run's first step is the checkpoint's step count; 0 when it started over).

Standard library only: it runs in the training image beside the publisher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

LEDGER_FILE = "progress.jsonl"
CHECKPOINT_PREFIX = "step-"  # kareus.runtime.checkpoint: DIR/step-NNNNNNNN, complete once it has its manifest
CHECKPOINT_MANIFEST = "kareus-checkpoint.json"
RECENT_STEPS = 16  # the window of the iteration time an ETA is computed from


@dataclass(frozen=True)
class StepEntry:
    step: int
    iteration_time_s: float
    energy_j: float

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> StepEntry:
        return cls(int(record["step"]), float(record["iteration_time_s"]), float(record.get("energy_j") or 0.0))

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "iteration_time_s": self.iteration_time_s, "energy_j": self.energy_j})


@dataclass
class LedgerState:
    """The replayed ledger: the steps that count, in order, and what restarts threw away."""

    kept: list[StepEntry] = field(default_factory=list)
    redone_j: float = 0.0
    runs: int = 0
    resumed_from_step: int = 0
    _run_has_steps: bool = False

    def start_run(self) -> None:
        self.runs += 1
        self._run_has_steps = False

    def add(self, entry: StepEntry) -> None:
        if self._run_has_steps and self.kept and entry.step <= self.kept[-1].step:
            return  # a run's steps only increase: this is a copy written twice, not work done again
        if not self._run_has_steps:
            self.resumed_from_step = entry.step if self.kept or self.redone_j else 0
            self._run_has_steps = True
        while self.kept and self.kept[-1].step >= entry.step:
            self.redone_j += self.kept.pop().energy_j
        self.kept.append(entry)

    def summary(self) -> dict[str, Any]:
        """The job's progress in the progress ConfigMap's words (what `summarise_progress` gives)."""
        count = len(self.kept)
        recent = self.kept[-RECENT_STEPS:]
        return {
            "iterations": count,
            "energyJoules": round(sum(e.energy_j for e in self.kept), 6),
            "averageIterationSeconds": round(sum(e.iteration_time_s for e in self.kept) / count, 9) if count else 0.0,
            "recentIterationSeconds": round(sum(e.iteration_time_s for e in recent) / len(recent), 9) if recent else 0.0,
            "lastStep": self.kept[-1].step if self.kept else -1,
            "redoneJoules": round(self.redone_j, 6),
            "resumedFromStep": self.resumed_from_step,
            "runs": self.runs,
        }


def replay(lines: Iterable[str]) -> LedgerState:
    """The state a ledger's lines describe; a half-written last line is ignored."""
    state = LedgerState()
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if "run" in item:
            state.start_run()
        elif "step" in item:
            try:
                state.add(StepEntry.of(item))
            except (KeyError, TypeError, ValueError):
                continue
    return state


class Ledger:
    """The ledger file of one job, appended by one run (rank 0's publisher) and replayed in memory."""

    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.state = replay(path.read_text(errors="replace").splitlines() if path.exists() else [])
        self._file = path.open("a")
        if not _ends_a_line(path):
            self._file.write("\n")  # a line a killed run left half-written stays apart from ours
        self._write({"run": run, "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
        self.state.start_run()

    def add(self, records: Iterable[Mapping[str, Any]]) -> None:
        added = False
        for record in records:
            try:
                entry = StepEntry.of(record)
            except (KeyError, TypeError, ValueError):
                continue  # not a step record the runtime writes: nothing to count
            self._file.write(entry.to_json() + "\n")
            self.state.add(entry)
            added = True
        if added:
            self._file.flush()
            os.fsync(self._file.fileno())  # on the claim before the pod can be killed

    def _write(self, item: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(item) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def latest_checkpoint(directory: Path) -> dict[str, Any] | None:
    """`{"lastStep", "lastTime"}` of the newest complete checkpoint in `directory` (the runtime's
    `step-N` directories with their manifest), or None."""
    try:
        names = [p.name for p in directory.iterdir() if p.name.startswith(CHECKPOINT_PREFIX)]
    except OSError:
        return None
    for name in sorted(names, key=lambda n: int(n[len(CHECKPOINT_PREFIX):]) if n[len(CHECKPOINT_PREFIX):].isdigit()
                       else -1, reverse=True):
        manifest = directory / name / CHECKPOINT_MANIFEST
        try:
            data = json.loads(manifest.read_text())
            step = int(data["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return {"lastStep": step, "lastTime": _utc(data.get("time"), manifest)}
    return None


def _utc(text: Any, manifest: Path) -> str:
    """The manifest's time in the API's form (`...Z`), or the manifest file's modification time."""
    try:
        moment = datetime.fromisoformat(str(text))
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    except ValueError:
        moment = datetime.fromtimestamp(manifest.stat().st_mtime, tz=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
