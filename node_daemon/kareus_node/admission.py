"""Who may hold one of the daemon's connection slots, so that no peer can crowd out the others.

Two pools, never shared:

- *authenticated* sessions: Unix-socket callers (the kernel vouches for them at accept) and TCP
  callers once their `hello` token was accepted — at most `maxConnections`, of which
  `reservedUnixConnections` only the Unix socket may take, and at most `maxConnectionsPerPod` of
  one pod (a Unix caller outside any pod counts by its uid);
- *pending* TCP connections, which have not authenticated yet — at most `maxPendingConnections`,
  `maxPendingPerPeer` of them from one IP address. When the pool is full a new connection evicts
  the oldest pending one instead of being turned away: a legitimate client says hello within
  milliseconds, so a flood of idle sockets cannot keep it out; it can only churn its own.

`HelloLimiter` is a token bucket per IP address on TCP `hello`s (each may cost a signature check
and a TokenReview); its table is bounded, so spoofing many addresses costs memory only up to it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kareus_node.config import NodeConfig

MAX_TRACKED_PEERS = 4096


@dataclass(frozen=True)
class Admitted:
    """The answer to a request for a slot: `refusal` is "" when admitted; `evict` is the id of a
    pending session to close to make room (0: none)."""

    refusal: str = ""
    evict: int = 0


class Admission:
    """The slot books of one daemon (the event loop's thread only)."""

    def __init__(self, config: NodeConfig) -> None:
        self._config = config
        self._pending: OrderedDict[int, str] = OrderedDict()  # session id → peer IP, oldest first
        self._authenticated: dict[int, tuple[str, str]] = {}  # session id → (transport, pod key)

    def admit_pending(self, session_id: int, peer_ip: str) -> Admitted:
        """A new TCP connection from `peer_ip`, not authenticated yet."""
        limit = self._config.max_pending_per_peer
        if sum(1 for ip in self._pending.values() if ip == peer_ip) >= limit:
            return Admitted(f"too many unauthenticated connections from {peer_ip} (limit {limit})")
        evict = 0
        if len(self._pending) >= self._config.max_pending_connections:
            evict = next(iter(self._pending))
            del self._pending[evict]
        self._pending[session_id] = peer_ip
        return Admitted(evict=evict)

    def admit_authenticated(self, session_id: int, transport: str, pod_key: str) -> Admitted:
        """Session `session_id` (pending over TCP, or new on the Unix socket) is now `pod_key`'s."""
        config = self._config
        self._pending.pop(session_id, None)
        others = {sid: entry for sid, entry in self._authenticated.items() if sid != session_id}
        unix = sum(1 for t, _ in others.values() if t == "unix")
        held_back = 0 if transport == "unix" else max(0, config.unix_reserve - unix)  # the Unix socket's reserve
        if len(others) + held_back >= config.max_connections:
            return Admitted(f"too many connections (limit {config.max_connections}, "
                            f"{config.unix_reserve} of them kept for the Unix socket)")
        per_pod = sum(1 for _, key in others.values() if key == pod_key)
        if per_pod >= config.max_connections_per_pod:
            return Admitted(f"too many connections of {pod_key} (limit {config.max_connections_per_pod} a pod)")
        self._authenticated[session_id] = (transport, pod_key)
        return Admitted()

    def leave(self, session_id: int) -> None:
        self._pending.pop(session_id, None)
        self._authenticated.pop(session_id, None)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def authenticated(self) -> int:
        return len(self._authenticated)


class HelloLimiter:
    """At most `rate_per_s` hellos a second from one IP address, bursts up to twice that."""

    def __init__(self, rate_per_s: float, *, now: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = 2.0 * rate_per_s
        self._now = now
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # ip → (tokens, at)

    def allow(self, peer_ip: str) -> bool:
        now = self._now()
        tokens, at = self._buckets.pop(peer_ip, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[peer_ip] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > MAX_TRACKED_PEERS:  # forget the peer seen longest ago
            self._buckets.popitem(last=False)
        return allowed
