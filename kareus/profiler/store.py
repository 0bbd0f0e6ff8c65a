"""The profile store: an append-only JSON-lines log of measurements, one file per profile key.

Every measurement is appended (written through to the OS at once, fsync'ed after every batch) the
moment it is taken, before the search sees it. A profiling run that is killed loses at most the candidate being measured; rerunning replays the
search, and every candidate already in the log is answered from it instead of being measured again.
Because the searches are deterministic for a given seed and given measurements, the replay makes the
same choices and continues exactly where the killed run stopped. The log also lets a later job with
the same key reuse all measurements.

Lines are self-describing objects: `{"kind": "partition", "type", "clock_mhz", "comm_sms",
"launch_slot", "time_s", "energy_j"}` and `{"kind": "work", "what": "nonpartition"|"sequential",
"stage", "direction", "clock_mhz", "time_s", "energy_j"}`, after one `{"kind": "header", ...}` line.
A torn last line (a kill in the middle of a write) is ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kareus.errors import KareusError

PartitionKey = tuple[str, int, int, str]  # (type, clock_mhz, comm_sms, launch_slot)
WorkKey = tuple[str, int, str, int]  # (what, stage, direction, clock_mhz)


class ProfileStore:
    """Measurements of one profile key, in memory and (when `directory` is given) on disk."""

    def __init__(self, directory: str | Path | None, key: str, header: Mapping[str, Any] | None = None) -> None:
        self.key = key
        self.path = Path(directory) / f"{key}.jsonl" if directory is not None else None
        self.partitions: dict[PartitionKey, tuple[float, float]] = {}
        self.work: dict[WorkKey, tuple[float, float]] = {}
        self.loaded = 0
        self._log: Any = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._load()
            else:
                self._append({"kind": "header", "key": key, **(header or {})})

    def _load(self) -> None:
        assert self.path is not None
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):  # torn final line: the run was killed mid-write; drop it
            with self.path.open("r+b") as log:
                log.truncate(len(complete))
        for number, line in enumerate(complete.decode().splitlines(), 1):
            try:
                self._remember(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise KareusError(f"profile store {self.path}:{number}: bad record ({error})") from None

    def _remember(self, record: Mapping[str, Any]) -> None:
        kind = record.get("kind")
        value = (float(record.get("time_s", 0.0)), float(record.get("energy_j", 0.0)))
        if kind == "header":
            if record.get("key") != self.key:
                raise KareusError(f"profile store {self.path}: belongs to key {record.get('key')!r}, not {self.key!r}")
            return
        if kind == "partition":
            key = (record["type"], int(record["clock_mhz"]), int(record["comm_sms"]), record["launch_slot"])
            self.partitions[key] = value
        elif kind == "work":
            key2 = (record["what"], int(record["stage"]), record["direction"], int(record["clock_mhz"]))
            self.work[key2] = value
        else:
            return
        self.loaded += 1

    def _append(self, record: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        if self._log is None:
            self._log = self.path.open("a")
        # Written through to the kernel at once: a killed process loses nothing already measured.
        self._log.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._log.flush()

    def sync(self) -> None:
        """Make everything appended so far durable (also against a machine crash)."""
        if self._log is not None:
            os.fsync(self._log.fileno())

    def close(self) -> None:
        if self._log is not None:
            self.sync()
            self._log.close()
            self._log = None

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_partition(self, key: PartitionKey, time_s: float, energy_j: float) -> None:
        partition_type, clock_mhz, comm_sms, launch_slot = key
        self.partitions[key] = (time_s, energy_j)
        self._append({"kind": "partition", "type": partition_type, "clock_mhz": clock_mhz, "comm_sms": comm_sms,
                      "launch_slot": launch_slot, "time_s": time_s, "energy_j": energy_j})

    def add_work(self, key: WorkKey, time_s: float, energy_j: float) -> None:
        what, stage, direction, clock_mhz = key
        self.work[key] = (time_s, energy_j)
        self._append({"kind": "work", "what": what, "stage": stage, "direction": direction,
                      "clock_mhz": clock_mhz, "time_s": time_s, "energy_j": energy_j})
