"""The lease journal: which GPUs this daemon has locked, for whom, kept on disk.

NVML cannot tell whether a GPU's clock was locked, or by whom, so the daemon writes down every
GPU it is about to lock *before* locking it, and erases the entry only *after* the reset took
effect. A daemon that restarts (after a crash, an OOM kill, an upgrade) reads the journal and
resets exactly the GPUs it finds there; a GPU not in the journal was never touched by Kareus and
is never touched on restart.

Only lease acquisition and release are journaled, not every clock change inside a lease: for
restore it matters *that* a GPU is locked, not at which clock, and it keeps the per-instruction
path free of fsync. Writes are atomic: temp file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

JOURNAL_FILE = "leases.json"
JOURNAL_VERSION = 1


class JournalError(Exception):
    """The journal cannot be read or written; the daemon must not lock anything then."""


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new content."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class Journal:
    """Journaled leases, GPU UUID → entry (owner, clock, daemon pid)."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / JOURNAL_FILE
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise JournalError(f"state dir {self.path.parent}: {error.strerror or error}") from None
        self._entries = self._read()

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {uuid: dict(entry) for uuid, entry in self._entries.items()}

    def record(self, uuid: str, entry: Mapping[str, Any]) -> None:
        """Write down a lease; returns only once it is durable."""
        with self._lock:
            updated = {**self._entries, uuid: dict(entry)}
            self._write(updated)
            self._entries = updated

    def erase(self, uuid: str) -> None:
        with self._lock:
            if uuid not in self._entries:
                return
            updated = {k: v for k, v in self._entries.items() if k != uuid}
            self._write(updated)
            self._entries = updated

    def _read(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise JournalError(f"journal {self.path} is unreadable: {error}") from None
        if not isinstance(data, dict) or data.get("version") != JOURNAL_VERSION or not isinstance(data.get("leases"), dict):
            raise JournalError(f"journal {self.path} has an unknown format")
        return data["leases"]

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        try:
            write_json_atomic(self.path, {"version": JOURNAL_VERSION, "leases": entries})
        except OSError as error:
            raise JournalError(f"cannot write journal {self.path}: {error.strerror or error}") from None
