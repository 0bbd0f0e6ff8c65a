"""`DaemonConnection`: one Unix-socket connection to the node daemon, one method per request.

Every method is a round trip: it sends one frame and returns the daemon's answer (or raises
`DaemonError` carrying the daemon's error code). Clock changes are *accepted* by the daemon before
they are applied unless ``wait=True`` is passed; that is the blocking variant. The lower-level
`send`/`receive` pair lets a caller pipeline requests (the runtime's `DaemonClockClient` does).

A lock lives exactly as long as the connection that took it: closing the connection (or the
process dying) makes the daemon reset the GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kareus.daemon_client import protocol
from kareus.errors import KareusError


class DaemonError(KareusError):
    """The daemon refused a request or could not be reached; `code` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"node daemon: {message}")
        self.code = code


@dataclass(frozen=True)
class GPUInfo:
    """One GPU as the daemon reports it to a particular caller."""

    uuid: str
    pci_bus_id: str
    name: str
    supported_clocks_mhz: tuple[int, ...]
    min_clock_mhz: int  # policy floor intersected with what the GPU supports
    max_clock_mhz: int  # policy ceiling intersected with what the GPU supports
    controllable: bool  # may this caller lock it?
    reason: str  # why not, when not controllable
    locked_clock_mhz: int | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GPUInfo:
        return cls(
            uuid=data["uuid"],
            pci_bus_id=data["pci_bus_id"],
            name=data["name"],
            supported_clocks_mhz=tuple(data["supported_clocks_mhz"]),
            min_clock_mhz=data["min_clock_mhz"],
            max_clock_mhz=data["max_clock_mhz"],
            controllable=data["controllable"],
            reason=data.get("reason", ""),
            locked_clock_mhz=data.get("locked_clock_mhz"),
        )


@dataclass(frozen=True)
class GPUReading:
    """A momentary reading of one GPU."""

    uuid: str
    energy_j: float  # cumulative counter since the driver loaded
    power_w: float
    sm_clock_mhz: int
    locked_clock_mhz: int | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GPUReading:
        return cls(
            uuid=data["uuid"],
            energy_j=data["energy_j"],
            power_w=data["power_w"],
            sm_clock_mhz=data["sm_clock_mhz"],
            locked_clock_mhz=data.get("locked_clock_mhz"),
        )


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise DaemonError(protocol.E_UNAVAILABLE, "connection closed by the daemon")
        chunks += chunk
    return bytes(chunks)


class DaemonConnection:
    """A connection to `kareus-node` on `socket_path`."""

    def __init__(self, socket_path: str, *, timeout_s: float = 5.0, job: str | None = None) -> None:
        self.socket_path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(socket_path)
        except OSError as error:
            self._sock.close()
            raise DaemonError(protocol.E_UNAVAILABLE, f"cannot connect to {socket_path}: {error.strerror or error}") from None
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        if job:
            self.call("hello", job=job)

    # -- framing -------------------------------------------------------------------------------
    def send(self, op: str, **fields: Any) -> int:
        """Send one request without waiting for its answer; returns its id."""
        with self._send_lock:
            request_id = next(self._ids)
            frame = protocol.encode_frame({"v": protocol.PROTOCOL_VERSION, "id": request_id, "op": op, **fields})
            try:
                self._sock.sendall(frame)
            except OSError as error:
                raise DaemonError(protocol.E_UNAVAILABLE, f"lost the connection to {self.socket_path}: {error}") from None
        return request_id

    def receive(self) -> dict[str, Any]:
        """The next answer from the daemon (any id)."""
        try:
            length = protocol.frame_length(_recv_exact(self._sock, protocol.HEADER.size))
            return protocol.decode_body(_recv_exact(self._sock, length))
        except protocol.ProtocolError as error:
            raise DaemonError(error.code, f"bad answer: {error}") from None
        except OSError as error:  # includes socket.timeout
            raise DaemonError(protocol.E_UNAVAILABLE, f"no answer from {self.socket_path}: {error}") from None

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """A round trip: send, wait for the answer with the same id, raise on refusal."""
        request_id = self.send(op, **fields)
        while True:
            reply = self.receive()
            if reply.get("id") in (request_id, 0):
                break
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise DaemonError(error.get("code", protocol.E_INTERNAL), error.get("message", "request failed"))
        return reply

    # -- requests ------------------------------------------------------------------------------
    def discover(self) -> list[GPUInfo]:
        return [GPUInfo.from_json(gpu) for gpu in self.call("discover")["gpus"]]

    def lock(self, gpu_uuids: Sequence[str], clock_mhz: int, *, wait: bool = False) -> dict[str, Any]:
        return self.call("lock", gpus=list(gpu_uuids), clock_mhz=int(clock_mhz), wait=wait)

    def reset(self, gpu_uuids: Sequence[str], *, wait: bool = False) -> dict[str, Any]:
        return self.call("reset", gpus=list(gpu_uuids), wait=wait)

    def read(self, gpu_uuids: Sequence[str]) -> list[GPUReading]:
        return [GPUReading.from_json(gpu) for gpu in self.call("read", gpus=list(gpu_uuids))["gpus"]]

    def upload_schedule(self, gpu_uuids: Sequence[str], clocks_mhz: Sequence[int]) -> dict[str, Any]:
        return self.call("schedule", gpus=list(gpu_uuids), clocks_mhz=[int(c) for c in clocks_mhz])

    def advance(self, *, wait: bool = False) -> dict[str, Any]:
        return self.call("next", wait=wait)

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def set_timeout(self, timeout_s: float | None) -> None:
        """Bound every later send/receive (None: wait as long as it takes)."""
        self._sock.settimeout(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes a thread blocked in receive(); close() does not
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
