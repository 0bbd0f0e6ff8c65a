"""`DaemonConnection`: one connection to the node daemon, one method per request.

The daemon is reached at an *endpoint*: a Unix socket path (`/run/kareus/node.sock`, the hostPath
a privileged or standalone setup mounts) or ``tcp://HOST:PORT`` (the node's address, what pods
admitted under Pod Security `restricted` use). Over TCP the first frame is a ``hello`` carrying
the pod's projected ServiceAccount token (audience ``kareus-node``), read from the token file at
every connect — and re-sent by `refresh_token` when the kubelet has rotated it — since the daemon
cannot ask the kernel who is calling. The TCP hop is plaintext (docs/node-daemon.md says why and
what that exposes).

Environment (what the operator's pod specs set): `KAREUS_DAEMON_ADDRESS` (``HOST:PORT``, wins),
`KAREUS_DAEMON_SOCKET`, `KAREUS_DAEMON_TOKEN_FILE` (default `/var/run/secrets/kareus.dev/node/token`).

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
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.daemon_client import protocol
from kareus.errors import KareusError

ENV_ADDRESS = "KAREUS_DAEMON_ADDRESS"
ENV_SOCKET = "KAREUS_DAEMON_SOCKET"
ENV_TOKEN_FILE = "KAREUS_DAEMON_TOKEN_FILE"
DEFAULT_TOKEN_FILE = "/var/run/secrets/kareus.dev/node/token"
TCP_PREFIX = "tcp://"
TOKEN_RECHECK_S = 30.0  # how often a long-lived connection looks whether the kubelet rotated the token
# How long `open_connection` keeps asking while the daemon answers "unavailable" (it cannot check
# the caller yet: the pod's address not yet reported, the API server briefly away).
UNAVAILABLE_WAIT_S = 60.0

log = logging.getLogger("kareus.daemon_client")


def daemon_endpoint(socket_path: str | None = None, address: str | None = None) -> str | None:
    """The endpoint for a `--daemon-socket`/`--daemon-address` pair: the address (``tcp://HOST:PORT``)
    when given, else the socket path, else None (no clock control)."""
    if address:
        return address if address.startswith(TCP_PREFIX) else TCP_PREFIX + address
    return socket_path or None


def endpoint_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The endpoint the environment names (`KAREUS_DAEMON_ADDRESS` wins over `KAREUS_DAEMON_SOCKET`)."""
    env = os.environ if env is None else env
    return daemon_endpoint(env.get(ENV_SOCKET), env.get(ENV_ADDRESS))


def parse_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://HOST:PORT`` endpoint (``[v6]:PORT`` too); None for a socket path."""
    if not endpoint.startswith(TCP_PREFIX):
        return None
    host, sep, port = endpoint[len(TCP_PREFIX):].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdecimal() or not 0 < int(port) <= 65535:
        raise DaemonError("invalid", f"daemon address {endpoint[len(TCP_PREFIX):]!r} is not HOST:PORT")
    return host, int(port)


class DaemonError(KareusError):
    """The daemon refused a request or could not be reached; `code` is a protocol error code."""

    def __init__(self, code: str, message: str, *, answered: bool = False) -> None:
        super().__init__(f"node daemon: {message}")
        self.code = code
        self.answered = answered  # the daemon's own answer, not a connection that failed


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
    min_power_limit_w: float | None = None  # the board's settable power limits (None: an older daemon,
    max_power_limit_w: float | None = None  # or a board that cannot say)
    default_power_limit_w: float | None = None

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
            min_power_limit_w=data.get("min_power_limit_w"),
            max_power_limit_w=data.get("max_power_limit_w"),
            default_power_limit_w=data.get("default_power_limit_w"),
        )


@dataclass(frozen=True)
class GPUReading:
    """A momentary reading of one GPU."""

    uuid: str
    energy_j: float  # cumulative counter since the driver loaded
    power_w: float
    sm_clock_mhz: int
    locked_clock_mhz: int | None
    power_limit_w: float | None = None  # the board limit in force (None: an older daemon)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GPUReading:
        return cls(
            uuid=data["uuid"],
            energy_j=data["energy_j"],
            power_w=data["power_w"],
            sm_clock_mhz=data["sm_clock_mhz"],
            locked_clock_mhz=data.get("locked_clock_mhz"),
            power_limit_w=data.get("power_limit_w"),
        )


def open_connection(endpoint: str, *, wait_s: float = UNAVAILABLE_WAIT_S, **options: Any) -> DaemonConnection:
    """A `DaemonConnection` (`options` are its own), asked again for up to `wait_s` while the
    daemon answers the hello "unavailable": it fails closed on facts it cannot establish yet,
    and those come (a pod's first seconds) or come back. A daemon that cannot be reached, or
    that refuses, is answered at once."""
    deadline = time.monotonic() + wait_s
    delay_s = 0.5
    while True:
        try:
            return DaemonConnection(endpoint, **options)
        except DaemonError as error:
            if not (error.answered and error.code == protocol.E_UNAVAILABLE) or time.monotonic() + delay_s > deadline:
                raise
            log.info("%s; asking again in %.1f s", error, delay_s)
        time.sleep(delay_s)
        delay_s = min(2 * delay_s, 5.0)


def power_limit_fields(watts: float | None) -> dict[str, Any]:
    """The fields of a ``power_limit`` request: ``watts``, or ``reset: true`` for None."""
    return {"reset": True} if watts is None else {"watts": float(watts)}


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise DaemonError(protocol.E_UNAVAILABLE, "connection closed by the daemon")
        chunks += chunk
    return bytes(chunks)


def receive_frame(sock: socket.socket) -> dict[str, Any]:
    """One frame's body off a raw socket (`DaemonError` when the daemon closed it, `ProtocolError` for a
    malformed frame, `OSError` from the socket)."""
    length = protocol.frame_length(_recv_exact(sock, protocol.HEADER.size))
    return protocol.decode_body(_recv_exact(sock, length))


class DaemonConnection:
    """A connection to `kareus-node` at `endpoint`: a Unix socket path or ``tcp://HOST:PORT``.

    Over TCP, `token_file` (default `$KAREUS_DAEMON_TOKEN_FILE`, else the standard mount path) is
    read now and sent in the ``hello``."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, job: str | None = None,
                 token_file: str | None = None) -> None:
        self.socket_path = endpoint  # the endpoint, whatever kind (the name predates TCP)
        self.endpoint = endpoint
        address = parse_address(endpoint)
        self.token_file = (token_file or os.environ.get(ENV_TOKEN_FILE) or DEFAULT_TOKEN_FILE) if address else None
        self._token = self._read_token() if address else ""
        self._token_checked_at = time.monotonic()
        try:
            self._sock = self._open(address, timeout_s)
        except OSError as error:
            what = error.strerror or error
            raise DaemonError(protocol.E_UNAVAILABLE, f"cannot connect to {self._shown()}: {what}") from None
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._token_lock = threading.Lock()  # the training thread and the clock client's keeper both look
        try:
            if address:  # the daemon answers nothing else before this
                self.call("hello", job=job or "", token=self._token)
            elif job:
                self.call("hello", job=job)
        except DaemonError:
            self._sock.close()
            raise

    def _open(self, address: tuple[str, int] | None, timeout_s: float) -> socket.socket:
        if address is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(self.endpoint)
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection(address, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small frame per clock change
        return sock

    def _shown(self) -> str:
        return self.endpoint.removeprefix(TCP_PREFIX)

    def _read_token(self) -> str:
        """The token file's content now (the kubelet rotates it); "" when unreadable — the daemon
        then answers with its refusal, which says what is missing."""
        try:
            with open(self.token_file or "", encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError:
            return ""

    def refresh_token(self, *, force: bool = False) -> bool:
        """Over TCP: when the token file changed since it was last sent (looked at most every
        TOKEN_RECHECK_S unless `force`), send a ``hello`` with the new token without waiting for
        the answer, so a connection outlives its first token. True when one was sent."""
        if self.token_file is None:
            return False
        with self._token_lock:
            now = time.monotonic()
            if not force and now - self._token_checked_at < TOKEN_RECHECK_S:
                return False
            self._token_checked_at = now
            token = self._read_token()
            if not token or token == self._token:
                return False
            self._token = token
            self.send("hello", token=token)
            return True

    # -- framing -------------------------------------------------------------------------------
    def send(self, op: str, **fields: Any) -> int:
        """Send one request without waiting for its answer; returns its id."""
        with self._send_lock:
            request_id = next(self._ids)
            frame = protocol.encode_frame({"v": protocol.PROTOCOL_VERSION, "id": request_id, "op": op, **fields})
            try:
                self._sock.sendall(frame)
            except OSError as error:
                raise DaemonError(protocol.E_UNAVAILABLE, f"lost the connection to {self._shown()}: {error}") from None
        return request_id

    def receive(self) -> dict[str, Any]:
        """The next answer from the daemon (any id)."""
        try:
            return receive_frame(self._sock)
        except protocol.ProtocolError as error:
            raise DaemonError(error.code, f"bad answer: {error}") from None
        except OSError as error:  # includes socket.timeout
            raise DaemonError(protocol.E_UNAVAILABLE, f"no answer from {self._shown()}: {error}") from None

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """A round trip: send, wait for the answer with the same id, raise on refusal."""
        request_id = self.send(op, **fields)
        while True:
            reply = self.receive()
            if reply.get("id") in (request_id, 0):
                break
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise DaemonError(error.get("code", protocol.E_INTERNAL), error.get("message", "request failed"),
                              answered=True)
        return reply

    # -- requests ------------------------------------------------------------------------------
    def discover(self) -> list[GPUInfo]:
        return [GPUInfo.from_json(gpu) for gpu in self.call("discover")["gpus"]]

    def lock(self, gpu_uuids: Sequence[str], clock_mhz: int, *, wait: bool = False) -> dict[str, Any]:
        return self.call("lock", gpus=list(gpu_uuids), clock_mhz=int(clock_mhz), wait=wait)

    def reset(self, gpu_uuids: Sequence[str], *, wait: bool = False) -> dict[str, Any]:
        return self.call("reset", gpus=list(gpu_uuids), wait=wait)

    def power_limit(self, gpu_uuids: Sequence[str], watts: float | None, *, wait: bool = False) -> dict[str, Any]:
        """Limit the boards of `gpu_uuids` to `watts` each (None: back to the board's default)."""
        return self.call("power_limit", gpus=list(gpu_uuids), wait=wait, **power_limit_fields(watts))

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
