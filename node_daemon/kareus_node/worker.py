"""One worker thread per GPU that applies the latest wanted clock.

The socket side never waits for the GPU: it records what it *wants* (a clock, or `None` for
"back to default") and returns. The worker wakes up, takes the newest want — intermediate ones
are skipped, which is the right thing when a runtime asks faster than the driver can switch —
and applies it. Each want gets a ticket, so a blocking request can wait until its ticket (or a
newer one) has been applied.

The worker also owns the GPU's journal entry: it is written before the first lock of a lease
(`acquire`) and erased only after a reset took effect with no newer want pending, both under the
worker's lock, so a new lease can never lose its entry to an old lease's reset.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from kareus_node.journal import Journal

log = logging.getLogger("kareus_node")


class ClockWorker:
    def __init__(self, gpu: Any, journal: Journal, *, dry_run: bool = False) -> None:
        self.gpu = gpu
        self.uuid: str = gpu.uuid
        self._journal = journal
        self._dry_run = dry_run
        self._cond = threading.Condition()
        self._wanted: int | None = None
        self._wanted_ticket = 0
        self._applied_ticket = 0
        self._applied: int | None = None  # what this worker last set (None: default clocks)
        self._stopping = False
        self.clock_changes = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name=f"clock-{self.uuid}", daemon=True)
        self._thread.start()

    # -- called from the socket side ---------------------------------------------------------
    def acquire(self, entry: Mapping[str, Any]) -> None:
        """Journal a new lease (durably) before anything is locked; a no-op in dry-run."""
        if self._dry_run:
            return
        with self._cond:
            self._journal.record(self.uuid, entry)

    def want(self, clock_mhz: int | None) -> int:
        """Ask for `clock_mhz` (None: reset); returns the ticket to wait on."""
        with self._cond:
            self._wanted = clock_mhz
            self._wanted_ticket += 1
            self._cond.notify_all()
            return self._wanted_ticket

    def wait_applied(self, ticket: int, timeout_s: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._applied_ticket >= ticket or self._stopping, timeout_s)
            return self._applied_ticket >= ticket

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the pending want, then end the thread."""
        with self._cond:
            self._cond.wait_for(lambda: self._applied_ticket >= self._wanted_ticket, timeout_s)
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted_ticket > self._applied_ticket or self._stopping)
                if self._stopping:
                    return
                target, ticket = self._wanted, self._wanted_ticket
            self._apply(target)
            with self._cond:
                if target is None and self._wanted_ticket == ticket and not self._dry_run:
                    self._erase_journal()
                self._applied_ticket = ticket
                self._cond.notify_all()

    def _apply(self, target: int | None) -> None:
        if target == self._applied:
            return
        try:
            if not self._dry_run:
                if target is None:
                    self.gpu.reset_sm_clock()
                else:
                    self.gpu.lock_sm_clock(target, target)
            self._applied = target
            self.clock_changes += not self._dry_run  # dry-run only pretends: nothing changed
        except Exception as error:  # NVML failure: fail closed, back to default clocks
            self.last_error = f"{type(error).__name__}: {error}"
            log.error("GPU %s: cannot apply clock %s: %s; resetting", self.uuid, target, self.last_error)
            self._reset_after_failure()

    def _reset_after_failure(self) -> None:
        try:
            self.gpu.reset_sm_clock()
            self._applied = None
        except Exception as error:
            log.error("GPU %s: reset failed too: %s", self.uuid, error)

    def _erase_journal(self) -> None:
        try:
            self._journal.erase(self.uuid)
        except Exception as error:  # the entry stays; a restart resets the GPU again (harmless)
            log.error("GPU %s: cannot erase journal entry: %s", self.uuid, error)
