"""The dev cluster's networks, all on this machine: a node network on a bridge, pod and Service networks
that exist only inside the nodes' network namespaces.

- **Node network**: a Linux bridge `kdbr<k>` in the host's namespace with `198.18.<k>.1/24` (RFC 2544's
  benchmarking range, meant for test networks), the API server's address. Each node is a network
  namespace `kd<k>-<node>` joined to the bridge by a veth pair, with `198.18.<k>.<10+i>`. Several dev
  clusters on one machine take different `k` (a lock file per slot).
- **Pod network**: inside node `i`, the CNI bridge plugin with host-local IPAM hands out `10.244.<i>.0/24`;
  every node routes the other nodes' pod ranges to their node address over the bridge. The host has no
  route into any pod range.
- **Services**: kube-proxy's iptables rules in each node's namespace (`10.96.0.0/16`).

Nothing leaves the machine: the nodes and pods have no default route, a pod's traffic to the API server
is masqueraded to its node's address (so the host, which has no pod routes, can answer), and the host
drops anything the bridge would forward elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kareus.errors import KareusError

POD_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
SLOTS = range(1, 200)
LOCK_DIR = Path("/run/kareus-dev")


def run(*argv: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    """A network command (in `netns` when given); a failure is one KareusError naming it."""
    command = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise KareusError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def sysctl(netns: str, key: str, value: str) -> None:
    """A per-namespace sysctl, written through the namespace's own /proc/sys."""
    run("sh", "-c", f"echo {value} > /proc/sys/{key.replace('.', '/')}", netns=netns)


@dataclass(frozen=True)
class NodeAddress:
    """Where one node sits on the networks."""

    index: int  # 0 for the first node
    netns: str
    ip: str
    pod_cidr: str | None  # None: a host on the node network that runs no pods (the dev Prometheus)
    veth_host: str

    @property
    def pod_gateway(self) -> str:
        assert self.pod_cidr is not None
        return self.pod_cidr.replace(".0/24", ".1")


class ClusterNetwork:
    """`create()` the bridge (taking a free slot), `add_node()` per node, `destroy()` everything."""

    def __init__(self) -> None:
        self.slot: int | None = None
        self._lock: int | None = None
        self.nodes: dict[str, NodeAddress] = {}
        self._next_index = 0

    @property
    def bridge(self) -> str:
        return f"kdbr{self.slot}"

    @property
    def gateway(self) -> str:
        """The host's address on the node network: the API server listens here."""
        return f"198.18.{self.slot}.1"

    @property
    def subnet(self) -> str:
        return f"198.18.{self.slot}.0/24"

    def create(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for slot in SLOTS:
            fd = os.open(LOCK_DIR / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.slot, self._lock = slot, fd
            break
        else:
            raise KareusError(f"no free dev-cluster network slot (all of {SLOTS.start}..{SLOTS.stop - 1} are held)")
        self._remove_leftovers()
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        # Defence in depth: whatever reaches the bridge stays between its ports.
        run("iptables", "-I", "FORWARD", "-i", self.bridge, "!", "-o", self.bridge, "-j", "DROP")
        run("iptables", "-I", "FORWARD", "-o", self.bridge, "!", "-i", self.bridge, "-j", "DROP")

    def _remove_leftovers(self) -> None:
        """What a dev cluster killed before its `destroy()` left in this slot."""
        for line in run("ip", "netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(f"kd{self.slot}-"):
                run("ip", "netns", "delete", name, check=False)
        run("ip", "link", "delete", self.bridge, check=False)
        for line in run("ip", "-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if name.startswith(f"kd{self.slot}v"):  # a veth whose node namespace something still holds
                run("ip", "link", "delete", name, check=False)
        for direction in ("-i", "-o"):
            other = "-o" if direction == "-i" else "-i"
            while run("iptables", "-D", "FORWARD", direction, self.bridge, "!", other, self.bridge, "-j", "DROP",
                      check=False).returncode == 0:
                pass

    def add_node(self, name: str, *, pods: bool = True) -> NodeAddress:
        """A node's namespace on the bridge, with its pod range routed to it from every other node (without
        `pods`, a host that only reaches the pods: it routes to every node's range and has none)."""
        assert self.slot is not None, "create() first"
        index = self._next_index
        self._next_index += 1
        if index > 200:
            raise KareusError("a dev cluster has at most 200 nodes")
        netns = f"kd{self.slot}-{name}"[:64]
        node = NodeAddress(index=index, netns=netns, ip=f"198.18.{self.slot}.{10 + index}",
                           pod_cidr=f"10.244.{index}.0/24" if pods else None, veth_host=f"kd{self.slot}v{index}")
        run("ip", "netns", "add", netns)
        run("ip", "link", "add", node.veth_host, "type", "veth", "peer", "name", "eth0", "netns", netns)
        run("ip", "link", "set", node.veth_host, "master", self.bridge, "up")
        run("ip", "link", "set", "lo", "up", netns=netns)
        run("ip", "addr", "add", f"{node.ip}/24", "dev", "eth0", netns=netns)
        run("ip", "link", "set", "eth0", "up", netns=netns)
        # A node's own processes (hostNetwork pods such as the node agent) reach ClusterIPs too: kube-proxy
        # rewrites them after the routing decision, which needs a route (nodes have no default route).
        run("ip", "route", "add", SERVICE_CIDR, "dev", "eth0", netns=netns)
        sysctl(netns, "net.ipv4.ip_forward", "1")
        sysctl(netns, "net.bridge.bridge-nf-call-iptables", "1")
        sysctl(netns, "net.ipv4.conf.all.route_localnet", "1")
        # Pods reach the API server through the `kubernetes` Service; the host has no pod routes, so the
        # node answers for them.
        run("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", POD_CIDR, "-d", f"{self.gateway}/32",
            "-j", "MASQUERADE", netns=netns)
        for other in self.nodes.values():
            if other.pod_cidr is not None:
                run("ip", "route", "add", other.pod_cidr, "via", other.ip, netns=netns)
            if node.pod_cidr is not None:
                run("ip", "route", "add", node.pod_cidr, "via", node.ip, netns=other.netns)
        self.nodes[name] = node
        return node

    def remove_node(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is None:
            return
        for other in self.nodes.values():
            if node.pod_cidr is not None:
                run("ip", "route", "del", node.pod_cidr, netns=other.netns, check=False)
        run("ip", "netns", "delete", node.netns, check=False)
        run("ip", "link", "delete", node.veth_host, check=False)

    def destroy(self) -> None:
        for name in list(self.nodes):
            self.remove_node(name)
        if self.slot is not None:
            self._remove_leftovers()
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock)
            self._lock = None
