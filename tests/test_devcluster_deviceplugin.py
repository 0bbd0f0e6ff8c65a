"""The simulated-GPU device plugin against the kubelet's side of the device-plugin API v1beta1.

Real gRPC over real Unix sockets: a Registration server stands in for the kubelet's
`kubelet.sock` and records what the plugin registers; the tests then call the plugin on its socket
as the kubelet does. Waits are bounded; no test times anything.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from kareus_devcluster._proto import deviceplugin_pb2 as pb
from kareus_devcluster._proto import deviceplugin_pb2_grpc as pb_grpc
from kareus_devcluster.deviceplugin import (
    DEFAULT_CONTAINER_SIM_GPU_DIR,
    DEFAULT_SOCKET_NAME,
    PluginConfig,
    SimGpuDevicePlugin,
    main,
    preferred_devices,
)

pytestmark = pytest.mark.timeout(60)

UUIDS = tuple(f"GPU-sim-{i}-0000-0000-0000-00000000000{i}" for i in range(4))
WAIT_S = 20.0  # the bound on every wait: generous, since the machine may be busy
POLL_S = 0.05


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


class FakeKubelet(pb_grpc.RegistrationServicer):
    """The kubelet's registration endpoint: records every RegisterRequest."""

    def __init__(self, socket_path: Path) -> None:
        self.requests: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{socket_path}")
        self.server.start()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.requests.put(request)
        return pb.Empty()

    def next_request(self) -> pb.RegisterRequest:
        return self.requests.get(timeout=WAIT_S)

    def stop(self) -> None:
        self.server.stop(grace=None).wait(timeout=WAIT_S)


@pytest.fixture
def node_dir() -> Iterator[Path]:
    # Not tmp_path: a Unix socket's path must stay under ~107 bytes, and pytest's can be long.
    path = Path(tempfile.mkdtemp(prefix="kdp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin_dir(node_dir: Path) -> Path:
    path = node_dir / "device-plugins"
    path.mkdir()
    return path


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plugin_dir / "kubelet.sock")
    yield fake
    fake.stop()


def plugin_config(node_dir: Path, plugin_dir: Path) -> PluginConfig:
    return PluginConfig(plugin_dir=plugin_dir, uuids=UUIDS, sim_gpu_host_dir=node_dir / "sim-gpus",
                        poll_interval_s=POLL_S)


@contextlib.contextmanager
def running(plugin: SimGpuDevicePlugin) -> Iterator[SimGpuDevicePlugin]:
    stop = threading.Event()
    thread = threading.Thread(target=plugin.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield plugin
    finally:
        stop.set()
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive()


@pytest.fixture
def plugin(node_dir: Path, plugin_dir: Path, kubelet: FakeKubelet) -> Iterator[SimGpuDevicePlugin]:
    with running(SimGpuDevicePlugin(plugin_config(node_dir, plugin_dir))) as started:
        registered(started, kubelet)
        yield started


def registered(plugin: SimGpuDevicePlugin, kubelet: FakeKubelet, count: int = 1) -> pb.RegisterRequest:
    """The request `kubelet` got, once the plugin has its answer (a kubelet stopped before it answered
    would leave the plugin retrying) and has registered `count` times in all."""
    request = kubelet.next_request()
    wait_for(lambda: plugin.registrations == count, f"registration {count} to be answered")
    return request


@contextlib.contextmanager
def device_plugin(socket_path: Path) -> Iterator[pb_grpc.DevicePluginStub]:
    """The plugin as the kubelet dials it: its endpoint in the device-plugin directory."""
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        yield pb_grpc.DevicePluginStub(channel)


def allocate(socket_path: Path, *containers: list[str]) -> pb.AllocateResponse:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
    with device_plugin(socket_path) as stub:
        return stub.Allocate(request, timeout=WAIT_S)


def first_devices(socket_path: Path) -> list[tuple[str, str]]:
    with device_plugin(socket_path) as stub:
        stream = stub.ListAndWatch(pb.Empty(), timeout=WAIT_S)
        first = next(stream)
        stream.cancel()
    return [(d.ID, d.health) for d in first.devices]


# ---------------------------------------------------------------- registration and the device list

def test_it_registers_its_socket_for_the_gpu_resource(node_dir, plugin_dir, kubelet):
    with running(SimGpuDevicePlugin(plugin_config(node_dir, plugin_dir))) as plugin:
        request = registered(plugin, kubelet)
        assert request.version == "v1beta1" and request.resource_name == "nvidia.com/gpu"
        assert request.endpoint == DEFAULT_SOCKET_NAME and (plugin_dir / request.endpoint).is_socket()
        assert request.options.get_preferred_allocation_available and not request.options.pre_start_required
    assert not (plugin_dir / DEFAULT_SOCKET_NAME).exists()  # stopping removes the socket


def test_list_and_watch_advertises_every_gpu_healthy_and_keeps_the_stream_open(node_dir, plugin_dir, kubelet):
    received: list[pb.ListAndWatchResponse] = []
    with device_plugin(plugin_dir / DEFAULT_SOCKET_NAME) as stub:  # the channel outlives the plugin
        with running(SimGpuDevicePlugin(plugin_config(node_dir, plugin_dir))):
            kubelet.next_request()
            stream = stub.ListAndWatch(pb.Empty())
            first = next(stream)
            assert [(d.ID, d.health) for d in first.devices] == [(u, "Healthy") for u in UUIDS]
            assert not stream.done()  # the kubelet takes a closed stream for a plugin gone
            reader = threading.Thread(target=lambda: received.extend(_drain(stream)), daemon=True)
            reader.start()
        # The plugin stopped: only now does the stream end, having sent nothing more.
        reader.join(timeout=WAIT_S)
        assert not reader.is_alive() and received == []


def _drain(stream: Iterator[pb.ListAndWatchResponse]) -> list[pb.ListAndWatchResponse]:
    with contextlib.suppress(grpc.RpcError):  # the server going away ends it as CANCELLED or UNAVAILABLE
        return list(stream)
    return []


def test_it_offers_the_options_it_registered(plugin, plugin_dir):
    with device_plugin(plugin_dir / DEFAULT_SOCKET_NAME) as stub:
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=WAIT_S)
        assert options.get_preferred_allocation_available and not options.pre_start_required
        assert stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[UUIDS[0]]), timeout=WAIT_S) \
            == pb.PreStartContainerResponse()


# ---------------------------------------------------------------- allocation

def test_allocate_names_the_gpus_and_mounts_the_sim_gpu_dir_for_one_and_two_devices(plugin, node_dir, plugin_dir):
    response = allocate(plugin_dir / DEFAULT_SOCKET_NAME, [UUIDS[2]], [UUIDS[0], UUIDS[3]])
    one, two = response.container_responses
    host_dir = node_dir / "sim-gpus"
    for container, ids in ((one, [UUIDS[2]]), (two, [UUIDS[0], UUIDS[3]])):
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids),
                                        "KAREUS_SIM_GPU_DIR": DEFAULT_CONTAINER_SIM_GPU_DIR}
        assert [(m.host_path, m.container_path, m.read_only) for m in container.mounts] == \
            [(str(host_dir), DEFAULT_CONTAINER_SIM_GPU_DIR, False)]
        assert not container.devices and not container.cdi_devices
    # The mount's source exists and any container's user can account work in it (kareus.gpu.simdevice).
    assert host_dir.is_dir() and host_dir.stat().st_mode & 0o777 == 0o777
    assert all((host_dir / f"{u}.lock").stat().st_mode & 0o777 == 0o666 for u in UUIDS)
    shutil.rmtree(host_dir)  # a node cleaned up under the plugin: Allocate makes the mount's source again
    allocate(plugin_dir / DEFAULT_SOCKET_NAME, [UUIDS[1]])
    assert host_dir.is_dir()


def test_allocate_refuses_a_device_it_does_not_have(plugin, plugin_dir):
    with pytest.raises(grpc.RpcError) as refused:
        allocate(plugin_dir / DEFAULT_SOCKET_NAME, [UUIDS[0]], [UUIDS[1], "GPU-not-here"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-not-here" in refused.value.details()


def test_preferred_allocation_takes_the_required_gpus_then_the_lowest_indices(plugin, plugin_dir):
    def request(available: list[str], must: list[str], size: int) -> pb.ContainerPreferredAllocationRequest:
        return pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=must,
                                                      allocation_size=size)

    shuffled = [UUIDS[3], UUIDS[1], UUIDS[2], UUIDS[0]]
    with device_plugin(plugin_dir / DEFAULT_SOCKET_NAME) as stub:
        response = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            request(shuffled, [UUIDS[2]], 2), request(shuffled, [], 3), request(shuffled[:2], [], 1)]), timeout=WAIT_S)
    assert [list(r.deviceIDs) for r in response.container_responses] == \
        [[UUIDS[2], UUIDS[0]], [UUIDS[0], UUIDS[1], UUIDS[2]], [UUIDS[1]]]


def test_preferred_devices_ignores_ids_it_does_not_have_and_duplicates():
    assert preferred_devices(UUIDS, ["GPU-x", UUIDS[1], UUIDS[1], UUIDS[0]], [UUIDS[1]], 2) == [UUIDS[1], UUIDS[0]]
    assert preferred_devices(UUIDS, [UUIDS[1]], [], 3) == [UUIDS[1]]  # never more than is available


# ---------------------------------------------------------------- kubelet restarts

def test_it_registers_again_when_the_kubelet_restarts_and_wipes_its_directory(node_dir, plugin_dir, kubelet):
    with running(SimGpuDevicePlugin(plugin_config(node_dir, plugin_dir))) as plugin:
        registered(plugin, kubelet)
        kubelet.stop()
        for entry in plugin_dir.iterdir():  # what the kubelet's device manager does when it starts
            entry.unlink(missing_ok=True)  # the plugin may have removed its own meanwhile
        restarted = FakeKubelet(plugin_dir / "kubelet.sock")
        try:
            assert registered(plugin, restarted, count=2).endpoint == DEFAULT_SOCKET_NAME
            assert first_devices(plugin_dir / DEFAULT_SOCKET_NAME) == [(u, "Healthy") for u in UUIDS]
        finally:
            restarted.stop()


def test_it_registers_again_when_only_the_kubelet_socket_is_replaced(node_dir, plugin_dir, kubelet):
    with running(SimGpuDevicePlugin(plugin_config(node_dir, plugin_dir))) as plugin:
        registered(plugin, kubelet)
        # A new kubelet's socket renamed over the old one: a new file for certain (both exist at once).
        restarted = FakeKubelet(plugin_dir / "kubelet.new.sock")
        try:
            os.replace(plugin_dir / "kubelet.new.sock", plugin_dir / "kubelet.sock")
            assert registered(plugin, restarted, count=2).resource_name == "nvidia.com/gpu"
            assert first_devices(plugin_dir / DEFAULT_SOCKET_NAME)[0] == (UUIDS[0], "Healthy")
        finally:
            restarted.stop()
    assert kubelet.requests.empty()  # the old kubelet heard nothing more


def test_it_waits_for_a_kubelet_that_is_not_up_yet(node_dir, plugin_dir):
    with running(SimGpuDevicePlugin(plugin_config(node_dir, plugin_dir))) as plugin:
        wait_for(lambda: (plugin_dir / DEFAULT_SOCKET_NAME).is_socket(), "the plugin to serve its socket")
        assert plugin.registrations == 0
        late = FakeKubelet(plugin_dir / "kubelet.sock")
        try:
            assert registered(plugin, late).version == "v1beta1"
        finally:
            late.stop()


# ---------------------------------------------------------------- the command

def _read_line(stream, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, "no line from the plugin in time"
    return stream.readline()


def test_the_command_announces_ready_serves_and_stops_on_sigterm(node_dir, plugin_dir, kubelet):
    sim_dir = node_dir / "node" / "sim-gpus"
    command = [sys.executable, "-m", "kareus_devcluster.deviceplugin", "--plugin-dir", str(plugin_dir),
               "--resource", "nvidia.com/gpu", "--uuid", UUIDS[0], "--uuid", UUIDS[1], "--sim-gpu-dir", str(sim_dir),
               "--container-sim-gpu-dir", "/sim", "--poll-interval-s", "0.1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _read_line(process.stdout, WAIT_S) == "ready\n"
        assert kubelet.next_request().endpoint == DEFAULT_SOCKET_NAME
        assert sim_dir.is_dir()
        container = allocate(plugin_dir / DEFAULT_SOCKET_NAME, [UUIDS[1], UUIDS[0]]).container_responses[0]
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[0]}", "KAREUS_SIM_GPU_DIR": "/sim"}
        assert [(m.host_path, m.container_path) for m in container.mounts] == [(str(sim_dir), "/sim")]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)
        stderr = process.stderr.read()
        process.stdout.close()
        process.stderr.close()
    assert "registered nvidia.com/gpu" in stderr
    assert not (plugin_dir / DEFAULT_SOCKET_NAME).exists()


def test_the_command_refuses_a_gpu_named_twice(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--uuid", UUIDS[0], "--uuid", UUIDS[0], "--sim-gpu-dir", "/nonexistent"])
    assert refused.value.code == 2 and "each GPU must be named once" in capsys.readouterr().err
