"""One worker thread per GPU that applies the wanted clocks and power limits in order.

The socket side never waits for the GPU: it queues what it *wants* (a clock, or `None` for
"back to default") and returns. The worker applies the wants in the order they came, never
skipping one: a runtime sends an instruction's clock when the GPU reaches that instruction
(`kareus.runtime.clocking`), so every want is a clock the plan runs at. The one exception is a
want that is already *stale*: it carries `stale_after_s` (node monotonic time, when its instruction
is expected to be over), that time has passed and a newer want waits behind it — applying it
would only delay the clock that is due now. Those are counted (`stale_skipped`). Each want gets a
ticket, so a blocking request can wait until its ticket has been applied (or skipped as stale).

A board power limit is a want of its own kind (`want_power`: watts, or None for the board's
default), queued behind the clocks. The end of a lease (`want(None)`) restores both: the default
clocks if this worker locked them, the default power limit if it set one — the one release path
every restore rule (reset, disconnect, lease loss, shutdown) goes through.

The worker also owns the GPU's journal entry: it is written before the first lock or limit of a
lease (`acquire`; `journal_power_limit` adds that the lease limits power) and erased only after a
reset took effect with no newer want pending, all under the worker's lock, so a new lease can never
lose its entry to an old lease's reset.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kareus_node.journal import Journal

log = logging.getLogger("kareus_node")

MAX_QUEUED_WANTS = 4096  # a client that floods the queue loses its oldest wants, counted as stale


@dataclass(frozen=True)
class _Want:
    clock_mhz: int | None  # for a clock want; None: the lease ends (default clocks and power limit)
    ticket: int
    stale_after_s: float | None  # time.monotonic() after which it no longer matters (None: never)
    power: bool = False  # a power-limit want: `power_limit_w` (None: the board's default)
    power_limit_w: float | None = None

    @property
    def releases(self) -> bool:
        return not self.power and self.clock_mhz is None


class ClockWorker:
    def __init__(self, gpu: Any, journal: Journal, *, dry_run: bool = False) -> None:
        self.gpu = gpu
        self.uuid: str = gpu.uuid
        self._journal = journal
        self._dry_run = dry_run
        self._cond = threading.Condition()
        self._queue: deque[_Want] = deque()
        self._wanted_ticket = 0
        self._applied_ticket = 0
        self._applied: int | None = None  # what this worker last set (None: default clocks)
        self._applied_power_w: float | None = None  # the limit this worker set (None: the board's default)
        self._stopping = False
        self.clock_changes = 0
        self.power_limit_changes = 0
        self.stale_skipped = 0
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

    def journal_power_limit(self, power_limit_w: float) -> None:
        """Note in the lease's journal entry (durably) that it limits power, before any limit is set,
        so a restarted daemon restores the default limit too; a no-op in dry-run."""
        if self._dry_run:
            return
        with self._cond:
            entry = self._journal.entries().get(self.uuid, {})
            self._journal.record(self.uuid, {**entry, "power_limit_w": power_limit_w})

    def want(self, clock_mhz: int | None, *, stale_after_s: float | None = None) -> int:
        """Queue `clock_mhz` (None: the lease ends) behind the earlier wants; returns the ticket to wait on."""
        return self._queue_want(lambda ticket: _Want(clock_mhz, ticket, stale_after_s))

    def want_power(self, power_limit_w: float | None) -> int:
        """Queue a board power limit (None: the board's default) behind the earlier wants."""
        return self._queue_want(lambda ticket: _Want(None, ticket, None, power=True, power_limit_w=power_limit_w))

    def _queue_want(self, make: Any) -> int:
        with self._cond:
            self._wanted_ticket += 1
            if len(self._queue) >= MAX_QUEUED_WANTS:
                self._queue.popleft()
                self.stale_skipped += 1
            self._queue.append(make(self._wanted_ticket))
            self._cond.notify_all()
            return self._wanted_ticket

    def wait_applied(self, ticket: int, timeout_s: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._applied_ticket >= ticket or self._stopping, timeout_s)
            return self._applied_ticket >= ticket

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the queued wants, then end the thread."""
        with self._cond:
            self._cond.wait_for(lambda: self._applied_ticket >= self._wanted_ticket, timeout_s)
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                want = self._queue.popleft()
                stale = bool(self._queue) and want.stale_after_s is not None and time.monotonic() > want.stale_after_s
            if stale:
                self.stale_skipped += 1
            elif want.power:
                self._apply_power(want.power_limit_w)
            else:
                self._apply(want.clock_mhz)
                if want.releases:
                    self._apply_power(None)
            with self._cond:
                if want.releases and not stale and self._wanted_ticket == want.ticket and not self._dry_run:
                    self._erase_journal()
                self._applied_ticket = want.ticket
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

    def _apply_power(self, target_w: float | None) -> None:
        if target_w == self._applied_power_w:
            return
        try:
            if not self._dry_run:
                if target_w is None:
                    self.gpu.reset_power_limit()
                else:
                    self.gpu.set_power_limit_w(target_w)
            self._applied_power_w = target_w
            self.power_limit_changes += not self._dry_run
        except Exception as error:  # fail closed: back to the board's default limit
            self.last_error = f"{type(error).__name__}: {error}"
            log.error("GPU %s: cannot apply power limit %s W: %s; restoring the default", self.uuid, target_w,
                      self.last_error)
            try:
                self.gpu.reset_power_limit()
                self._applied_power_w = None
            except Exception as again:
                log.error("GPU %s: restoring the default power limit failed too: %s", self.uuid, again)

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
