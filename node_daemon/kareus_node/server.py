"""The daemon proper: the socket servers, sessions and leases, and the restore rules.

Every accepted connection is a *session* with credentials: on the Unix socket the kernel-vouched
pid/uid/gid of its peer; on the node's TCP port (for pods that cannot mount a hostPath) the
ServiceAccount token its `hello` carries — a TCP session must authenticate with that `hello`
before anything else, and is closed with one refusal when it does not. The first request that
touches a GPU asks the session's `Authorizer` for its `Grant` (cached, and re-checked every
`pod_recheck_s`; a session whose caller is refused on a re-check is closed, leases or not).
`read` and `status` show a caller only the GPUs its grant covers (a node administrator outside any
pod sees all), and the `kareusjob` a lease is labelled with is the pod's label, never the
client's `hello`. A lock takes a *lease* on each
GPU it names: leases belong to one session, so two clients can never fight over a GPU, and they
end — the GPU goes back to default clocks — when the session ends (the client closed, exited or
was SIGKILLed: the kernel closes its socket), when the re-check says the pod no longer holds the
GPU or cannot be asked (fail closed), and when the daemon stops.

The socket side only validates, authorises and records wishes; the `ClockWorker`s apply them.
Bad input costs the sender, not the daemon: frames are bounded, each bad frame is answered with an
error (or, when the framing itself is broken, the connection is closed), partial frames time out,
and connection slots are handed out by `admission.Admission` (separate pools for authenticated
and not-yet-authenticated callers, caps per pod and per IP, a hello rate limit per IP). A session
without leases that stays silent for `idle_timeout_s` is closed; one with leases is kept, since a
training process may hold a clock for hours without a word, and the re-check vouches for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kareus.daemon_client import protocol
from kareus.daemon_client.protocol import ProtocolError
from kareus.errors import KareusError
from kareus.policy import ClockBounds
from kareus_node.admission import Admission, HelloLimiter
from kareus_node.auth import Authorizer, AuthUnavailable, BearerToken, Credentials, Grant, Owner
from kareus_node.config import NodeConfig
from kareus_node.identity import PeerCredentials, peer_credentials
from kareus_node.journal import Journal, JournalError
from kareus_node.worker import ClockWorker

log = logging.getLogger("kareus_node")

MAX_BAD_FRAMES = 64  # per connection; a peer that only sends garbage is cut off
BLOCKING_WAIT_S = 10.0


class RequestFailed(Exception):
    """Ends one request with an error answer; `result` is the metrics label."""

    def __init__(self, code: str, message: str, result: str) -> None:
        super().__init__(message)
        self.code = code
        self.result = result


def _invalid(message: str) -> RequestFailed:
    return RequestFailed(protocol.E_INVALID, message, "invalid")


def _refused(message: str) -> RequestFailed:
    return RequestFailed(protocol.E_REFUSED, message, "refused")


@dataclass
class Session:
    id: int
    credentials: Credentials
    authorizer: Authorizer
    transport: str = "unix"  # or "tcp": must authenticate with hello(token) first
    authenticated: bool = True
    close_after_reply: bool = False
    job: str = ""
    grant: Grant | None = None
    leases: set[str] = field(default_factory=set)
    schedules: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)  # uuid → (clocks, cursor)
    clocks: dict[str, int] = field(default_factory=dict)  # uuid → the clock last wanted on its lease
    power_limits: dict[str, float | None] = field(default_factory=dict)  # uuid → the limit last wanted (journaled)
    bad_frames: int = 0
    peer_ip: str = ""  # TCP: the connection's source address
    writer: Any = field(default=None, repr=False)  # to close the session from outside its reader (re-check)


@dataclass(frozen=True)
class Lease:
    session_id: int
    owner: Owner


class Daemon:
    """Serves the local API for `gpus` under `config`, authorising through `authorizer`."""

    def __init__(self, gpus: Sequence[Any], authorizer: Authorizer, config: NodeConfig, journal: Journal,
                 *, node_name: str, observe: Any = None, recheck: bool = False,
                 token_authorizer: Authorizer | None = None) -> None:
        self.gpus = {gpu.uuid: gpu for gpu in gpus}
        self.authorizer = authorizer  # Unix-socket callers
        self.token_authorizer = token_authorizer  # TCP callers (None: no TCP listener)
        self.tcp_address: tuple[str, int] | None = None  # where the TCP listener is bound, once serving
        self.config = config
        self.journal = journal
        self.node_name = node_name
        self.observe = observe or (lambda _result, _seconds: None)  # metrics hook: (result, seconds)
        self.recheck = recheck
        self.bounds = {gpu.uuid: _effective_bounds(gpu, config) for gpu in gpus}
        self.supported_mhz = {gpu.uuid: frozenset(gpu.supported_sm_clocks_mhz()) for gpu in gpus}
        self._power_ranges_w: dict[str, tuple[float, float]] = {}  # read on first use: a board may not support it
        self.workers: dict[str, ClockWorker] = {}
        self.leases: dict[str, Lease] = {}
        self.sessions: dict[int, Session] = {}
        self.restored_on_start: list[str] = []
        self.ready = False
        self.auth_healthy = True
        self._ids = itertools.count(1)
        self.admission = Admission(config)
        self.hellos = HelloLimiter(config.hello_rate_per_s)
        self.recheck_errors = 0
        self._server: asyncio.AbstractServer | None = None
        self._tcp_server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------
    def restore(self) -> list[str]:
        """Reset every journaled GPU: its lease belonged to a connection of a previous daemon, and
        connections do not outlive their daemon, so its owner is gone. Returns the reset UUIDs."""
        for uuid, entry in self.journal.entries().items():
            gpu = self.gpus.get(uuid)
            if gpu is None:
                log.warning("journal names GPU %s, which is not on this node any more; forgetting it", uuid)
            else:
                owner = Owner.from_json(entry.get("owner", {})) if isinstance(entry.get("owner"), dict) else None
                limited = entry.get("power_limit_w") is not None
                log.warning("restoring GPU %s to default clocks%s (locked at %s MHz%s for %s by daemon pid %s)",
                            uuid, " and its default power limit" if limited else "", entry.get("clock_mhz"),
                            f", limited to {entry['power_limit_w']} W" if limited else "",
                            owner.describe() if owner else "?", entry.get("daemon_pid"))
                try:
                    gpu.reset_sm_clock()
                    if limited:
                        gpu.reset_power_limit()
                except Exception as error:  # keep the entry: the next start tries again
                    log.error("cannot reset journaled GPU %s: %s", uuid, error)
                    continue
                self.restored_on_start.append(uuid)
            self.journal.erase(uuid)
        return self.restored_on_start

    def start_workers(self) -> None:
        for uuid, gpu in self.gpus.items():
            self.workers[uuid] = ClockWorker(gpu, self.journal, dry_run=self.config.dry_run)
            self.workers[uuid].clock_changes = self.restored_on_start.count(uuid)

    async def serve(self, socket_path: str, on_ready: Callable[[], None] | None = None, *,
                    tcp: tuple[str, int] | None = None) -> None:
        """Listen on `socket_path` (and on `tcp`, host and port, when given) until `stop()`; then
        reset everything that is still leased."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        Path(socket_path).parent.mkdir(parents=True, exist_ok=True)
        limit = protocol.MAX_FRAME_BYTES + protocol.HEADER.size
        self._server = await asyncio.start_unix_server(
            lambda r, w: self._serve_connection(r, w, "unix"), path=socket_path, limit=limit, backlog=256
        )
        os.chmod(socket_path, 0o666)  # any local process may *ask*; authorisation decides
        if tcp is not None:
            if self.token_authorizer is None:
                raise OSError("a TCP listener needs a token authorizer (cluster mode)")
            try:
                self._tcp_server = await asyncio.start_server(
                    lambda r, w: self._serve_connection(r, w, "tcp"), host=tcp[0], port=tcp[1], limit=limit,
                    backlog=256, reuse_address=True)
            except OSError:
                self._server.close()
                raise
            self.tcp_address = self._tcp_server.sockets[0].getsockname()[:2]
        recheck = asyncio.create_task(self._recheck_loop()) if self.recheck else None
        self.ready = True
        if on_ready:
            on_ready()
        try:
            await self._stopped.wait()
        finally:
            self.ready = False
            if recheck:
                recheck.cancel()
            self._server.close()
            if self._tcp_server is not None:
                self._tcp_server.close()
            self._release_everything("daemon stopping")
            for worker in self.workers.values():
                await asyncio.to_thread(worker.stop)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)

    def stop(self) -> None:
        self._stopped.set()

    # -- connections ---------------------------------------------------------------------------
    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport: str) -> None:
        session = await self._open_session(writer, transport)
        if session is None:
            return
        try:
            await self._read_frames(session, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._end_session(session)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _open_session(self, writer: asyncio.StreamWriter, transport: str) -> Session | None:
        """The new connection's session once it has a slot; None when it was turned away."""
        session_id = next(self._ids)
        if transport == "tcp":
            assert self.token_authorizer is not None
            peer_ip = _peer_ip(writer)
            session = Session(session_id, BearerToken("", peer_ip), self.token_authorizer, "tcp",
                              authenticated=False, peer_ip=peer_ip)
            admitted = self.admission.admit_pending(session_id, peer_ip)
            evicted = self.sessions.get(admitted.evict)
            if evicted is not None and evicted.writer is not None:
                evicted.writer.close()  # the oldest unauthenticated connection makes room
        else:
            try:
                sock = writer.get_extra_info("socket")
                peer = await asyncio.to_thread(self.authorizer.identify, peer_credentials(sock), sock)
            except OSError:
                writer.close()
                return None
            session = Session(session_id, peer, self.authorizer)
            admitted = self.admission.admit_authenticated(session_id, "unix", _pod_key(peer))
        if admitted.refusal:
            self.observe("rejected", 0.0)
            await self._close_with(writer, protocol.error_reply(0, protocol.E_BUSY, admitted.refusal))
            return None
        session.writer = writer
        self.sessions[session.id] = session
        return session

    async def _next_header(self, session: Session, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
        """The next frame header, or None once the session was closed for its silence."""
        while True:
            if not session.authenticated:  # anyone on the network can connect: one who does not authenticate must not hold a slot
                try:
                    return await asyncio.wait_for(reader.readexactly(protocol.HEADER.size), self.config.request_timeout_s)
                except TimeoutError:
                    self.observe("refused", 0.0)
                    await self._close_with(writer, protocol.error_reply(0, protocol.E_REFUSED, f"no hello with a token within {self.config.request_timeout_s} s"))
                    return None
            try:  # a cancelled readexactly consumes nothing, so waiting again loses no bytes
                return await asyncio.wait_for(reader.readexactly(protocol.HEADER.size), self.config.idle_timeout_s)
            except TimeoutError:
                if not session.leases:
                    await self._close_with(writer, protocol.error_reply(0, protocol.E_REFUSED, f"idle for {self.config.idle_timeout_s} s without a lease; closing"))
                    return None

    async def _read_frames(self, session: Session, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not self._stopped.is_set():
            header = await self._next_header(session, reader, writer)
            if header is None:
                return
            try:
                length = protocol.frame_length(header)
            except ProtocolError as error:  # the stream cannot be re-synchronised: answer and close
                self.observe("invalid", 0.0)
                await self._close_with(writer, protocol.error_reply(0, error.code, str(error)))
                return
            try:
                body = await asyncio.wait_for(reader.readexactly(length), self.config.request_timeout_s)
            except TimeoutError:
                self.observe("invalid", 0.0)
                await self._close_with(writer, protocol.error_reply(0, protocol.E_INVALID, f"frame not completed within {self.config.request_timeout_s} s"))
                return
            reply = await self._handle(session, body)
            writer.write(protocol.encode_frame(reply))
            await writer.drain()  # a peer that does not read its answers stalls only itself
            # A TCP caller that failed to authenticate gets one answer, whatever it sent.
            if session.close_after_reply or (not session.authenticated and not reply.get("ok")):
                writer.close()
                return
            if session.bad_frames >= MAX_BAD_FRAMES:
                await self._close_with(writer, protocol.error_reply(0, protocol.E_INVALID, "too many bad frames; closing"))
                return

    async def _close_with(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            writer.write(protocol.encode_frame(reply))
            await asyncio.wait_for(writer.drain(), 1.0)
        writer.close()

    def _end_session(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        self.admission.leave(session.id)
        self._release(session, session.leases, "client disconnected")

    # -- requests ------------------------------------------------------------------------------
    async def _handle(self, session: Session, body: bytes) -> dict[str, Any]:
        started = time.perf_counter()
        request_id = 0
        try:
            message = protocol.decode_body(body)
            raw_id = message.get("id", 0)
            request_id = raw_id if type(raw_id) is int and 0 <= raw_id < 2**53 else 0
            request_id, op = protocol.check_request(message)
            if not session.authenticated and op != "hello":
                session.close_after_reply = True
                raise _refused(f"{op}: authenticate first: a TCP connection's first request is hello with token, a "
                               f"projected ServiceAccount token with audience kareus-node")
            reply = await getattr(self, f"_op_{op}")(session, request_id, message)
            result = "dry_run" if self.config.dry_run and op in ("lock", "power_limit", "next", "reset") else "ok"
        except ProtocolError as error:
            session.bad_frames += 1
            reply, result = protocol.error_reply(request_id, error.code, str(error)), "invalid"
        except RequestFailed as error:
            if error.result == "invalid":
                session.bad_frames += 1
            reply, result = protocol.error_reply(request_id, error.code, str(error)), error.result
        except Exception as error:  # a bug must not take the daemon down with it
            log.exception("request failed")
            reply, result = protocol.error_reply(request_id, protocol.E_INTERNAL, f"internal error: {type(error).__name__}"), "error"
        self.observe(result, time.perf_counter() - started)
        return reply

    async def _op_hello(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        job = message.get("job", "")
        if not isinstance(job, str) or len(job) > 253:
            raise _invalid("job: must be a string of at most 253 characters")
        token = message.get("token", "")
        if not isinstance(token, str):
            raise _invalid("token: must be a string (a ServiceAccount token)")
        session.job = job  # a label for callers outside pods only: a pod's job is its pod's label
        if session.transport == "tcp":  # on the Unix socket the kernel's credentials decide; a token is ignored
            if not self.hellos.allow(session.peer_ip):
                session.close_after_reply = True
                raise RequestFailed(protocol.E_BUSY, f"too many hellos from {session.peer_ip} (limit "
                                    f"{self.config.hello_rate_per_s:g} a second); retry later", "rejected")
            await self._authenticate(session, token)
        return protocol.ok_reply(request_id, node=self.node_name, dry_run=self.config.dry_run)

    async def _authenticate(self, session: Session, token: str) -> None:
        """Review a TCP session's token (its first hello, or a later one with the rotated token):
        the session becomes that pod's, or is answered once and closed."""
        try:
            grant = await asyncio.to_thread(session.authorizer.grant, BearerToken(token, session.peer_ip), list(self.gpus))
        except AuthUnavailable as error:
            session.close_after_reply = not session.authenticated
            raise RequestFailed(protocol.E_UNAVAILABLE, f"cannot authenticate (failing closed): {error}", "unavailable") from None
        previous = session.grant.owner.pod_uid if session.grant is not None else ""
        if grant.refused or (previous and grant.owner.pod_uid != previous):
            session.close_after_reply = True  # one clear refusal; the connection (and any lease) ends
            raise _refused(grant.refused or f"the new token names pod {grant.owner.namespace}/{grant.owner.pod}, "
                           f"not this connection's pod")
        if not session.authenticated:
            admitted = self.admission.admit_authenticated(session.id, "tcp", grant.owner.pod_uid)
            if admitted.refusal:
                session.close_after_reply = True
                raise RequestFailed(protocol.E_BUSY, admitted.refusal, "rejected")
        session.credentials = BearerToken(token, session.peer_ip)
        session.authenticated = True
        session.grant = _with_job_grant(grant, session.job)

    async def _op_discover(self, session: Session, request_id: int, _message: dict[str, Any]) -> dict[str, Any]:
        grant = await self._grant(session)
        visible = await self._visible(session)
        gpus = []
        for uuid, gpu in self.gpus.items():  # every GPU is named, but only the caller's show their state
            reason = self._control_refusal(grant, uuid)
            low, high = self._bounds_for(grant, uuid)
            gpus.append({"uuid": uuid, "pci_bus_id": gpu.pci_bus_id, "name": gpu.name,
                         "supported_clocks_mhz": list(gpu.supported_sm_clocks_mhz()),
                         "min_clock_mhz": low, "max_clock_mhz": high, "controllable": not reason,
                         "reason": reason, "locked_clock_mhz": gpu.locked_clock_mhz() if uuid in visible else None,
                         **self._power_fields(uuid, current=uuid in visible)})
        return protocol.ok_reply(request_id, gpus=gpus, dry_run=self.config.dry_run)

    async def _op_lock(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        uuids = self._gpu_list(message)
        clock_mhz = _int_field(message, "clock_mhz")
        stale_after_s = _stale_after_field(message)
        _wait_field(message)
        grant = await self._grant(session)
        for uuid in uuids:
            self._check_control(session, grant, uuid, (clock_mhz,))
        tickets = [self._set_clock(session, grant, uuid, clock_mhz, stale_after_s) for uuid in uuids]
        return await self._answer_after(request_id, message, uuids, tickets)

    async def _op_reset(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        uuids = self._gpu_list(message)
        _wait_field(message)
        for uuid in uuids:
            lease = self.leases.get(uuid)
            if lease is not None and lease.session_id != session.id:
                raise RequestFailed(protocol.E_BUSY, f"GPU {uuid} is held by {lease.owner.describe()}, not by this connection", "refused")
        mine = [uuid for uuid in uuids if uuid in session.leases]
        tickets = self._release(session, mine, "reset requested")
        return await self._answer_after(request_id, message, mine, tickets)

    async def _op_power_limit(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        """Set (`watts`) or restore (`reset: true`) the board power limit of `gpus`, under the lease
        a lock takes: the same ownership checks, and the same release restores it."""
        uuids = self._gpu_list(message)
        watts = _power_limit_field(message)
        _wait_field(message)
        grant = await self._grant(session)
        for uuid in uuids:
            self._check_power_limit(session, grant, uuid, watts)
        if watts is None:  # back to the default: only where this session set a limit
            uuids = [uuid for uuid in uuids if session.power_limits.get(uuid) is not None]
        tickets = [self._set_power_limit(session, grant, uuid, watts) for uuid in uuids]
        return await self._answer_after(request_id, message, uuids, tickets)

    async def _op_read(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        uuids = self._gpu_list(message)
        visible = await self._visible(session)
        for uuid in uuids:
            if uuid not in visible:
                raise _refused(f"read: GPU {uuid} is not this caller's ({(await self._grant(session)).reason(uuid)})")
        gpus = []
        for uuid in uuids:
            gpu = self.gpus[uuid]
            gpus.append({"uuid": uuid, "energy_j": gpu.energy_j(), "power_w": gpu.power_w(),
                         "sm_clock_mhz": gpu.sm_clock_mhz(), "locked_clock_mhz": gpu.locked_clock_mhz(),
                         "power_limit_w": self._power_fields(uuid)["power_limit_w"]})
        return protocol.ok_reply(request_id, gpus=gpus)

    async def _op_schedule(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        uuids = self._gpu_list(message)
        clocks = message.get("clocks_mhz")
        limit = self.config.max_schedule_length
        if not isinstance(clocks, list) or not 1 <= len(clocks) <= limit:
            raise _invalid(f"clocks_mhz: must be a list of 1 to {limit} clocks in MHz")
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in clocks):
            raise _invalid("clocks_mhz: every entry must be an integer number of MHz")
        grant = await self._grant(session)
        for uuid in uuids:
            self._check_control(session, grant, uuid, set(clocks))
        for uuid in uuids:
            session.schedules[uuid] = (tuple(clocks), 0)
        return protocol.ok_reply(request_id, length=len(clocks))

    async def _op_next(self, session: Session, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        _wait_field(message)
        if not session.schedules:
            raise _invalid("next: no schedule was uploaded on this connection")
        grant = await self._grant(session)
        steps = {uuid: clocks[cursor % len(clocks)] for uuid, (clocks, cursor) in session.schedules.items()}
        for uuid in steps:  # the grant may have been re-checked since the upload
            reason = self._control_refusal(grant, uuid)
            if reason:
                raise _refused(reason)
            self._check_lease(session, uuid)
        steps = {uuid: min(clock_mhz, self._capped(grant, uuid)) for uuid, clock_mhz in steps.items()}  # a ceiling set since
        tickets = []
        for uuid, clock_mhz in steps.items():
            clocks, cursor = session.schedules[uuid]
            session.schedules[uuid] = (clocks, cursor + 1)
            tickets.append(self._set_clock(session, grant, uuid, clock_mhz))
        reply = await self._answer_after(request_id, message, list(steps), tickets)
        reply["clocks_mhz"] = steps
        return reply

    async def _op_status(self, session: Session, request_id: int, _message: dict[str, Any]) -> dict[str, Any]:
        journaled = self.journal.entries()
        visible = await self._visible(session)
        gpus = []
        for uuid, gpu in self.gpus.items():
            if uuid not in visible:
                continue
            lease = self.leases.get(uuid)
            gpus.append({"uuid": uuid, "name": gpu.name, "pci_bus_id": gpu.pci_bus_id,
                         "locked_clock_mhz": gpu.locked_clock_mhz(), "sm_clock_mhz": gpu.sm_clock_mhz(),
                         "power_w": gpu.power_w(), "energy_j": gpu.energy_j(),
                         "clock_changes": self.workers[uuid].clock_changes if uuid in self.workers else 0,
                         "stale_skipped": self.workers[uuid].stale_skipped if uuid in self.workers else 0,
                         "power_limit_changes": self.workers[uuid].power_limit_changes if uuid in self.workers else 0,
                         **self._power_fields(uuid),
                         "owner": lease.owner.to_json() if lease else None, "journaled": uuid in journaled,
                         "mig_enabled": gpu.is_mig_enabled(), "bounds_mhz": list(self.bounds[uuid])})
        return protocol.ok_reply(request_id, node=self.node_name, dry_run=self.config.dry_run, pid=os.getpid(),
                                 connections=len(self.sessions), restored_on_start=self.restored_on_start, gpus=gpus)

    # -- helpers -------------------------------------------------------------------------------
    async def _visible(self, session: Session) -> set[str]:
        """The GPUs `session` may read: those its grant covers (MIG ones too: they are the pod's) and
        those it holds; every GPU for a node administrator (a Unix caller outside any pod running as
        root or as the daemon's own user)."""
        grant = await self._grant(session)
        credentials = session.credentials
        if (isinstance(credentials, PeerCredentials) and not grant.owner.pod_uid
                and credentials.uid in (0, os.getuid())):
            return set(self.gpus)
        return {uuid for uuid in self.gpus if not grant.reason(uuid)} | session.leases

    def _gpu_list(self, message: dict[str, Any]) -> list[str]:
        uuids = message.get("gpus")
        if not isinstance(uuids, list) or not 1 <= len(uuids) <= len(self.gpus) or not all(isinstance(u, str) for u in uuids):
            raise _invalid(f"gpus: must be a list of 1 to {len(self.gpus)} GPU UUIDs")
        for index, uuid in enumerate(uuids):
            if uuid not in self.gpus:
                shown = uuid if len(uuid) <= 80 else uuid[:80] + "…"
                raise _invalid(f"gpus[{index}]: {shown!r} is not a GPU on this node (GPUs are named by UUID)")
        return list(dict.fromkeys(uuids))

    async def _grant(self, session: Session) -> Grant:
        if session.grant is None:
            try:
                session.grant = await asyncio.to_thread(session.authorizer.grant, session.credentials, list(self.gpus))
            except AuthUnavailable as error:
                raise RequestFailed(protocol.E_UNAVAILABLE, f"cannot authorise (failing closed): {error}", "unavailable") from None
            session.grant = _with_job_grant(session.grant, session.job)
        return session.grant

    def _bounds_for(self, grant: Grant, uuid: str) -> tuple[int, int]:
        """The policy bounds of GPU `uuid`, lowered at the top to the caller's clock ceiling."""
        low, high = self.bounds[uuid]
        return low, min(high, self._capped(grant, uuid))

    def _capped(self, grant: Grant, uuid: str) -> int:
        """The highest supported clock within the caller's ceiling (the top bound without one; the
        lowest bound when the ceiling is below it: the ceiling wins as far as the GPU allows)."""
        low, high = self.bounds[uuid]
        if grant.ceiling_mhz is None:
            return high
        allowed = [c for c in self.supported_mhz[uuid] if low <= c <= min(high, grant.ceiling_mhz)]
        return max(allowed) if allowed else low

    def _control_refusal(self, grant: Grant, uuid: str) -> str:
        reason = grant.reason(uuid)
        if not reason and self.gpus[uuid].is_mig_enabled():
            reason = f"GPU {uuid} has MIG enabled; clock control is refused"
        return reason

    def _check_control(self, session: Session, grant: Grant, uuid: str, clocks_mhz: Any) -> None:
        reason = self._control_refusal(grant, uuid)
        if reason:
            raise _refused(reason)
        low, high = self._bounds_for(grant, uuid)
        supported = self.supported_mhz[uuid]
        for clock_mhz in sorted(clocks_mhz):
            if clock_mhz > high and high < self.bounds[uuid][1]:  # below the policy's top: the ceiling decides
                raise _refused(f"clock_mhz: {clock_mhz} MHz is above the clock ceiling {high} MHz the operator set for "
                               f"{grant.owner.describe()} on GPU {uuid} (power budget)")
            if not low <= clock_mhz <= high:
                raise _refused(f"clock_mhz: {clock_mhz} MHz is outside the policy bounds {low}–{high} MHz of GPU {uuid} ({self.gpus[uuid].name})")
            if clock_mhz not in supported:
                raise _invalid(f"clock_mhz: {clock_mhz} MHz is not a supported SM clock of GPU {uuid}")
        self._check_lease(session, uuid)

    def _power_range_w(self, uuid: str) -> tuple[float, float]:
        if uuid not in self._power_ranges_w:
            try:
                self._power_ranges_w[uuid] = self.gpus[uuid].power_limit_range_w()
            except KareusError as error:
                raise _refused(f"GPU {uuid} does not report settable power limits: {error}") from None
        return self._power_ranges_w[uuid]

    def _power_fields(self, uuid: str, *, current: bool = True) -> dict[str, float | None]:
        """The board's power-limit range, default and (when `current`) the limit in force; None where
        the board cannot say."""
        gpu = self.gpus[uuid]
        fields: dict[str, float | None] = {"min_power_limit_w": None, "max_power_limit_w": None,
                                           "default_power_limit_w": None, "power_limit_w": None}
        with contextlib.suppress(KareusError, RequestFailed):
            fields["min_power_limit_w"], fields["max_power_limit_w"] = self._power_range_w(uuid)
            fields["default_power_limit_w"] = gpu.default_power_limit_w()
            fields["power_limit_w"] = gpu.power_limit_w() if current else None
        return fields

    def _check_power_limit(self, session: Session, grant: Grant, uuid: str, watts: float | None) -> None:
        reason = self._control_refusal(grant, uuid)
        if reason:
            raise _refused(reason.replace("clock control", "power-limit control"))
        self._check_lease(session, uuid)
        if watts is None:
            return
        low, high = self._power_range_w(uuid)
        if not low <= watts <= high:
            raise _refused(f"watts: {watts:g} W is outside the power-limit range {low:g}–{high:g} W of GPU {uuid} "
                           f"({self.gpus[uuid].name})")

    def _check_lease(self, session: Session, uuid: str) -> None:
        lease = self.leases.get(uuid)
        if lease is not None and lease.session_id != session.id:
            raise RequestFailed(protocol.E_BUSY, f"GPU {uuid} is held by {lease.owner.describe()}", "refused")

    def _take_lease(self, session: Session, grant: Grant, uuid: str, **entry: Any) -> None:
        """Make `uuid` this session's lease (journaled, durably, before the GPU is touched)."""
        if uuid in session.leases:
            return
        record = {"owner": grant.owner.to_json(), "daemon_pid": os.getpid(), "since": time.time(), **entry}
        try:
            self.workers[uuid].acquire(record)
        except JournalError as error:
            raise RequestFailed(protocol.E_UNAVAILABLE, f"cannot journal the lease (failing closed): {error}", "unavailable") from None
        self.leases[uuid] = Lease(session.id, grant.owner)
        session.leases.add(uuid)

    def _set_clock(self, session: Session, grant: Grant, uuid: str, clock_mhz: int,
                   stale_after_s: float | None = None) -> int:
        self._take_lease(session, grant, uuid, clock_mhz=clock_mhz)
        session.clocks[uuid] = clock_mhz
        return self.workers[uuid].want(clock_mhz, stale_after_s=stale_after_s)

    def _set_power_limit(self, session: Session, grant: Grant, uuid: str, watts: float | None) -> int:
        worker = self.workers[uuid]
        if uuid not in session.leases:
            self._take_lease(session, grant, uuid, clock_mhz=None, power_limit_w=watts)
        elif watts is not None and uuid not in session.power_limits:  # a clock lease now limits power too
            try:
                worker.journal_power_limit(watts)
            except JournalError as error:
                raise RequestFailed(protocol.E_UNAVAILABLE, f"cannot journal the power limit (failing closed): {error}",
                                    "unavailable") from None
        if watts is not None or uuid in session.power_limits:  # once journaled, kept until the lease ends
            session.power_limits[uuid] = watts
        return worker.want_power(watts)

    def _release(self, session: Session, uuids: Any, why: str) -> list[int]:
        tickets = []
        for uuid in list(uuids):
            lease = self.leases.get(uuid)
            if lease is None or lease.session_id != session.id:
                continue
            del self.leases[uuid]
            session.leases.discard(uuid)
            session.schedules.pop(uuid, None)
            session.clocks.pop(uuid, None)
            limited = session.power_limits.pop(uuid, None) is not None
            log.info("GPU %s back to default clocks%s: %s; owner was %s", uuid,
                     " and power limit" if limited else "", why, lease.owner.describe())
            tickets.append(self.workers[uuid].want(None))
        return tickets

    def _release_everything(self, why: str) -> None:
        for session in list(self.sessions.values()):
            self._release(session, session.leases, why)

    async def _answer_after(self, request_id: int, message: dict[str, Any], uuids: list[str], tickets: list[int]) -> dict[str, Any]:
        wait = _wait_field(message)
        if wait:
            for uuid, ticket in zip(uuids, tickets, strict=True):
                if not await asyncio.to_thread(self.workers[uuid].wait_applied, ticket, BLOCKING_WAIT_S):
                    raise RequestFailed(protocol.E_INTERNAL, f"GPU {uuid}: clock not applied within {BLOCKING_WAIT_S} s", "error")
                if self.workers[uuid].last_error:
                    raise RequestFailed(protocol.E_INTERNAL, f"GPU {uuid}: {self.workers[uuid].last_error}", "error")
        return protocol.ok_reply(request_id, applied=wait, dry_run=self.config.dry_run)

    async def _recheck_loop(self) -> None:
        """Re-authorise every session, every `pod_recheck_s`, whatever a round raised: a round that
        fails is logged and the next one runs (a dead loop would leave every lease unchecked)."""
        while True:
            await asyncio.sleep(self.config.pod_recheck_s)
            try:
                await self.recheck_leases()
            except Exception:
                self.recheck_errors += 1
                log.exception("lease re-check round failed; the next round runs in %s s", self.config.pod_recheck_s)

    async def recheck_leases(self) -> None:
        try:
            for authorizer in dict.fromkeys(a for a in (self.authorizer, self.token_authorizer) if a is not None):
                await asyncio.to_thread(authorizer.probe)
            unavailable = ""
        except AuthUnavailable as error:
            unavailable = str(error)
        self.auth_healthy = not unavailable
        for session in list(self.sessions.values()):
            if session.grant is None:
                continue  # never asked yet: its first request asks afresh
            try:
                if unavailable:
                    raise AuthUnavailable(unavailable)
                fresh = await asyncio.to_thread(session.authorizer.recheck, session.grant, list(self.gpus), session.credentials)
            except AuthUnavailable as error:
                self.auth_healthy = False
                self._release(session, session.leases, f"authorisation unavailable, failing closed: {error}")
                session.grant = None  # asked afresh (a TCP session: its token reviewed again) on its next request
                continue
            if fresh.refused and not session.grant.refused:
                self._close(session, f"no longer allowed: {fresh.refused}")
                continue
            lost = [uuid for uuid in session.leases if fresh.reason(uuid)]
            if lost:
                self._release(session, lost, f"no longer allowed: {fresh.reason(lost[0])}")
            session.grant = _with_job_grant(fresh, session.job)
            self._enforce_ceiling(session, session.grant)

    def _enforce_ceiling(self, session: Session, grant: Grant) -> None:
        """Lower what a session's leases hold to a ceiling the operator lowered since they were taken."""
        for uuid in list(session.leases):
            capped = self._capped(grant, uuid)
            if session.clocks.get(uuid, 0) > capped:
                log.info("GPU %s: %s MHz → %s MHz, the clock ceiling of %s", uuid, session.clocks[uuid], capped,
                         grant.owner.describe())
                self._set_clock(session, grant, uuid, capped)

    def _close(self, session: Session, why: str) -> None:
        """End a session from outside its reader: its leases now, its connection with one note."""
        log.info("closing the session of %s: %s", session.grant.owner.describe() if session.grant else "?", why)
        self._release(session, session.leases, why)
        if session.writer is not None:
            with contextlib.suppress(Exception):
                session.writer.write(protocol.encode_frame(protocol.error_reply(0, protocol.E_REFUSED, why)))
            session.writer.close()


def _with_job_grant(grant: Grant, job: str) -> Grant:
    return replace(grant, owner=_with_job(grant.owner, job))


def _with_job(owner: Owner, job: str) -> Owner:
    """The owner labelled with the job a caller outside any pod named; a pod's job is its label alone,
    which the operator sets and the workers' admission policy guards, so a pod cannot relabel itself."""
    if owner.pod_uid or not job:
        return owner
    return Owner(owner.pid, owner.uid, owner.namespace, owner.pod, owner.pod_uid, job)


def _peer_ip(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def _pod_key(peer: PeerCredentials) -> str:
    """Whose connections count together for the per-pod cap: the pod's, else the uid's."""
    return f"pod {peer.pod_uid}" if peer.pod_uid else f"uid {peer.uid}"


def _wait_field(message: dict[str, Any]) -> bool:
    wait = message.get("wait", False)
    if not isinstance(wait, bool):
        raise _invalid("wait: must be true or false")
    return wait


def _stale_after_field(message: dict[str, Any]) -> float | None:
    """Optional `stale_after_s` of a lock: node monotonic seconds after which the clock is no longer
    worth applying once a newer one waits (older clients omit it: never stale)."""
    value = message.get("stale_after_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid("stale_after_s: must be a number of seconds (the node's monotonic clock)")
    return float(value)


def _power_limit_field(message: dict[str, Any]) -> float | None:
    """`watts` of a power_limit request, or None for `"reset": true` (exactly one of the two)."""
    watts, reset = message.get("watts"), message.get("reset", False)
    if not isinstance(reset, bool):
        raise _invalid("reset: must be true or false")
    if reset:
        if watts is not None:
            raise _invalid("watts: give either watts or reset: true, not both")
        return None
    if isinstance(watts, bool) or not isinstance(watts, (int, float)) or not math.isfinite(watts):
        raise _invalid("watts: must be a number of watts (the board power limit), or reset: true for the board's default")
    return float(watts)


def _int_field(message: dict[str, Any], name: str) -> int:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"{name}: must be an integer number of MHz")
    return value


def _effective_bounds(gpu: Any, config: NodeConfig) -> tuple[int, int]:
    """Policy bounds for the GPU's model, intersected with the clocks it supports. Without a policy
    floor, `default_floor_fraction` of the top clock is the floor: it bounds what a stolen token
    can do to its pod's GPU (slow it by at most that factor)."""
    bounds: ClockBounds = config.policy.clock_bounds_for(gpu.name)
    return bounds.range_mhz(gpu.supported_sm_clocks_mhz(), default_floor_fraction=config.default_floor_fraction)
