"""Plan roll-out at a step boundary: a running job picks up a changed plan file.

When a running job's objective changes, the operator re-selects a plan from the stored frontier and
updates the plan ConfigMap; the kubelet swaps the mounted file. Every rank must switch to the new
plan at the *same* step (their instruction lists must agree, or the pipeline deadlocks), and on
another node the mounted file may lag. So only global rank 0 looks at the file, and tells the
others over the default process group:

1. before each step rank 0 polls the file — cheap: `stat` (inode, size, mtime, ctime), and only
   when that changed, the content's SHA-256 against the plan in use;
2. every rank takes part in a broadcast of a one-number header (the new plan's size in bytes, 0 for
   "no change"), then, on a change, of the plan bytes themselves;
3. every rank parses them (`Plan.loads` validates), builds its schedule and checks its own stage
   (layout, partition configs), and all ranks agree (all-reduce of the lowest refusing rank): the new plan is
   taken by all of them, or by none — rank 0 logs one line with the (lowest) refusing rank's
   reason — and training goes on with the old plan. A plan never crashes a running job.

`PlanFileWatcher` is rank 0's poll, `PlanRollout` the collective check, `broadcast_bytes` the
byte transport (also used for the degraded clock-control reason).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from kareus.errors import KareusError
from kareus.plan import Plan

log = logging.getLogger("kareus.runtime")
Built = TypeVar("Built")


def plan_digest(raw: bytes) -> str:
    """The SHA-256 of a plan file's bytes (hex)."""
    return hashlib.sha256(raw).hexdigest()


def read_plan(path: str | Path) -> tuple[Plan, str]:
    """Parse a plan file and return it with the digest of exactly the bytes parsed (so a watcher
    that starts later sees a change made in between)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise KareusError(f"cannot read plan {path}: {error.strerror or error}") from None
    return Plan.loads(raw, source=f"plan {path}"), plan_digest(raw)


@dataclass(frozen=True)
class _FileStamp:
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> _FileStamp:
        st = path.stat()  # follows the kubelet's `..data` symlink swap
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class PlanFileWatcher:
    """Rank 0's view of the plan file: `poll()` returns the new bytes when the content changed."""

    def __init__(self, path: str | Path, digest: str | None = None) -> None:
        self.path = Path(path)
        self._stamp: _FileStamp | None = None
        self.digest = digest
        if digest is None:  # no digest of the plan in use: take the file as it is now
            self._stamp, raw = self._read()
            self.digest = plan_digest(raw) if raw is not None else None

    def poll(self) -> bytes | None:
        """The file's bytes if its content differs from the last content seen, else None.

        A file that cannot be read (mid-swap, removed) counts as unchanged and is read again at
        the next poll; a changed content is reported once (an invalid plan is not re-sent every step).
        """
        try:
            stamp = _FileStamp.of(self.path)
        except OSError:
            return None
        if stamp == self._stamp:
            return None
        stamp, raw = self._read()
        if raw is None:
            return None
        self._stamp = stamp
        digest = plan_digest(raw)
        if digest == self.digest:
            return None
        self.digest = digest
        return raw

    def _read(self) -> tuple[_FileStamp | None, bytes | None]:
        try:
            stamp = _FileStamp.of(self.path)
            return stamp, self.path.read_bytes()
        except OSError:
            return None, None


def broadcast_bytes(data: bytes | None, src: int, device: torch.device) -> bytes:
    """Send `data` from rank `src` to every rank of the default group (all ranks call it;
    non-source ranks pass None). Two collectives: the length, then the bytes."""
    header = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(header, src=src)
    size = int(header[0])
    if size == 0:
        return b""
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    return buffer.cpu().numpy().tobytes()


@dataclass(frozen=True)
class Rollout(Generic[Built]):
    """A new plan every rank accepted: the plan, its digest, and what `build` made of it."""

    plan: Plan
    digest: str
    built: Built


class PlanRollout(Generic[Built]):
    """The per-step collective check of the plan file at `path` (rank 0 watches it, starting from
    the plan with `digest`). `build(plan)` turns a parsed plan into what this rank runs (its
    schedule) and raises `KareusError` when this rank cannot run it."""

    def __init__(self, path: str | Path, digest: str | None, build: Callable[[Plan], Built], *, rank: int = 0,
                 distributed: bool = False, device: torch.device | None = None) -> None:
        self.path = str(path)
        self.watcher = PlanFileWatcher(path, digest) if rank == 0 else None
        self.build = build
        self.rank = rank
        self.distributed = distributed
        self.device = device or torch.device("cpu")

    @property
    def digest(self) -> str | None:
        """Rank 0: the digest of the last content seen (None elsewhere)."""
        return self.watcher.digest if self.watcher else None

    def check(self, step: int) -> Rollout[Built] | None:
        """Collective: a new plan every rank can run, or None (no change, or rejected)."""
        raw = self.watcher.poll() if self.watcher else None
        if self.distributed:
            raw = broadcast_bytes(raw, 0, self.device) or None
        if raw is None:
            return None
        accepted, error = self._try(raw)
        refused_by = self._first_refusal(accepted is None)
        if refused_by is None:
            return accepted
        if self.distributed:
            error = broadcast_bytes(error.encode() if self.rank == refused_by else None, refused_by,
                                    self.device).decode(errors="replace")
        if self.rank == 0:
            log.error("new plan %s rejected before step %d, training continues on the previous plan: rank %d: %s",
                      self.path, step, refused_by, error)
        return None

    def _try(self, raw: bytes) -> tuple[Rollout[Built] | None, str]:
        try:
            plan = Plan.loads(raw, source=f"plan {self.path}")
            return Rollout(plan, plan_digest(raw), self.build(plan)), ""
        except KareusError as error:
            return None, " ".join(str(error).split())
        except Exception as error:  # a bad plan must never stop a running job
            return None, f"{type(error).__name__}: {' '.join(str(error).split())}"

    def _first_refusal(self, refused: bool) -> int | None:
        """The lowest rank that cannot run the plan (all ranks agree), or None."""
        if not self.distributed:
            return self.rank if refused else None
        world = dist.get_world_size()
        key = torch.tensor([world - self.rank if refused else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(key, op=dist.ReduceOp.MAX)
        return world - int(key[0]) if int(key[0]) else None
