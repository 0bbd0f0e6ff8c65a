"""The wire protocol between Kareus clients and the node daemon (`kareus-node`).

A connection is a Unix stream socket or a TCP connection carrying *frames*: a 4-byte big-endian length followed by
that many bytes of UTF-8 JSON holding one object. Lengths are bounded (`MAX_FRAME_BYTES`), so a
peer can never make the other side buffer more than one bounded frame.

Every request names the protocol version and an operation, and carries a client-chosen id that
the answer echoes::

    {"v": 1, "id": 7, "op": "lock", "gpus": ["GPU-…"], "clock_mhz": 1200, "wait": false}
    {"v": 1, "id": 7, "ok": true, "applied": false}
    {"v": 1, "id": 8, "ok": false, "error": {"code": "refused", "message": "…"}}

Operations (GPUs are always named by UUID, never by ordinal):

- ``hello``    – first message: ``job`` (KareusJob name, used as a metric label only) and, over TCP,
  ``token`` (the pod's projected ServiceAccount token, audience ``kareus-node``; required there,
  optional and ignored on the Unix socket).
- ``discover`` – every GPU on the node with PCI bus id, name, supported clocks, policy bounds and
  whether this caller may control it.
- ``lock``     – lock the SM clock of ``gpus`` to ``clock_mhz``.
- ``power_limit`` – set the board power limit of ``gpus`` to ``watts`` (within the board's
  settable range), or with ``"reset": true`` back to the board's default; under the same lease as
  ``lock``.
- ``reset``    – give ``gpus`` back to default clocks and power limit, and release the lease.
- ``read``     – energy (J, cumulative), power (W), SM clock and locked clock of ``gpus``.
- ``schedule`` – upload ``clocks_mhz``, a cyclic per-instruction clock schedule for ``gpus``.
- ``next``     – advance every uploaded schedule of this connection by one instruction.
- ``status``   – the daemon's view: GPUs, leases, owners, counters.

``lock``, ``power_limit``, ``reset`` and ``next`` are asynchronous unless ``"wait": true``: the daemon answers as
soon as it has checked and accepted the request, and a per-GPU worker applies it, coalescing to
the latest request. With ``wait`` the answer comes after the clock was applied.
"""

from __future__ import annotations

import json
import struct
from typing import Any

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024

OPS = ("hello", "discover", "lock", "power_limit", "reset", "read", "schedule", "next", "status")

# Error codes carried in {"error": {"code": …}}.
E_INVALID = "invalid"  # the frame or a field is malformed
E_VERSION = "unsupported_version"
E_UNKNOWN_OP = "unknown_op"
E_REFUSED = "refused"  # authorisation or policy said no
E_BUSY = "busy"  # another client holds the GPU
E_UNAVAILABLE = "unavailable"  # NVML / pod-resources unreachable: fail closed
E_INTERNAL = "internal"


class ProtocolError(Exception):
    """A frame that cannot be accepted; `code` is one of the ``E_*`` codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame: length header plus compact JSON. Refuses messages above the frame limit."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(E_INVALID, f"frame of {len(body)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """The body length announced by a 4-byte header, checked against the limit."""
    (length,) = HEADER.unpack(header)
    if length == 0:
        raise ProtocolError(E_INVALID, "empty frame")
    if length > max_bytes:
        raise ProtocolError(E_INVALID, f"frame of {length} bytes exceeds the limit of {max_bytes}")
    return length


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a frame body into a JSON object (not a list, number or string)."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:  # deep nesting is a RecursionError
        raise ProtocolError(E_INVALID, f"frame is not UTF-8 JSON: {error}") from None
    if not isinstance(message, dict):
        raise ProtocolError(E_INVALID, f"frame must be a JSON object, got {type(message).__name__}")
    return message


def check_request(message: dict[str, Any]) -> tuple[int, str]:
    """Validate the envelope of a request; returns (id, op)."""
    version = message.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 are not 1
        raise ProtocolError(E_VERSION, f"v: unsupported protocol version {version!r}; this daemon speaks {PROTOCOL_VERSION}")
    request_id = message.get("id", 0)
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id < 2**53:
        raise ProtocolError(E_INVALID, "id: must be a non-negative integer")
    op = message.get("op")
    if op not in OPS:
        raise ProtocolError(E_UNKNOWN_OP, f"op: unknown operation {op!r}; allowed: {', '.join(OPS)}")
    return request_id, op


def error_reply(request_id: int, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": {"code": code, "message": message}}


def ok_reply(request_id: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields}
