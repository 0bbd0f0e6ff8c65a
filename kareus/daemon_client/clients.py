"""What the training runtime talks to when it wants a GPU clock: a `ClockClient`.

The runtime asks for one SM clock per pipeline instruction (forward or backward of one
microbatch), ahead of the instruction, and must never stall or crash because of it: a clock is an
energy optimisation, not a correctness requirement. So every client here is non-blocking and
never raises from the training path; a client that lost its daemon becomes *degraded* (training
goes on at default clocks) and says why.

- `NullClockClient`: no daemon; does nothing.
- `RecordingClockClient`: keeps a log of what was asked and when (tests, dry runs).
- `DaemonClockClient`: sends the requests over a `DaemonConnection` without waiting for the
  answers; a reader thread collects the acknowledgements and any refusals, and over TCP a keeper
  thread hands the daemon the kubelet's rotated token even while no request is sent.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kareus.daemon_client import connection as _connection
from kareus.daemon_client.connection import DaemonConnection, DaemonError, power_limit_fields

log = logging.getLogger("kareus.daemon_client")

MAX_KEPT_ERRORS = 32


class ClockClient(ABC):
    """Per-instruction GPU clock requests from one training process for its GPUs."""

    @abstractmethod
    def request_clock(self, clock_mhz: int, *, instruction: str, stale_after_s: float | None = None) -> None:
        """Ask for `clock_mhz` for the instruction about to run; returns without waiting.
        `stale_after_s` (`time.monotonic()`): when the instruction is expected to be over — a daemon
        that fell behind may skip the request after that time, once a newer one is waiting."""

    @abstractmethod
    def upload_schedule(self, clocks_mhz: Sequence[int]) -> None:
        """Hand over the cyclic per-instruction clock list once; then `advance` per instruction."""

    @abstractmethod
    def advance(self) -> None:
        """Switch to the next clock of the uploaded schedule (wrapping around)."""

    @abstractmethod
    def set_power_limit(self, watts: float | None) -> None:
        """Limit every GPU of this client to `watts` (None: the board's default); returns without
        waiting. The limit holds under the clocks' lease: `reset` and `close` restore the default."""

    @abstractmethod
    def reset(self) -> None:
        """Give the GPUs back to default clocks and power limits."""

    @abstractmethod
    def close(self) -> None:
        """Reset and release the daemon connection; the client is unusable afterwards."""

    @property
    def degraded(self) -> bool:
        """True when clock requests are not reaching the GPUs (no daemon, refused, lost)."""
        return False

    @property
    def degraded_reason(self) -> str:
        return ""

    def __enter__(self) -> ClockClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class NullClockClient(ClockClient):
    """No clock control: every call does nothing and never fails."""

    def __init__(self, reason: str = "") -> None:
        self._reason = reason

    def request_clock(self, clock_mhz: int, *, instruction: str, stale_after_s: float | None = None) -> None:
        pass

    def upload_schedule(self, clocks_mhz: Sequence[int]) -> None:
        pass

    def advance(self) -> None:
        pass

    def set_power_limit(self, watts: float | None) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def degraded(self) -> bool:
        return bool(self._reason)

    @property
    def degraded_reason(self) -> str:
        return self._reason


@dataclass(frozen=True)
class ClockRecord:
    """One request seen by a `RecordingClockClient`; `clock_mhz` is None for a reset."""

    instruction: str
    clock_mhz: int | None
    time_s: float  # time.monotonic() when it was asked
    power_limit_w: float | None = None  # for instruction "power_limit" (None there: the default)


class RecordingClockClient(ClockClient):
    """Remembers every request; `advance` records the schedule entry it switches to."""

    def __init__(self) -> None:
        self.log: list[ClockRecord] = []
        self.schedule_mhz: tuple[int, ...] = ()
        self._cursor = 0
        self.closed = False

    def request_clock(self, clock_mhz: int, *, instruction: str, stale_after_s: float | None = None) -> None:
        self.log.append(ClockRecord(instruction, int(clock_mhz), time.monotonic()))

    def upload_schedule(self, clocks_mhz: Sequence[int]) -> None:
        self.schedule_mhz = tuple(int(c) for c in clocks_mhz)
        self._cursor = 0

    def advance(self) -> None:
        if not self.schedule_mhz:
            return
        index = self._cursor % len(self.schedule_mhz)
        self.log.append(ClockRecord(f"schedule[{index}]", self.schedule_mhz[index], time.monotonic()))
        self._cursor += 1

    def set_power_limit(self, watts: float | None) -> None:
        self.log.append(ClockRecord("power_limit", None, time.monotonic(), None if watts is None else float(watts)))

    def reset(self) -> None:
        self.log.append(ClockRecord("reset", None, time.monotonic()))

    def close(self) -> None:
        if not self.closed:
            self.reset()
            self.closed = True

    def clocks_mhz(self) -> list[int | None]:
        """Just the requested clocks, in order."""
        return [record.clock_mhz for record in self.log]


class DaemonClockClient(ClockClient):
    """Pipelined clock requests to `kareus-node` for `gpu_uuids`.

    Requests are written to the socket and the call returns; the daemon acknowledges on receipt
    and applies asynchronously. A repeated request for the clock already asked for is not sent.
    `flush()` waits until the daemon has acknowledged everything sent so far (tests, shutdown).
    """

    def __init__(self, connection: DaemonConnection, gpu_uuids: Sequence[str]) -> None:
        self._connection = connection
        connection.set_timeout(None)  # the reader waits for acks however long training is idle
        self.gpu_uuids = tuple(gpu_uuids)
        self._last_clock_mhz: int | None = None
        self._outstanding = 0
        self._acked = threading.Condition()
        self.errors: deque[str] = deque(maxlen=MAX_KEPT_ERRORS)
        self._reason = ""
        self._closed = False
        self._reader = threading.Thread(target=self._read_acks, name="kareus-clock-acks", daemon=True)
        self._reader.start()
        self._stopped = threading.Event()
        if connection.token_file is not None:
            threading.Thread(target=self._keep_token, name="kareus-clock-token", daemon=True).start()

    # -- the runtime's calls -------------------------------------------------------------------
    def request_clock(self, clock_mhz: int, *, instruction: str, stale_after_s: float | None = None) -> None:
        clock_mhz = int(clock_mhz)
        if clock_mhz == self._last_clock_mhz:
            return
        self._last_clock_mhz = clock_mhz
        extra = {} if stale_after_s is None else {"stale_after_s": float(stale_after_s)}
        self._send("lock", gpus=list(self.gpu_uuids), clock_mhz=clock_mhz, wait=False, **extra)

    def upload_schedule(self, clocks_mhz: Sequence[int]) -> None:
        self._send("schedule", gpus=list(self.gpu_uuids), clocks_mhz=[int(c) for c in clocks_mhz])

    def advance(self) -> None:
        self._last_clock_mhz = None  # the schedule moved the clock; a later request must be sent
        self._send("next", wait=False)

    def set_power_limit(self, watts: float | None) -> None:
        self._send("power_limit", gpus=list(self.gpu_uuids), wait=False, **power_limit_fields(watts))

    def reset(self) -> None:
        self._last_clock_mhz = None
        self._send("reset", gpus=list(self.gpu_uuids), wait=False)

    def close(self) -> None:
        if self._closed:
            return
        self.reset()
        self.flush()
        self._closed = True
        self._stopped.set()
        self._connection.close()  # the daemon resets whatever this connection still held
        self._reader.join(timeout=2.0)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every request sent so far was acknowledged; False on timeout or loss."""
        deadline = time.monotonic() + timeout_s
        with self._acked:
            while self._outstanding > 0 and not self._reason:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._acked.wait(remaining)
            return self._outstanding == 0

    @property
    def degraded(self) -> bool:
        return bool(self._reason) or bool(self.errors)

    @property
    def degraded_reason(self) -> str:
        return self._reason or (self.errors[-1] if self.errors else "")

    # -- plumbing ------------------------------------------------------------------------------
    def _send(self, op: str, **fields: object) -> None:
        if self._reason or self._closed:
            return
        try:
            # Over TCP the kubelet rotates the pod's token; a connection that lives for days must
            # hand the daemon the current one before the old one stops validating.
            with self._acked:
                self._outstanding += 1
            self._refresh_token()
            self._connection.send(op, **fields)
        except DaemonError as error:
            self._degrade(str(error))

    def _refresh_token(self) -> None:
        """Send the token file's new content, if it changed (looked at every TOKEN_RECHECK_S)."""
        with self._acked:
            self._outstanding += 1  # the hello is answered like any request; counted before its answer
        if not self._connection.refresh_token():
            with self._acked:
                self._outstanding = max(0, self._outstanding - 1)
                self._acked.notify_all()

    def _keep_token(self) -> None:
        """A plan at one clock sends one lock, then nothing for hours; the daemon re-reviews the
        session's token and ends the lease once it expires. So the rotated token goes out on its
        own schedule too, not only before a request."""
        while not self._stopped.wait(_connection.TOKEN_RECHECK_S):
            if self._reason or self._closed:
                return
            try:
                self._refresh_token()
            except DaemonError as error:
                if not self._closed:  # a close racing the look is no loss
                    self._degrade(str(error))
                return

    def _read_acks(self) -> None:
        while True:
            try:
                reply = self._connection.receive()
            except DaemonError as error:
                if not self._closed:
                    self._degrade(str(error))
                return
            if not reply.get("ok"):
                message = (reply.get("error") or {}).get("message", "request refused")
                if not self.errors:
                    log.warning("clock request refused, training continues at the current clock: %s", message)
                self.errors.append(message)
            with self._acked:
                self._outstanding = max(0, self._outstanding - 1)
                self._acked.notify_all()

    def _degrade(self, reason: str) -> None:
        if not self._reason:
            log.warning("clock control degraded, training continues at default clocks: %s", reason)
        with self._acked:
            self._reason = reason
            self._acked.notify_all()
