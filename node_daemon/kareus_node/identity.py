"""Who is calling: the kernel-vouched credentials of a Unix-socket peer and the pod it runs in.

`peer_credentials` asks the kernel (SO_PEERCRED) for the pid, uid and gid of the process that
connected; a client cannot lie about them. A pid is only a number, which the kernel hands to a new
process once the old one exited, so the pod is read at accept time through a *pidfd* — the
socket's own (SO_PEERPIDFD, Linux ≥ 6.5) or one opened on the pid — and kept only if that process
had not exited by the end of the read (`pinned_pod_uid`); the session's identity then stays what it
was at accept, whatever later happens to the number. `pod_uid_of(pid)` reads `/proc/<pid>/cgroup` (below a
configurable proc root, so tests can supply a fake one) and finds the pod UID in the kubelet's
cgroup naming, which comes in several spellings:

- cgroupfs driver:  ``/kubepods/burstable/pod1b2c…-…/<container>``
- systemd driver:   ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c…_…_….slice/cri-containerd-….scope``
  (the UID's dashes become underscores there)

in cgroup v1 files (one line per controller) and v2 (one ``0::`` line). A process whose lines
name no pod, or two different pods, has no pod identity.

The kernel renders those paths relative to the *reader's* cgroup namespace. On cgroup v2 the
container runtime gives every unprivileged container its own (containerd does; privileged ones keep
the host's), so a node agent in `securityMode: capabilities` would read ``0::/../../pod<uid>/<ctr>``:
under the systemd driver the slice names still say ``kubepods-…-pod<uid>.slice``, under cgroupfs
nothing says ``kubepods`` any more. `enter_host_cgroup_namespace` moves the daemon into the host's
cgroup namespace (that of pid 1, visible with hostPID; setns needs CAP_SYS_ADMIN, which both
security modes have) so both drivers read as on the host.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_UCRED = struct.Struct("3i")
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5
_POD_UID = re.compile(
    r"kubepods.*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice|/|$)",
    re.MULTILINE,
)


@dataclass(frozen=True)
class PeerCredentials:
    """The connecting process as the kernel saw it at connect time."""

    pid: int
    uid: int
    gid: int
    pod_uid: str | None = None  # the pod read at accept (None: none, or not read)
    pinned: bool = False  # the pod was read at accept: later reads of the pid must not replace it


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


def peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd of the socket's peer: the kernel's (exact), else one opened on `pid` now (the peer,
    unless it already exited and the pid was reused in the instants since connect); None when the
    process is gone."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4)
        return struct.unpack("i", raw)[0]
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def pinned_pod_uid(pidfd: int | None, pid: int, *, proc_root: str | Path = "/proc") -> str | None:
    """The pod of process `pid`, read while `pidfd` proves it is still that process: a pidfd turns
    readable when its process exits, after which the pid (and its /proc entry) may be another's."""
    if pidfd is None:
        return None
    try:
        uid = pod_uid_of(pid, proc_root=proc_root)
        exited, _, _ = select.select([pidfd], [], [], 0)
        return None if exited else uid
    finally:
        os.close(pidfd)


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID named by a `/proc/<pid>/cgroup` file's content; None if none or ambiguous."""
    uids = {match.group(1).replace("_", "-") for match in _POD_UID.finditer(text)}
    return uids.pop() if len(uids) == 1 else None


def pod_uid_of(pid: int, *, proc_root: str | Path = "/proc") -> str | None:
    """The pod UID of process `pid`; None when it is gone or not in a pod."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return pod_uid_from_cgroup(text)


CLONE_NEWCGROUP = 0x02000000


def enter_host_cgroup_namespace(proc_root: str | Path = "/proc") -> str:
    """Join the cgroup namespace of pid 1 under `proc_root` unless already in it; "" when in it (or
    there is none to see), else a warning saying why not. Call before any thread starts."""
    host = Path(proc_root) / "1" / "ns" / "cgroup"
    try:
        wanted = os.readlink(host)
        current = os.readlink("/proc/self/ns/cgroup")
    except OSError:
        return ""  # no cgroup namespaces here (or a fake proc root): nothing to join
    if wanted == current:
        return ""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(host, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        return f"cannot open the host cgroup namespace {host} ({error.strerror}); pod identification may fail under the cgroupfs driver"
    try:
        if libc.setns(fd, CLONE_NEWCGROUP) != 0:
            err = ctypes.get_errno()
            return (f"cannot join the host cgroup namespace ({os.strerror(err)}; needs CAP_SYS_ADMIN and hostPID); "
                    f"pod identification may fail under the cgroupfs driver")
    finally:
        os.close(fd)
    return ""
