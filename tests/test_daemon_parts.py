"""The node daemon's parts in isolation: cgroup parsing, config and allow-list loading, the journal,
the per-GPU worker, and the pod-resources answer → GPU holders mapping."""

from __future__ import annotations

import json
import os
import socket

import pytest
from kareus_node._proto import api_pb2
from kareus_node.auth import AllowRule, StandaloneAuthorizer, load_allow_list
from kareus_node.config import ConfigError, load_config, parse_config
from kareus_node.identity import PeerCredentials, peer_credentials, pod_uid_from_cgroup
from kareus_node.journal import Journal, JournalError
from kareus_node.podresources import GPUHolder, gpu_holders
from kareus_node.worker import ClockWorker

from kareus.gpu import discover

UID = "1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d"
UID_SYSTEMD = UID.replace("-", "_")


@pytest.mark.parametrize("text", [
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice/cri-containerd-9f.scope\n",
    f"0::/kubepods.slice/kubepods-pod{UID_SYSTEMD}.slice/cri-containerd-9f.scope\n",  # guaranteed QoS
    f"12:memory:/kubepods/burstable/pod{UID}/0123456789ab\n11:cpu,cpuacct:/kubepods/burstable/pod{UID}/0123456789ab\n",
    f"0::/kubepods/besteffort/pod{UID}/0123456789ab\n",
    f"0::/kubepods/pod{UID}\n",
    f"0::/../../kubepods-besteffort-pod{UID_SYSTEMD}.slice/cri-containerd-1.scope\n",  # seen from a cgroup namespace
])
def test_pod_uid_from_every_cgroup_spelling(text):
    assert pod_uid_from_cgroup(text) == UID


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-1000.slice/session-2.scope\n",
    "0::/system.slice/containerd.service\n",
    "",
    f"0::/kubepods/pod{UID}\n1:name=x:/kubepods/pod{UID[:-1]}0\n",  # two different pods: ambiguous
    "0::/kubepods/podnot-a-uid/123\n",
])
def test_no_pod_identity(text):
    assert pod_uid_from_cgroup(text) is None


def test_peer_credentials_come_from_the_kernel():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_credentials(left) == PeerCredentials(os.getpid(), os.getuid(), os.getgid())


def test_config_file_and_its_errors(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("dryRun: true\nallowedNamespaces: [team-a]\npodRecheckSeconds: 2.5\nmaxConnections: 8\n"
                    "clockBounds:\n  default: {floorMHz: 900}\n  gpuModels:\n    NVIDIA-H100-SXM: {ceilingMHz: 1700}\n")
    config = load_config(path)
    assert config.dry_run and config.pod_recheck_s == 2.5 and config.max_connections == 8
    assert config.namespace_allowed("team-a") and not config.namespace_allowed("team-b")
    bounds = config.policy.clock_bounds_for("NVIDIA H100-SXM")
    assert (bounds.floor_mhz, bounds.ceiling_mhz) == (900, 1700)
    assert load_config(None).dry_run is False
    for raw, message in [
        ({"dryrun": True}, "dryrun: unknown key"),
        ({"dryRun": "yes"}, "dryRun: must be true or false"),
        ({"maxConnections": 0}, "maxConnections: must be a whole number > 0"),
        ({"maxConnections": 2.5}, "maxConnections: must be a whole number > 0"),
        ({"requestTimeoutSeconds": "5"}, "requestTimeoutSeconds: must be a number > 0"),
        ({"clockBounds": {"default": {"floorMHz": 1500, "ceilingMHz": 900}}}, "floorMHz: 1500 must not exceed ceilingMHz 900"),
        ({"allowedNamespaces": ["Team_A"]}, "is not a namespace name"),
        ([1, 2], "must be a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(raw)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml")


def test_allow_list_rules(tmp_path):
    path = tmp_path / "allow.yaml"
    path.write_text("allow:\n  - uid: 1000\n    gpus: [GPU-a]\n  - gid: 27\n    gpus: all\n")
    rules = load_allow_list(path)
    assert rules == [AllowRule(1000, None, frozenset({"GPU-a"})), AllowRule(None, 27, None)]
    auth = StandaloneAuthorizer(rules)
    assert auth.grant(PeerCredentials(1, 1000, 5), ["GPU-a", "GPU-b"]).refusals == {
        "GPU-a": "", "GPU-b": "uid 1000/gid 5 is not allowed GPU GPU-b by the allow-list"}
    assert auth.grant(PeerCredentials(1, 2000, 27), ["GPU-b"]).reason("GPU-b") == ""
    # Without a file only the daemon's own uid may control GPUs.
    default = StandaloneAuthorizer()
    assert default.grant(PeerCredentials(1, os.getuid(), 0), ["GPU-a"]).reason("GPU-a") == ""
    assert default.grant(PeerCredentials(1, os.getuid() + 1, 0), ["GPU-a"]).reason("GPU-a")
    for text, message in [
        ("allow: {uid: 1}", "allow: must be a list"),
        ("allow:\n  - gpus: all\n", r"allow\[0\]: needs a uid or a gid"),
        ("allow:\n  - uid: -1\n    gpus: all\n", r"allow\[0\].uid: must be a non-negative integer"),
        ("allow:\n  - uid: 1\n    gpus: [0]\n", r"allow\[0\].gpus: must be 'all' or a list of GPU UUIDs"),
        ("allow:\n  - uid: 1\n    user: x\n    gpus: all\n", r"allow\[0\]: must be a mapping with keys"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_allow_list(path)


def test_journal_is_atomic_and_survives_reopening(tmp_path):
    journal = Journal(tmp_path / "state")
    journal.record("GPU-a", {"clock_mhz": 1200})
    journal.record("GPU-b", {"clock_mhz": 1005})
    journal.erase("GPU-a")
    journal.erase("GPU-never")
    assert Journal(tmp_path / "state").entries() == {"GPU-b": {"clock_mhz": 1005}}
    assert not list((tmp_path / "state").glob(".*.tmp"))  # no temp file left behind
    (tmp_path / "state" / "leases.json").write_text("{not json")
    with pytest.raises(JournalError, match="unreadable"):
        Journal(tmp_path / "state")
    (tmp_path / "state" / "leases.json").write_text(json.dumps({"version": 99, "leases": {}}))
    with pytest.raises(JournalError, match="unknown format"):
        Journal(tmp_path / "state")


def test_worker_journals_before_locking_and_erases_after_reset(tmp_path):
    gpu = discover("sim", count=1)[0]
    journal = Journal(tmp_path)
    worker = ClockWorker(gpu, journal)
    worker.acquire({"clock_mhz": 1200})
    assert journal.entries() == {gpu.uuid: {"clock_mhz": 1200}} and gpu.locked_clock_mhz() is None
    assert worker.wait_applied(worker.want(1200), 5)
    assert gpu.locked_clock_mhz() == 1200
    assert worker.wait_applied(worker.want(None), 5)
    assert gpu.locked_clock_mhz() is None and journal.entries() == {}
    assert worker.clock_changes == 2
    worker.stop()


def test_worker_fails_closed_when_the_gpu_refuses(tmp_path):
    gpu = discover("sim", count=1)[0]
    worker = ClockWorker(gpu, Journal(tmp_path))
    assert worker.wait_applied(worker.want(1200), 5)
    assert worker.wait_applied(worker.want(1203), 5)  # not a supported clock: the backend raises
    assert "1203" in worker.last_error
    assert gpu.locked_clock_mhz() is None  # reset rather than left at a stale lock
    worker.stop()


def test_worker_limits_power_in_order_and_the_lease_end_restores_both(tmp_path):
    gpu = discover("sim", count=1)[0]
    journal = Journal(tmp_path)
    worker = ClockWorker(gpu, journal)
    worker.acquire({"clock_mhz": 1200})
    worker.want(1200)
    worker.journal_power_limit(250.0)  # a clock lease that now limits power: noted before the limit is set
    assert journal.entries() == {gpu.uuid: {"clock_mhz": 1200, "power_limit_w": 250.0}}
    assert worker.wait_applied(worker.want_power(250.0), 5)
    assert (gpu.locked_clock_mhz(), gpu.power_limit_w()) == (1200, 250.0)
    assert worker.wait_applied(worker.want_power(99.0), 5)  # below the board's range: the backend raises
    assert "99" in worker.last_error and gpu.power_limit_w() == 400.0  # the default, not a stale limit
    assert gpu.locked_clock_mhz() == 1200  # a failed limit leaves the clock alone
    assert worker.wait_applied(worker.want_power(300.0), 5)
    assert worker.wait_applied(worker.want(None), 5)  # the lease ends
    assert (gpu.locked_clock_mhz(), gpu.power_limit_w()) == (None, 400.0) and journal.entries() == {}
    assert (worker.clock_changes, worker.power_limit_changes) == (2, 3)
    worker.stop()


def test_a_dry_run_worker_touches_no_power_limit(tmp_path):
    gpu = discover("sim", count=1)[0]
    journal = Journal(tmp_path)
    worker = ClockWorker(gpu, journal, dry_run=True)
    worker.acquire({"clock_mhz": None})
    worker.journal_power_limit(200.0)
    assert worker.wait_applied(worker.want_power(200.0), 5)
    assert gpu.power_limit_w() == 400.0 and journal.entries() == {} and worker.power_limit_changes == 0
    worker.stop()


def test_gpu_holders_mark_replicas_and_ignore_other_resources():
    def pod(ns, name, *device_lists):
        return api_pb2.PodResources(namespace=ns, name=name, containers=[
            api_pb2.ContainerResources(name=f"c{i}", devices=[api_pb2.ContainerDevices(resource_name=r, device_ids=ids)])
            for i, (r, ids) in enumerate(device_lists)])

    holders = gpu_holders([
        pod("a", "p", ("nvidia.com/gpu", ["GPU-1", "GPU-2"]), ("nvidia.com/gpu", ["GPU-1"])),
        pod("b", "q", ("nvidia.com/gpu", ["GPU-3::0", "GPU-3::1"]), ("example.com/fpga", ["GPU-4"])),
    ])
    assert holders == {
        "GPU-1": [GPUHolder("a", "p", False)],
        "GPU-2": [GPUHolder("a", "p", False)],
        "GPU-3": [GPUHolder("b", "q", True)],
    }
