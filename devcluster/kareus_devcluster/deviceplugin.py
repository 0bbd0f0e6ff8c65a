"""A device plugin for the dev cluster's simulated GPUs, speaking the kubelet's device-plugin API v1beta1.

On a dev-cluster node the real kubelet runs pods under containerd and runc; only the GPUs are
simulated: each is a state file `<uuid>.json` in the node's simulated-GPU directory, shared by every
process that uses it (`kareus.gpu.simdevice`). This plugin is what the NVIDIA device plugin is on a
GPU node: it serves the `DevicePlugin` service on a Unix socket in the kubelet's device-plugin
directory, registers it with the kubelet (`<plugin-dir>/kubelet.sock`), advertises one healthy
device per GPU UUID and, on Allocate, hands a container its GPUs the way the NVIDIA stack does —
`NVIDIA_VISIBLE_DEVICES` names their UUIDs — plus what a simulated GPU needs in place of
`/dev/nvidia*`: the node's simulated-GPU directory mounted read-write and named by
`KAREUS_SIM_GPU_DIR`.

The kubelet forgets its plugins when it restarts and wipes the device-plugin directory (our socket
with it) before creating a new `kubelet.sock`; like the NVIDIA plugin, this one then serves afresh
and registers again. It polls the two sockets' identities for that, which needs no inotify.

    python -m kareus_devcluster.deviceplugin --plugin-dir /var/lib/kubelet/device-plugins \\
        --uuid GPU-sim-0-... --uuid GPU-sim-1-... --sim-gpu-dir /var/lib/kareus/sim-gpus

prints `ready` on stdout once registered, logs to stderr, and stops on SIGTERM or SIGINT, removing
its socket.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from kareus_devcluster._proto import deviceplugin_pb2 as pb
from kareus_devcluster._proto import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger("kareus_devcluster.deviceplugin")

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME = "kubelet.sock"
DEFAULT_SOCKET_NAME = "kareus-sim-gpu.sock"
DEFAULT_CONTAINER_SIM_GPU_DIR = "/var/run/kareus/sim-gpus"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"  # kareus.gpu.simdevice reads these two; the core is not imported
SIM_GPU_DIR_ENV = "KAREUS_SIM_GPU_DIR"  # here, so the dev tool stays importable without numpy & co.
_STREAM_CHECK_S = 0.5  # how often an open ListAndWatch stream looks whether its server or client went away
_WORKERS = 8  # the kubelet holds one stream and makes one call at a time; the rest is headroom for tools

FileId = tuple[int, int, int]  # (device, inode, ctime in ns): a socket re-created in place is a new file


@dataclass(frozen=True)
class PluginConfig:
    """What one plugin serves: the node's GPUs, where the kubelet is, where the simulated GPUs live."""

    plugin_dir: Path
    uuids: tuple[str, ...]
    sim_gpu_host_dir: Path
    resource_name: str = GPU_RESOURCE
    sim_gpu_container_dir: str = DEFAULT_CONTAINER_SIM_GPU_DIR
    socket_name: str = DEFAULT_SOCKET_NAME
    poll_interval_s: float = 1.0
    register_timeout_s: float = 5.0

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.socket_name

    @property
    def kubelet_socket_path(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET_NAME


def file_identity(path: Path) -> FileId | None:
    """Which file `path` is now, or None if there is none."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns


def prepare_sim_gpu_dir(directory: Path, uuids: Sequence[str]) -> None:
    """Make the node's simulated-GPU directory usable by every container it is mounted into.

    The state files need not exist: a GPU nobody has accounted work on reads as a fresh counter. A
    directory made here is world-writable (not sticky: `SimDeviceFile` renames its temporary file
    over the state file, whoever wrote it last) and each GPU's lock file is made 0666 beforehand,
    since `SimDeviceFile` opens it read-write and one created by a root container under umask 022
    would lock every other user out.
    """
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o777)
    for uuid in uuids:
        lock_path = directory / f"{uuid}.lock"
        if not lock_path.exists():
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                os.fchmod(fd, 0o666)  # the mode os.open got was narrowed by the umask
            finally:
                os.close(fd)


def preferred_devices(uuids: Sequence[str], available: Sequence[str], must_include: Sequence[str],
                      size: int) -> list[str]:
    """The devices to give: those the kubelet must include, then the lowest-index available ones."""
    chosen = list(dict.fromkeys(must_include))
    rank = {uuid: index for index, uuid in enumerate(uuids)}
    rest = sorted((d for d in dict.fromkeys(available) if d in rank and d not in chosen), key=rank.__getitem__)
    return chosen + rest[:max(size - len(chosen), 0)]


class SimGpuService(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service for one serving of the socket (a fresh one each time it is served)."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self._closed = threading.Event()

    def close(self) -> None:
        """End the open ListAndWatch streams: they belong to a server (and a kubelet) being replaced."""
        self._closed.set()

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return plugin_options()

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=uuid, health=HEALTHY) for uuid in self.config.uuids])
        # A simulated GPU never turns unhealthy, so there is nothing more to send; the stream stays
        # open because the kubelet takes its end for the plugin's and marks the devices unhealthy.
        while context.is_active() and not self._closed.wait(_STREAM_CHECK_S):
            pass

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> pb.PreferredAllocationResponse:
        responses = [pb.ContainerPreferredAllocationResponse(deviceIDs=preferred_devices(
            self.config.uuids, r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size))
            for r in request.container_requests]
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        known = set(self.config.uuids)
        for container in request.container_requests:
            unknown = [d for d in container.devices_ids if d not in known]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown device id {unknown[0]!r} for {self.config.resource_name}: this node's "
                              f"simulated GPUs are {', '.join(self.config.uuids)}")
        if not self.config.sim_gpu_host_dir.is_dir():  # removed since the start: the mount's source must exist
            prepare_sim_gpu_dir(self.config.sim_gpu_host_dir, self.config.uuids)
        return pb.AllocateResponse(container_responses=[
            self._container_response(c.devices_ids) for c in request.container_requests])

    def _container_response(self, device_ids: Sequence[str]) -> pb.ContainerAllocateResponse:
        container_dir = self.config.sim_gpu_container_dir
        # Read-write: the container's ranks account their work in the shared state files.
        mount = pb.Mount(container_path=container_dir, host_path=str(self.config.sim_gpu_host_dir), read_only=False)
        envs = {VISIBLE_DEVICES_ENV: ",".join(device_ids), SIM_GPU_DIR_ENV: container_dir}
        return pb.ContainerAllocateResponse(envs=envs, mounts=[mount])

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()  # not asked for (pre_start_required is false)


def plugin_options() -> pb.DevicePluginOptions:
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


@dataclass
class _Serving:
    """One serving of the plugin's socket, and the kubelet (its socket's identity) it registered with."""

    server: grpc.Server
    service: SimGpuService
    socket_id: FileId | None
    registered_with: FileId | None = None


class SimGpuDevicePlugin:
    """Serves the plugin's socket and keeps it registered with whichever kubelet runs now."""

    def __init__(self, config: PluginConfig, on_registered: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.registrations = 0
        self._on_registered = on_registered
        self._serving: _Serving | None = None

    def run(self, stop: threading.Event) -> None:
        """Serve and register until `stop` is set, then stop serving and remove the socket."""
        prepare_sim_gpu_dir(self.config.sim_gpu_host_dir, self.config.uuids)
        try:
            while True:
                self.step()
                if stop.wait(self.config.poll_interval_s):
                    return
        finally:
            self._stop_serving()

    def step(self) -> None:
        """One look at the sockets: serve again if the kubelet restarted, register if not yet done."""
        kubelet_id = file_identity(self.config.kubelet_socket_path)
        serving = self._serving
        if serving is not None and serving.registered_with not in (None, kubelet_id):
            log.info("the kubelet's socket was removed or replaced: serving and registering again")
            serving = None
        elif serving is not None and (serving.socket_id is None
                                      or file_identity(self.config.socket_path) != serving.socket_id):
            log.info("the plugin socket %s was removed (a kubelet restart): serving it again", self.config.socket_path)
            serving = None
        if serving is None:
            self._stop_serving()
            serving = self._serving = self._start_serving()
        if kubelet_id is not None and serving.registered_with is None and self._register():
            serving.registered_with = kubelet_id
            self.registrations += 1
            if self._on_registered is not None:
                self._on_registered(self.registrations)

    def _start_serving(self) -> _Serving:
        self.config.plugin_dir.mkdir(parents=True, exist_ok=True)
        service = SimGpuService(self.config)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="sim-gpu-plugin"))
        pb_grpc.add_DevicePluginServicer_to_server(service, server)
        server.add_insecure_port(f"unix:{self.config.socket_path}")  # replaces a stale socket file left there
        server.start()
        log.info("serving %s for %d simulated GPUs on %s", self.config.resource_name, len(self.config.uuids),
                 self.config.socket_path)
        return _Serving(server, service, file_identity(self.config.socket_path))

    def _stop_serving(self) -> None:
        serving, self._serving = self._serving, None
        if serving is None:
            return
        serving.service.close()
        serving.server.stop(grace=1.0).wait(timeout=5.0)
        # Remove only our own socket file: after a kubelet restart the path may be nobody's or a new one's.
        if serving.socket_id is not None and file_identity(self.config.socket_path) == serving.socket_id:
            self.config.socket_path.unlink(missing_ok=True)

    def _register(self) -> bool:
        """Register with the kubelet; False (logged, retried at the next poll) if it does not answer."""
        request = pb.RegisterRequest(version=API_VERSION, endpoint=self.config.socket_name,
                                     resource_name=self.config.resource_name, options=plugin_options())
        try:
            with grpc.insecure_channel(f"unix:{self.config.kubelet_socket_path}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=self.config.register_timeout_s,
                                                           wait_for_ready=True)
        except grpc.RpcError as error:
            log.warning("registering with the kubelet at %s failed (%s: %s); retrying",
                        self.config.kubelet_socket_path, error.code().name, error.details())
            return False
        log.info("registered %s with the kubelet at %s", self.config.resource_name, self.config.kubelet_socket_path)
        return True


def _parse_args(argv: Sequence[str] | None) -> PluginConfig:
    parser = argparse.ArgumentParser(prog="python -m kareus_devcluster.deviceplugin",
                                     description="The dev cluster's simulated-GPU device plugin (API v1beta1).")
    parser.add_argument("--plugin-dir", default=DEFAULT_PLUGIN_DIR, help="the kubelet's device-plugin directory")
    parser.add_argument("--resource", default=GPU_RESOURCE, help="the extended resource the devices are")
    parser.add_argument("--uuid", action="append", required=True, dest="uuids",
                        help="a simulated GPU's UUID, in index order (repeat for each GPU)")
    parser.add_argument("--sim-gpu-dir", required=True, help="the node's simulated-GPU state directory (host path)")
    parser.add_argument("--container-sim-gpu-dir", default=DEFAULT_CONTAINER_SIM_GPU_DIR,
                        help="where containers see that directory (also their KAREUS_SIM_GPU_DIR)")
    parser.add_argument("--socket-name", default=DEFAULT_SOCKET_NAME, help="the plugin's socket in --plugin-dir")
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="how often to look for a kubelet restart")
    args = parser.parse_args(argv)
    if len(set(args.uuids)) != len(args.uuids):
        parser.error("--uuid: each GPU must be named once")
    if args.poll_interval_s <= 0:
        parser.error("--poll-interval-s: must be > 0")
    return PluginConfig(plugin_dir=Path(args.plugin_dir).absolute(), uuids=tuple(args.uuids),
                        sim_gpu_host_dir=Path(args.sim_gpu_dir).absolute(), resource_name=args.resource,
                        sim_gpu_container_dir=args.container_sim_gpu_dir, socket_name=args.socket_name,
                        poll_interval_s=args.poll_interval_s)


def _announce_ready(registrations: int) -> None:
    if registrations == 1:  # the dev cluster waits for this line once; later registrations are in the log
        print("ready", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    config = _parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    SimGpuDevicePlugin(config, on_registered=_announce_ready).run(stop)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
