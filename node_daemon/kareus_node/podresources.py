"""Which pod holds which GPU, from the kubelet's pod-resources gRPC API.

The kubelet serves `PodResourcesLister.List` on a Unix socket
(`/var/lib/kubelet/pod-resources/kubelet.sock`): for every pod on the node, its containers and the
device ids each was allocated per resource. The NVIDIA device plugin's ids for `nvidia.com/gpu`
are GPU UUIDs; with time-slicing or MPS sharing they are *replica* ids `GPU-…::N`, and with MIG
they are `MIG-…` ids. With `DEVICE_ID_STRATEGY=index` the plugin reports NVML indices ("0",
"1", replicas "0::1") instead; the daemon passes its GPUs' index → UUID map (`gpu_index`, from the
GPU backend) so both spellings name the same GPU. `gpu_holders` turns the answer into GPU UUID →
the pods holding it, marking shared allocations, so authorisation can refuse a GPU another pod may
also be using.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

from kareus_node._proto import api_pb2, api_pb2_grpc

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesUnavailable(Exception):
    """The kubelet could not be asked; callers fail closed."""


@dataclass(frozen=True)
class GPUHolder:
    """A pod allocated a GPU; `shared` when through a time-slicing/MPS replica id."""

    namespace: str
    pod: str
    shared: bool


class PodResourcesClient:
    """A `List` client on the kubelet socket; one channel reused across calls."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = 2.0,
                 gpu_index: Mapping[int, str] | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.gpu_index = dict(gpu_index or {})
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        self._cached: tuple[float, dict[str, list[GPUHolder]]] | None = None
        self._lock = threading.Lock()

    def gpu_holders(self, *, max_age_s: float = 0.0) -> dict[str, list[GPUHolder]]:
        """GPU UUID → holders; an answer up to `max_age_s` old may be reused, so a burst of new
        connections costs the kubelet one call, not one each."""
        with self._lock:
            if self._cached and time.monotonic() - self._cached[0] <= max_age_s:
                return self._cached[1]
            try:
                response = self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
            except grpc.RpcError as error:
                self._cached = None
                raise PodResourcesUnavailable(
                    f"kubelet pod-resources API at {self.socket_path}: {error.code().name}"
                ) from None
            self._cached = (time.monotonic(), gpu_holders(response.pod_resources, self.gpu_index))
            return self._cached[1]

    def close(self) -> None:
        self._channel.close()


def gpu_holders(pods: Iterable[api_pb2.PodResources], gpu_index: Mapping[int, str] | None = None) -> dict[str, list[GPUHolder]]:
    """GPU UUID → the pods allocated it; device ids that are NVML indices are mapped to UUIDs
    through `gpu_index` (an index this node has no GPU for stays as it is: it matches no GPU)."""
    holders: dict[str, list[GPUHolder]] = {}
    for pod in pods:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name != GPU_RESOURCE:
                    continue
                for device_id in devices.device_ids:
                    uuid, replica_sep, _ = device_id.partition("::")
                    uuid = device_uuid(uuid, gpu_index or {})
                    holder = GPUHolder(pod.namespace, pod.name, shared=bool(replica_sep))
                    if holder not in holders.setdefault(uuid, []):
                        holders[uuid].append(holder)
    return holders


def device_uuid(device_id: str, gpu_index: Mapping[int, str]) -> str:
    """The GPU UUID a device-plugin id names: a UUID as it is, an NVML index ("3") through `gpu_index`.
    MIG ids in index form ("0:1") are not whole GPUs and stay unmapped, so they match none."""
    if device_id.isdecimal() and int(device_id) in gpu_index:
        return gpu_index[int(device_id)]
    return device_id
