"""10,000 hostile frames against a real `kareus-node` process: garbage, truncated and oversized
frames, wrong types, unknown versions, refused requests and connection floods. The daemon must
stay up with bounded memory, answer every bad frame with an error or a closed connection, count
them, and change no clock."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import socket
import struct
import time

import psutil
from test_daemon_support import start_daemon

from kareus.daemon_client import DaemonConnection, protocol
from kareus.gpu import sim_uuid
from kareus.metric_names import DAEMON_REQUESTS_TOTAL, GPU_CLOCK_CHANGES_TOTAL, GPU_LOCKED_CLOCK_HERTZ

GPU0 = sim_uuid("node-a", "A100-SXM4-40GB", 0)
GPU1 = sim_uuid("node-a", "A100-SXM4-40GB", 1)
TOTAL_FRAMES = 10_000
MAX_CONNECTIONS = 16
SURPLUS = 24  # connections beyond MAX_CONNECTIONS in the flood


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _bad_bodies(rng: random.Random) -> list[bytes]:
    """Frames with intact framing whose content must be refused (each is one kind of mistake)."""
    def js(obj):
        return json.dumps(obj).encode()

    lock = {"v": 1, "id": 1, "op": "lock", "gpus": [GPU0], "clock_mhz": 1200}
    return [
        bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))),
        b"\xff\xfe\xfd",
        b"[1, 2, 3]", b"42", b'"lock"', b"null", b"{", b"[" * 60_000,
        js({**lock, "v": 2}), js({**lock, "v": 0}), js({**lock, "v": "1"}), js({**lock, "v": True}), js({**lock, "v": 1.0}), js({k: v for k, v in lock.items() if k != "v"}),
        js({**lock, "id": -1}), js({**lock, "id": "seven"}), js({**lock, "id": 1.5}), js({**lock, "id": True}),
        js({**lock, "op": "format_disk"}), js({**lock, "op": 5}), js({**lock, "op": None}),
        js({**lock, "gpus": GPU0}), js({**lock, "gpus": [0]}), js({**lock, "gpus": []}), js({**lock, "gpus": ["GPU-" + "f" * 2000]}),
        js({**lock, "gpus": [GPU0, GPU0, GPU1]}), js({**lock, "gpus": [GPU0] * 500}),
        js({**lock, "clock_mhz": "fast"}), js({**lock, "clock_mhz": 1200.0}), js({**lock, "clock_mhz": True}),
        js({**lock, "clock_mhz": -1}), js({**lock, "clock_mhz": 10**30}), js({**lock, "clock_mhz": None}),
        b'{"v":1,"id":1,"op":"lock","gpus":["%s"],"clock_mhz":NaN}' % GPU0.encode(),
        js({**lock, "clock_mhz": 1203}),  # not a supported clock
        js({**lock, "clock_mhz": 1410}),  # above the policy ceiling
        js({**lock, "clock_mhz": 210}),  # below the policy floor
        js({**lock, "gpus": [GPU1]}),  # not on this caller's allow-list
        js({**lock, "wait": "yes"}),
        js({"v": 1, "id": 2, "op": "schedule", "gpus": [GPU0], "clocks_mhz": [1200] * 5000}),
        js({"v": 1, "id": 2, "op": "schedule", "gpus": [GPU0], "clocks_mhz": []}),
        js({"v": 1, "id": 2, "op": "schedule", "gpus": [GPU0], "clocks_mhz": ["1200"]}),
        js({"v": 1, "id": 2, "op": "schedule", "gpus": [GPU0], "clocks_mhz": [1200, 1410]}),
        js({"v": 1, "id": 2, "op": "schedule", "gpus": [GPU1], "clocks_mhz": [1200]}),
        js({"v": 1, "id": 3, "op": "next"}),
        js({"v": 1, "id": 4, "op": "read", "gpus": "all"}),
        js({"v": 1, "id": 5, "op": "reset", "gpus": [{"uuid": GPU0}]}),
        js({"v": 1, "id": 6, "op": "hello", "job": ["x"]}), js({"v": 1, "id": 6, "op": "hello", "job": "j" * 300}),
    ]


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.error_replies = 0
        self.closing_notes = 0  # "too many bad frames; closing": a note, not an answer to a request
        self.closed = 0


def _recv_reply(sock: socket.socket) -> dict | None:
    """The next reply, or None when the daemon closed the connection."""
    try:
        header = _recv_exact(sock, 4)
        return json.loads(_recv_exact(sock, struct.unpack(">I", header)[0]))
    except (EOFError, ConnectionResetError):
        return None


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def _expect_error_or_close(sock: socket.socket, tally: Tally) -> bool:
    reply = _recv_reply(sock)
    if reply is None:
        tally.closed += 1
        return False
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] in {protocol.E_INVALID, protocol.E_VERSION, protocol.E_UNKNOWN_OP,
                                      protocol.E_REFUSED, protocol.E_BUSY}, reply
    tally.error_replies += 1
    tally.closing_notes += "too many bad frames" in reply["error"]["message"]
    return True


def _bad_bodies_episode(path: str, bodies: list[bytes], rng: random.Random, tally: Tally) -> None:
    with _connect(path) as sock:
        for body in rng.sample(bodies, k=min(40, len(bodies))):
            sock.sendall(_frame(body))
            tally.sent += 1
            assert _expect_error_or_close(sock, tally)


def _pipelined_episode(path: str, bodies: list[bytes], rng: random.Random, tally: Tally) -> None:
    """Send a burst without reading, then read: answers come back in order, the limit cuts the rest."""
    with _connect(path) as sock:
        burst = [rng.choice(bodies) for _ in range(80)]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may hang up mid-burst
            sock.sendall(b"".join(_frame(b) for b in burst))
        tally.sent += len(burst)
        answered = 0
        while answered < len(burst) and _expect_error_or_close(sock, tally):
            answered += 1
        if answered == len(burst):  # fewer than MAX_BAD_FRAMES were invalid (refusals do not count)
            sock.shutdown(socket.SHUT_WR)
        assert _recv_reply(sock) is None or _recv_reply(sock) is None


def _broken_framing_episode(path: str, rng: random.Random, tally: Tally) -> None:
    with _connect(path) as sock:
        kind = rng.randrange(3)
        if kind == 0:  # oversized announcement
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(struct.pack(">I", rng.randint(protocol.MAX_FRAME_BYTES + 1, 2**32 - 1)) + b"x" * 100)
        elif kind == 1:  # empty frame
            sock.sendall(struct.pack(">I", 0))
        else:  # truncated: promises more than it sends, then hangs up
            sock.sendall(struct.pack(">I", 500) + b'{"v":1')
            sock.shutdown(socket.SHUT_WR)
        tally.sent += 1
        assert not _expect_error_or_close(sock, tally) or _recv_reply(sock) is None  # and then closed


def _stalled_partial_frames(path: str, tally: Tally) -> None:
    """Partial frames that never complete are cut off after requestTimeoutSeconds."""
    socks = [_connect(path) for _ in range(4)]
    for sock in socks:
        sock.sendall(struct.pack(">I", 100) + b'{"v":1,')
        tally.sent += 1
    for sock in socks:
        reply = _recv_reply(sock)
        assert reply is not None and "not completed within" in reply["error"]["message"]
        tally.error_replies += 1
        assert _recv_reply(sock) is None
        sock.close()


def _flood_episode(path: str, tally: Tally) -> int:
    """More connections at once than allowed: the surplus is turned away with an error as it is accepted.
    Nothing is sent before the surplus has its answers: an admitted connection that got its garbage
    answered and closed would free its slot while the flood is still being accepted (on a loaded
    machine the daemon accepts slower than the client sends), and a later one would be admitted."""
    socks = [_connect(path) for _ in range(MAX_CONNECTIONS + SURPLUS)]
    waiting, deadline = set(socks), time.monotonic() + 60  # a bound on waiting, not a speed goal
    while len(socks) - len(waiting) < SURPLUS and time.monotonic() < deadline:
        readable, _, _ = select.select(list(waiting), [], [], 1.0)  # admitted ones stay silent (idle timeout)
        waiting -= set(readable)
    busy = 0
    for sock in socks:
        if sock in waiting:  # admitted: now its garbage
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # turned away after all
                sock.sendall(_frame(b"garbage"))
            tally.sent += 1
        reply = _recv_reply(sock)
        if reply is None:
            tally.closed += 1
        else:
            assert reply["ok"] is False
            tally.error_replies += 1
            busy += reply["error"]["code"] == protocol.E_BUSY
        sock.close()
    return busy


def test_ten_thousand_hostile_frames_leave_the_daemon_up_and_every_clock_unchanged(tmp_path):
    allow = tmp_path / "allow.yaml"
    allow.write_text(f"allow:\n  - uid: {os.getuid()}\n    gpus: [{GPU0}]\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"maxConnections: {MAX_CONNECTIONS}\nrequestTimeoutSeconds: 0.3\n"
                      "clockBounds:\n  default: {floorMHz: 1005, ceilingMHz: 1305}\n")
    daemon = start_daemon(tmp_path, "--standalone", "--allow-list", str(allow), "--config", str(config))
    rng = random.Random(6)
    bodies = _bad_bodies(rng)
    tally = Tally()
    process = psutil.Process(daemon.proc.pid)
    try:
        _bad_bodies_episode(daemon.socket_path, bodies, rng, tally)  # warm up before measuring memory
        rss_before = process.memory_info().rss
        busy = _flood_episode(daemon.socket_path, tally)
        _stalled_partial_frames(daemon.socket_path, tally)
        episode = 0
        while tally.sent < TOTAL_FRAMES:
            episode += 1
            if episode % 10 == 0:
                _pipelined_episode(daemon.socket_path, bodies, rng, tally)
            elif episode % 3 == 0:
                _broken_framing_episode(daemon.socket_path, rng, tally)
            else:
                _bad_bodies_episode(daemon.socket_path, bodies, rng, tally)
        rss_after = process.memory_info().rss

        assert daemon.proc.poll() is None
        assert busy >= SURPLUS  # every surplus connection (more when a warm-up one is still closing)
        assert rss_after - rss_before < 32 * 2**20
        for uuid in (GPU0, GPU1):
            assert daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=uuid) == 0
            assert daemon.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=uuid) == 0
        counted = sum(daemon.metric(DAEMON_REQUESTS_TOTAL, result=r) for r in ("invalid", "refused", "rejected"))
        answers = tally.error_replies - tally.closing_notes
        assert answers <= counted <= answers + tally.closed  # a turned-away client may miss its answer
        assert daemon.metric(DAEMON_REQUESTS_TOTAL, result="refused") > 0
        assert daemon.metric(DAEMON_REQUESTS_TOTAL, result="ok") == 0
        assert tally.error_replies + tally.closed >= tally.sent * 0.8  # pipelined bursts are cut after the limit
        # And it still serves an honest client.
        with DaemonConnection(daemon.socket_path) as connection:
            connection.lock([GPU0], 1200, wait=True)
            assert connection.read([GPU0])[0].locked_clock_mhz == 1200
        assert daemon.http_status("/healthz") == 200
    finally:
        assert daemon.stop() == 0
