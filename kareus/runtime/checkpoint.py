"""Checkpoints: a run's work kept on disk, so a restart resumes instead of starting over.

A checkpoint is one directory `DIR/step-NNNNNNNN` (N = steps completed) written with
`torch.distributed.checkpoint`: every rank writes its own part (its stage's, its TP shard's
parameters and optimizer state, its RNG state; a part several data-parallel replicas hold alike is
written once). The parameters are the ones the optimizer steps: in bf16 the fp32 master weights
(`kareus.runtime.precision`), so a resumed bf16 run continues from the exact weights. The
learning-rate schedule needs no state of its own: it is a function of the step. Beside it, `kareus-checkpoint.json` (the manifest) names what the state belongs to: the
job, the trained model's shape and sequence length, the layout, the optimizer and dtype, the data, the
plan revision it ran under, and every file with its size and SHA-256.

Only complete checkpoints count: the ranks write into `DIR/.partial-step-N`, rank 0 adds the
manifest last and renames the directory into place, so a save killed midway leaves a partial
directory (ignored, removed by the next save) and the previous checkpoint intact. The last `keep`
complete checkpoints stay. On resume the newest checkpoint whose manifest and files check out is
loaded; a damaged one (unreadable manifest, a file missing or not what the manifest says) is skipped
with a warning naming why; a foreign one (another job, model shape, layout, optimizer, dtype or
data) is one clear error naming what differs — never a silent wrong resume.

The data position is the step: batches are drawn from `(seed, step)` (`kareus.runtime.data`), so a
run resumed at step N reads exactly the sequences an uninterrupted run reads from step N on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kareus.errors import EXIT_CONFIG, KareusError

log = logging.getLogger("kareus.runtime")
MANIFEST = "kareus-checkpoint.json"
FORMAT_VERSION = 1
_PREFIX = "step-"
_PARTIAL = ".partial-"


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often: `every_steps` (0: only on a graceful stop), the last `keep` kept."""

    directory: str
    every_steps: int = 0
    keep: int = 2

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise KareusError(f"--checkpoint-every must be >= 0 (0: only on SIGTERM), got {self.every_steps}")
        if self.keep < 1:
            raise KareusError(f"--checkpoint-keep must be >= 1, got {self.keep}")

    def due(self, steps_done: int) -> bool:
        """Save after `steps_done` steps? Every `every_steps` (the last step too: a later run with a
        larger --steps goes on from there)."""
        return bool(self.every_steps) and steps_done % self.every_steps == 0


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must agree with to be resumed: a difference in any field is a foreign checkpoint."""

    job: str
    model: dict[str, Any]
    layout: dict[str, Any]
    optimizer: str
    dtype: str
    data: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"job": self.job, "model": self.model, "layout": self.layout, "optimizer": self.optimizer,
                "dtype": self.dtype, "data": self.data}

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """What differs from a manifest's identity, in words ('layout.tp: checkpoint 1, this run 2')."""
        return _diff("", saved, self.as_dict())


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run continues from."""

    path: Path
    step: int  # steps completed: the run goes on with step `step`
    plan_revision: int
    plan_digest: str | None


@dataclass(frozen=True)
class TrainState:
    """A rank's live training state: what a checkpoint saves and restores in place."""

    params: dict[str, torch.nn.Parameter]  # what the optimizer steps (fp32 masters in bf16), by model name
    optimizer: torch.optim.Optimizer
    tp_rank: int
    tp: int
    rank: int

    def state_dict(self, *, for_load: bool = False) -> dict[str, Any]:
        """DCP keys: a parameter's name with its TP shard (`model/layers.3.fc1/tp0of2`), the optimizer's
        state per parameter, and this rank's RNG state. `for_load`: the optimizer state this run will
        need is created (zeros) so DCP can load into it."""
        shard = f"tp{self.tp_rank}of{self.tp}"
        out: dict[str, Any] = {}
        for name, param in self.params.items():
            out[f"model/{name}/{shard}"] = param.data
            for key, value in self._optimizer_state(param, for_load).items():
                out[f"optim/{name}/{shard}/{key}"] = value
        out[f"rng/rank{self.rank}"] = torch.get_rng_state()
        if self._cuda:
            out[f"rng/rank{self.rank}/cuda"] = torch.cuda.get_rng_state()
        return out

    @property
    def _cuda(self) -> bool:
        return any(p.device.type == "cuda" for p in self.params.values())

    def restore(self, loaded: dict[str, Any]) -> None:
        """After DCP loaded into `state_dict(for_load=True)`: the RNG state (parameters and optimizer
        tensors were loaded in place)."""
        torch.set_rng_state(loaded[f"rng/rank{self.rank}"])
        if self._cuda:
            torch.cuda.set_rng_state(loaded[f"rng/rank{self.rank}/cuda"])

    def _optimizer_state(self, param: torch.nn.Parameter, for_load: bool) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(param)
        if state is None and for_load:
            state = _empty_state(self.optimizer, param)
            if state:
                self.optimizer.state[param] = state
        return {k: v for k, v in (state or {}).items() if isinstance(v, torch.Tensor)}


def _empty_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The per-parameter state the optimizer creates at its first step, zeroed (DCP loads into it)."""
    if isinstance(optimizer, torch.optim.AdamW | torch.optim.Adam):
        return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(param.data),
                "exp_avg_sq": torch.zeros_like(param.data)}
    if isinstance(optimizer, torch.optim.SGD):
        momentum = optimizer.param_groups[0].get("momentum", 0)
        return {"momentum_buffer": torch.zeros_like(param.data)} if momentum else {}
    raise KareusError(f"checkpoints do not know the state of optimizer {type(optimizer).__name__}")


class Checkpointer:
    """Saves and finds this job's checkpoints; every rank makes the same calls in the same order."""

    def __init__(self, settings: CheckpointSettings, identity: Identity, *, rank: int, world: int,
                 provenance: dict[str, Any] | None = None) -> None:
        self.settings, self.identity = settings, identity
        # Written into every manifest, never compared on resume: where the weights came from
        # (`init_from`), so `kareus export` can find the tokenizer of the model the run started from.
        self.provenance = dict(provenance or {})
        self.root = Path(settings.directory)
        self.rank, self.world = rank, world

    # saving ---------------------------------------------------------------------------------

    def save(self, state: TrainState, step: int, *, plan_revision: int, plan_digest: str | None,
             reason: str) -> Path:
        """Write the checkpoint after `step` completed steps (collective); returns its directory."""
        started = time.perf_counter()
        final = self.root / f"{_PREFIX}{step:08d}"
        partial = self.root / f"{_PARTIAL}{_PREFIX}{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{_PARTIAL}*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()
        with _one_process_quietly(self.world):
            dcp.save(state.state_dict(), checkpoint_id=str(partial), no_dist=self.world == 1)
        self._barrier()
        files = self._gather(self._digest_share(partial))
        if self.rank == 0:
            manifest = {"version": FORMAT_VERSION, "step": step, "reason": reason,
                        "time": datetime.now(UTC).isoformat(timespec="seconds"), "plan_revision": plan_revision,
                        "plan_digest": plan_digest, "world_size": self.world, **self.provenance,
                        **self.identity.as_dict(),
                        "files": files}
            _write_durably(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            replaced = None
            if final.exists():  # this step saved again: a run resumed from before a damaged checkpoint
                replaced = self.root / f"{_PARTIAL}replaced-{final.name}"  # a directory cannot replace a full one
                os.replace(final, replaced)
            os.replace(partial, final)
            _fsync_dir(self.root)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._prune()
            log.info("checkpoint after step %d (%s): %s in %.2f s", step, reason, final,
                     time.perf_counter() - started)
        self._barrier()
        return final

    def _prune(self) -> None:
        for old in self.complete()[self.settings.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def _digest_share(self, directory: Path) -> dict[str, dict[str, Any]]:
        """Size and SHA-256 of this rank's share of the files (every world-th, by name)."""
        names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
        return {name: _file_entry(directory / name) for name in names[self.rank::self.world]}

    # resuming -------------------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """Complete checkpoint directories (those with a manifest), newest first."""
        return complete_checkpoints(self.root)

    def resume(self, state: TrainState, total_steps: int) -> Resumed | None:
        """Load the newest usable checkpoint into `state` (collective); None when there is none."""
        skipped: list[str] = []
        for path in self._agree(self.complete() if self.rank == 0 else None):
            kind, problem = self._agree(self._check_manifest(path) if self.rank == 0 else None)
            if kind == "foreign":
                raise KareusError(f"--checkpoint-dir {self.root}: checkpoint {path.name} is not this run's: "
                                  f"{problem}", exit_code=EXIT_CONFIG)
            if problem is None:
                problem = self._agree_any(self._check_files(path))
            if problem is not None:
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s", path, problem)
                skipped.append(f"{path.name}: {problem}")
                continue
            manifest = json.loads((path / MANIFEST).read_text())
            if "init_from" in manifest and "init_from" not in self.provenance:  # a resume without --init-from
                self.provenance["init_from"] = manifest["init_from"]
            if manifest["step"] > total_steps:
                raise KareusError(f"--checkpoint-dir {self.root}: checkpoint {path.name} is after step "
                                  f"{manifest['step']}, beyond --steps {total_steps} (the total, not steps to add)")
            target = state.state_dict(for_load=True)
            with _one_process_quietly(self.world):
                dcp.load(target, checkpoint_id=str(path), no_dist=self.world == 1)
            state.restore(target)
            return Resumed(path, int(manifest["step"]), int(manifest.get("plan_revision", 0)),
                           manifest.get("plan_digest"))
        if skipped:
            raise KareusError(f"--checkpoint-dir {self.root}: no usable checkpoint ({'; '.join(skipped)}); "
                              f"remove the damaged ones to start from step 0", exit_code=EXIT_CONFIG)
        return None

    def _check_manifest(self, path: Path) -> tuple[str, str | None]:
        """Rank 0: ("ok", None), ("damaged", why) or ("foreign", what differs) for `path`."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            files, step = dict(manifest["files"]), int(manifest["step"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            return "damaged", f"its manifest {MANIFEST} is damaged ({type(error).__name__}: {error})"
        if manifest.get("version") != FORMAT_VERSION:
            return "damaged", f"format version {manifest.get('version')!r}, this runtime reads {FORMAT_VERSION}"
        if step != int(path.name[len(_PREFIX):]):
            return "damaged", f"its manifest says step {step}, its name another"
        differences = self.identity.differences({k: manifest.get(k) for k in self.identity.as_dict()})
        if differences:
            return "foreign", "; ".join(differences)
        try:
            present = {p.name for p in path.iterdir() if p.name != MANIFEST}
            if missing := sorted(set(files) - present):
                return "damaged", f"file {missing[0]} is missing"
            for name, entry in sorted(files.items()):
                size = (path / name).stat().st_size
                if size != entry.get("size_bytes"):
                    return "damaged", f"file {name} has {size} bytes, the manifest says {entry.get('size_bytes')}"
        except (OSError, AttributeError) as error:  # every rank waits for this verdict: never raise past it
            return "damaged", f"cannot check its files ({type(error).__name__}: {error})"
        return "ok", None

    def _check_files(self, path: Path) -> str | None:
        """This rank's share of the SHA-256 checks."""
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
            for name in sorted(files)[self.rank::self.world]:
                if _sha256(path / name) != files[name]["sha256"]:
                    return f"file {name} does not match its SHA-256 in the manifest"
        except (OSError, ValueError, KeyError, TypeError) as error:  # the others wait for this rank's answer
            return f"cannot check its files ({type(error).__name__}: {error})"
        return None

    # collectives ----------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _agree(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree_any(self, problem: str | None) -> str | None:
        """The lowest rank's problem, if any rank has one."""
        if self.world == 1:
            return problem
        problems: list[str | None] = [None] * self.world
        dist.all_gather_object(problems, problem)
        return next((f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None), None)

    def _gather(self, share: dict[str, Any]) -> dict[str, Any]:
        if self.world == 1:
            return share
        shares: list[dict[str, Any] | None] = [None] * self.world
        dist.all_gather_object(shares, share)
        return {name: entry for part in shares for name, entry in (part or {}).items()}


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoint directories (`step-N` with a manifest) under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
             and p.name[len(_PREFIX):].isdigit() and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True)


@contextlib.contextmanager
def _one_process_quietly(world: int):
    """DCP warns that it assumes one process without a process group: that is what no_dist says."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _diff(prefix: str, saved: Any, mine: Any) -> list[str]:
    if isinstance(saved, dict) and isinstance(mine, dict):
        return [d for key in sorted(set(saved) | set(mine))
                for d in _diff(f"{prefix}.{key}" if prefix else key, saved.get(key), mine.get(key))]
    if isinstance(saved, list | tuple) and isinstance(mine, list | tuple):
        saved, mine = list(saved), list(mine)
    return [] if saved == mine else [f"{prefix}: checkpoint {saved!r}, this run {mine!r}"]


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size_bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
