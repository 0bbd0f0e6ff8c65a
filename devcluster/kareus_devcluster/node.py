"""A real node: the upstream kubelet with containerd and runc, kube-proxy, and a simulated-GPU device plugin.

Like one of kind's node containers, each node has its own network namespace (`network.ClusterNetwork`)
and its own mount namespace, in which the node's directory replaces `/var`, `/run` and `/etc/cni`: so the
kubelet's `/var/lib/kubelet`, containerd's `/var/lib/containerd` and `/run/containerd`, the CNI state and
every hostPath a pod mounts are the node's own. The kubelet puts its pods under a cgroup root of its own
(`/kd<slot>-<node>` in every cgroup v1 hierarchy), so nodes do not collide.

- containerd runs the node's pods with runc (cgroupfs), with the CNI bridge plugin for pod addresses; the
  images (`make images`) are imported into it, since no registry can be pulled here.
- the kubelet registers the node with its own certificate (`system:node:<name>`), serves its API with a
  certificate the cluster CA signed (so `kubectl logs`, `exec` and `port-forward` go through it), and sets
  the labels NVIDIA's GPU Feature Discovery sets, and the `nvidia.com/gpu` taint if asked.
- kube-proxy (iptables) programs the Services.
- `kareus_devcluster.deviceplugin` advertises the node's simulated GPUs through the kubelet's real
  device-plugin API. Only the GPU is simulated.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kareus.errors import KareusError
from kareus_devcluster.controlplane import stop_process
from kareus_devcluster.network import POD_CIDR, NodeAddress

CLUSTER_DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN_DIR = "/usr/lib/cni"
SIM_GPU_DIR = "/var/lib/kareus-sim-gpus"  # on the node and in its containers: GPU pods and the node agent share it
CGROUP_V1 = Path("/sys/fs/cgroup")
STARTUP_TIMEOUT_S = 120.0
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeSpec:
    """What the node looks like to the cluster."""

    name: str
    gpus: int = 8
    gpu_product: str = "A100-SXM4-40GB"
    gpu_memory_mib: int = 40960
    gpu_uuids: tuple[str, ...] = ()
    taint_gpus: bool = False
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)

    def node_labels(self) -> dict[str, str]:
        """The labels GPU Feature Discovery puts on a GPU node (and kind's instance type)."""
        labels = {"node.kubernetes.io/instance-type": "kareus-dev"}
        if self.gpus:
            product = self.gpu_product if self.gpu_product.startswith("NVIDIA") else f"NVIDIA-{self.gpu_product}"
            labels |= {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": product,
                       "nvidia.com/gpu.count": str(self.gpus), "nvidia.com/gpu.memory": str(self.gpu_memory_mib),
                       "nvidia.com/gpu.family": gpu_family(self.gpu_product), "nvidia.com/gpu.machine": "kareus-dev",
                       "nvidia.com/mig.capable": "false", "nvidia.com/gpu.sharing-strategy": "none",
                       "nvidia.com/gpu.deploy.device-plugin": "true"}
        return labels | dict(self.labels)


def gpu_family(product: str) -> str:
    families = {"A100": "ampere", "A10": "ampere", "A30": "ampere", "H100": "hopper", "H200": "hopper",
                "B200": "blackwell", "L4": "ada-lovelace", "L40": "ada-lovelace", "V100": "volta"}
    return next((family for prefix, family in families.items() if prefix in product.upper()), "unknown")


@dataclass(frozen=True)
class Credentials:
    """The files a node's components authenticate with."""

    ca_file: Path
    kubelet_kubeconfig: Path
    proxy_kubeconfig: Path
    serving_cert: Path
    serving_key: Path


class RealNode:
    """`start()` brings the node up (its processes, the images imported); `stop()` removes every trace."""

    def __init__(self, spec: NodeSpec, address: NodeAddress, root: Path, *, binaries: Path,
                 credentials: Credentials, images: Sequence[tuple[str, Path]], slot: int,
                 image_root: Path | None = None) -> None:
        self.spec, self.address, self.root = spec, address, root
        self.bin, self.credentials, self.images = binaries, credentials, list(images)
        self.image_root = image_root  # a containerd root with the images unpacked (`image_store`)
        self.cgroup_root = f"/kd{slot}-{spec.name}"
        self.processes: dict[str, subprocess.Popen] = {}
        self.holder: subprocess.Popen | None = None
        self.log_dir = root / "logs"

    @property
    def name(self) -> str:
        return self.spec.name

    # ------------------------------------------------------------------ paths as the host sees them

    def host_path(self, node_path: str) -> Path:
        """Where a path of the node's filesystem lies on the host (only /var, /run and /etc/cni differ)."""
        for top in ("/var", "/run", "/etc/cni"):
            if node_path == top or node_path.startswith(top + "/"):
                return self.root / node_path.lstrip("/")
        return Path(node_path)

    @property
    def pod_resources_socket(self) -> Path:
        return self.host_path("/var/lib/kubelet/pod-resources/kubelet.sock")

    @property
    def sim_gpu_dir(self) -> Path:
        return self.host_path(SIM_GPU_DIR)

    @property
    def containerd_socket(self) -> Path:
        return self.host_path("/run/containerd/containerd.sock")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for directory in ("var/lib/kubelet", "var/lib/containerd", "var/log", "var/lib/cni", "run",
                          "etc/cni/net.d", "config", "logs", SIM_GPU_DIR.lstrip("/")):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        # Pods of any user account on the simulated GPUs (their state files are replaced by rename): no
        # sticky bit, writable by all, as the device plugin makes it.
        self.sim_gpu_dir.chmod(0o777)
        (self.root / "var/run").unlink(missing_ok=True)
        (self.root / "var/run").symlink_to("/run")
        # A dev cluster killed before its stop() (the same slot and node name) left its pods running.
        self._kill_cgroup_root()
        self._remove_cgroup_root()
        self._make_cgroup_root()
        self._write_configs()
        self._start_holder()
        if self.image_root is not None:
            seed_containerd_root(self.image_root, self.host_path("/var/lib/containerd"))
        self._spawn("containerd", ["containerd", "--config", str(self.root / "config/containerd.toml")])
        self._wait("containerd's socket", lambda: self.containerd_socket.exists())
        self._import_images()
        self._spawn("kubelet", [str(self.bin / "kubelet"), *self._kubelet_args()])
        self._spawn("kube-proxy", [str(self.bin / "kube-proxy"), f"--config={self.root / 'config/kube-proxy.yaml'}",
                                   "--v=1"])
        if self.spec.gpus:
            self._start_device_plugin()

    def stop(self) -> None:
        """Everything in the node's mount namespace (the kubelet, containerd, the shims and the pods'
        processes) is killed, the device plugin stopped, the node's cgroups removed."""
        plugin = self.processes.pop("device-plugin", None)
        if plugin is not None:
            stop_process(plugin)
        kubelet = self.processes.pop("kubelet", None)
        if kubelet is not None:
            stop_process(kubelet)
        # The containers' processes, each in mount namespaces of their own, are all under the kubelet's
        # cgroup root: as when a node is powered off, they go first.
        self._kill_cgroup_root()
        if self.holder is not None:
            namespace = _mount_ns(self.holder.pid)
            for _ in range(3):  # a shim may fork while its siblings die
                victims = [pid for pid in _all_pids() if pid != self.holder.pid and _mount_ns(pid) == namespace]
                if not victims:
                    break
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
            stop_process(self.holder)
            self.holder = None
        for process in self.processes.values():
            stop_process(process)
        self.processes = {}
        self._remove_cgroup_root()
        # The mounts died with the namespace; what containerd unpacked is plain files now.
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.root / "var/lib/containerd"),
                        str(self.root / "run")], check=False, capture_output=True)

    def restart_kubelet(self) -> None:
        """The kubelet alone stops and starts again (its pods keep running, as on a real node)."""
        stop_process(self.processes.pop("kubelet"))
        self._spawn("kubelet", [str(self.bin / "kubelet"), *self._kubelet_args()])

    def dead(self) -> str | None:
        """The name of a component that exited, if any."""
        return next((name for name, process in self.processes.items() if process.poll() is not None), None)

    # ------------------------------------------------------------------ the namespaces

    def _start_holder(self) -> None:
        """A process that holds the node's mount namespace: its `/var`, `/run` and `/etc/cni` are the
        node's, the rest is the host's (received, never sent back: a slave of the host's mounts), and its
        mounts propagate to the containers' namespaces (rshared, as kubelet's mount propagation needs)."""
        script = ("set -e; mount --make-rshared /; "
                  f"mount --bind {self.root}/var /var; mount --bind {self.root}/run /run; "
                  f"mount --bind {self.root}/etc/cni /etc/cni; echo ready; exec sleep infinity")
        self.holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.address.netns}", "unshare", "--mount", "--propagation", "slave",
             "sh", "-c", script], stdout=subprocess.PIPE, stderr=open(self.log_dir / "holder.log", "ab"),  # noqa: SIM115
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, cwd="/")
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "ready":
            raise KareusError(f"node {self.spec.name}: its mount namespace could not be set up: "
                              f"{(self.log_dir / 'holder.log').read_text(errors='replace')[-500:]}")

    def _enter(self, argv: Sequence[str]) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--net=/run/netns/{self.address.netns}", f"--mount=/proc/{self.holder.pid}/ns/mnt",
                "--wd=/", *argv]

    def _spawn(self, name: str, argv: Sequence[str], *, inside: bool = True, env: Mapping[str, str] | None = None,
               stdout: int | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (owned by the process)
        try:
            process = subprocess.Popen(self._enter(argv) if inside else list(argv), stdout=stdout or log,
                                       stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, cwd="/",
                                       env={**os.environ, **(env or {})}, text=stdout is not None)
        finally:
            log.close()
        self.processes[name] = process
        return process

    def _make_cgroup_root(self) -> None:
        for hierarchy in _cgroup_hierarchies():
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            for knob in ("cpuset.cpus", "cpuset.mems"):  # a new cpuset is empty until given its parent's
                if (path / knob).exists() and not (path / knob).read_text().strip():
                    (path / knob).write_text((hierarchy / knob).read_text())

    def _kill_cgroup_root(self) -> None:
        for _ in range(3):  # a process may fork while its siblings die
            pids = {int(pid) for directory in self._cgroup_dirs()
                    for pid in _read(directory / "cgroup.procs").split()}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def _remove_cgroup_root(self) -> None:
        for directory in sorted(self._cgroup_dirs(), key=lambda p: -len(p.parts)):  # leaves first
            with contextlib.suppress(OSError):
                directory.rmdir()

    def _cgroup_dirs(self) -> list[Path]:
        """The node's cgroup root and every cgroup under it, in every hierarchy. os.walk, since
        containerd removes a dead container's cgroup while the walk runs (pathlib's rglob raised
        FileNotFoundError there, under load, and the node's stop ended half done)."""
        return [Path(top) for hierarchy in _cgroup_hierarchies(unified=True)
                for top, _, _ in os.walk(hierarchy / self.cgroup_root.lstrip("/"))]

    # ------------------------------------------------------------------ configuration

    def _write_configs(self) -> None:
        config = self.root / "config"
        (config / "containerd.toml").write_text(CONTAINERD_CONFIG)
        (self.root / "etc/cni/net.d/10-kareus.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "kareus", "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.address.pod_cidr,
                                                             "gateway": self.address.pod_gateway}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
        creds = self.credentials
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.address.ip, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(creds.ca_file)}},
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(creds.serving_cert), "tlsPrivateKeyFile": str(creds.serving_key),
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "cgroupsPerQOS": True,
            "failCgroupV1": False, "failSwapOn": False,
            "clusterDNS": [CLUSTER_DNS_IP], "clusterDomain": CLUSTER_DOMAIN,
            # No upstream resolver: a name outside the cluster resolves nowhere, off the machine least of all.
            "resolvConf": "",
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "maxPods": self.spec.max_pods, "serializeImagePulls": False,
            # The images cannot be pulled again: never garbage-collected, never evicted for disk.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "registerWithTaints": ([{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]
                                   if self.spec.taint_gpus and self.spec.gpus else []),
            "rotateCertificates": False, "serverTLSBootstrap": False,
            "nodeStatusReportFrequency": "20s", "nodeStatusUpdateFrequency": "5s",
            "shutdownGracePeriod": "0s",
        }
        (config / "kubelet.yaml").write_text(yaml.safe_dump(kubelet, sort_keys=False))
        proxy = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(creds.proxy_kubeconfig)}, "mode": "iptables",
            "clusterCIDR": POD_CIDR, "hostnameOverride": self.spec.name,
            "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
            # Leave the machine-wide conntrack table as it is (kind does the same).
            "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }
        (config / "kube-proxy.yaml").write_text(yaml.safe_dump(proxy, sort_keys=False))

    def _kubelet_args(self) -> list[str]:
        labels = ",".join(f"{key}={value}" for key, value in sorted(self.spec.node_labels().items()))
        return [f"--config={self.root / 'config/kubelet.yaml'}",
                f"--kubeconfig={self.credentials.kubelet_kubeconfig}",
                f"--hostname-override={self.spec.name}", f"--node-ip={self.address.ip}",
                f"--node-labels={labels}", "--v=1"]

    # ------------------------------------------------------------------ images and GPUs

    def _import_images(self) -> None:
        ctr = ["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io"]
        present = subprocess.run([*ctr, "images", "list", "--quiet"], capture_output=True, text=True,
                                 check=False).stdout.split()
        for reference, archive in self.images:
            if reference in present:
                continue
            result = subprocess.run([*ctr, "images", "import", str(archive)], capture_output=True, text=True,
                                    check=False)
            if result.returncode != 0:
                raise KareusError(f"node {self.spec.name}: importing {reference} from {archive} failed: "
                                  f"{result.stderr.strip()[-500:]}")

    def _start_device_plugin(self) -> None:
        """The device plugin runs on the node, as the NVIDIA device plugin's DaemonSet pod does (host
        paths): its socket beside the kubelet's, the simulated GPUs' directory the node's."""
        args = [sys.executable, "-m", "kareus_devcluster.deviceplugin",
                "--plugin-dir", "/var/lib/kubelet/device-plugins", "--resource", GPU_RESOURCE,
                "--sim-gpu-dir", SIM_GPU_DIR, "--container-sim-gpu-dir", SIM_GPU_DIR]
        for uuid in self.spec.gpu_uuids:
            args += ["--uuid", uuid]
        plugin = self._spawn("device-plugin", args, stdout=subprocess.PIPE)
        self._wait_line(plugin, "ready")

    def _wait_line(self, process: subprocess.Popen, expected: str) -> None:
        assert process.stdout is not None
        line = process.stdout.readline()
        if line.strip() != expected:
            raise KareusError(f"node {self.spec.name}: the device plugin did not start: "
                              f"{(self.log_dir / 'device-plugin.log').read_text(errors='replace')[-500:]}")

    def _wait(self, what: str, ready) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if (dead := self.dead()) is not None:
                raise KareusError(f"node {self.spec.name}: {dead} exited while waiting for {what}: "
                                  f"{(self.log_dir / f'{dead}.log').read_text(errors='replace')[-800:]}")
            if ready():
                return
            time.sleep(0.2)
        raise KareusError(f"node {self.spec.name}: timed out waiting for {what}")


CONTAINERD_CONFIG = """\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.grpc.v1.cri"]
  # Built by `make images` from upstream's pause.c: no registry can be pulled here.
  sandbox_image = "localhost/kareus/pause:0.1.0"
  # The project's machines grant root no CAP_SYS_RESOURCE, so no process may lower its oom_score_adj:
  # containers get containerd's own score as their floor (the setting rootless containerd uses).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
"""


METADATA_DBS = ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db")


def image_store(images: Sequence[tuple[str, Path]], cache: Path) -> Path:
    """A containerd root with every image imported and unpacked, kept between runs and brought up to date
    by importing only the archives it has not seen (layers it holds already are neither written nor
    unpacked again: a change of code rewrites the runtime image's last, small layer only).

    Importing the runtime image (several GB: the pinned torch) into every node's containerd took minutes
    a node; a node instead starts from hard links to this store (`seed_containerd_root`).
    """
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one update at a time: two would share containerd's state directory
        return _update_store(images, cache)


def _update_store(images: Sequence[tuple[str, Path]], cache: Path) -> Path:
    store = cache / "store"
    wanted = "".join(f"{ref} {archive}\n" for ref, archive in images)
    done = store / "imported"
    if done.exists() and done.read_text() == wanted:
        return store / "root"
    (store / "root").mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)  # while it changes, the store is no node's seed
    state = Path("/run/kareus-dev/image-store")
    subprocess.run(["rm", "-rf", str(state)], check=False)
    config = store / "containerd.toml"
    config.write_text(CONTAINERD_CONFIG.replace('root = "/var/lib/containerd"', f'root = "{store / "root"}"')
                      .replace('state = "/run/containerd"', f'state = "{state}"')
                      .replace('address = "/run/containerd/containerd.sock"', f'address = "{state}/c.sock"'))
    log = open(store / "containerd.log", "ab")  # noqa: SIM115  (owned by the process)
    # A private mount namespace: the snapshotter's temporary mounts while unpacking stay in it.
    daemon = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "containerd", "--config", str(config)],
                              stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    ctr = ["ctr", "--address", str(state / "c.sock"), "--namespace", "k8s.io"]
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (state / "c.sock").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise KareusError(f"the image store's containerd did not start: {store / 'containerd.log'}")
            time.sleep(0.2)
        for reference, archive in images:
            result = subprocess.run([*ctr, "images", "import", str(archive)], capture_output=True, text=True,
                                    check=False)
            if result.returncode != 0:
                raise KareusError(f"importing {reference} from {archive} failed: {result.stderr.strip()[-500:]}")
        # What older archives left behind (no image refers to it any more) goes: a synchronous GC.
        subprocess.run([*ctr, "content", "prune", "references"], capture_output=True, check=False)
    finally:
        stop_process(daemon, grace_s=30.0)
        subprocess.run(["rm", "-rf", str(state)], check=False)
    done.write_text(wanted)
    return store / "root"


def seed_containerd_root(store: Path, root: Path) -> None:
    """A node's containerd root as hard links into the image store: image layers and unpacked snapshots
    are never written in place (overlayfs only reads its lower directories), so they can be shared; the
    two metadata databases, which containerd writes, are copies."""
    if (root / METADATA_DBS[0]).exists():
        return  # already seeded (a restarted node keeps its own)
    root.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["cp", "-al", f"{store}/.", f"{root}/"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise KareusError(f"seeding {root} from the image store failed: {result.stderr.strip()[-300:]}")
    for db in METADATA_DBS:
        (root / db).unlink()
        subprocess.run(["cp", "-a", str(store / db), str(root / db)], check=True)


def _cgroup_hierarchies(*, unified: bool = False) -> list[Path]:
    """The mounted cgroup v1 hierarchies (cpu, memory, pids, …, the named systemd one); `unified`:
    with the v2 one of a hybrid host, where runc also puts the node's containers."""
    types = ("cgroup", "cgroup2") if unified else ("cgroup",)
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            separator = fields.index("-")
            if fields[separator + 1] in types:
                found.append(Path(fields[4]))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None
