"""`kareus dev-cluster` as a user runs it: `ready` once everything is up, Ctrl-C leaves nothing behind."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(("args", "message"), [
    (["--operator-env", "NOEQUALS"], "--operator-env: expected KAREUS_OPERATOR_NAME=VALUE"),
    (["--operator-env", "PATH=/x"], "--operator-env: expected KAREUS_OPERATOR_NAME=VALUE"),
    (["--nodes", "0"], "--nodes: must be >= 1"),
    (["--gpus-per-node", "-1"], "--gpus-per-node: must be >= 0"),
])
def test_bad_arguments_get_one_clear_error(tmp_path, capsys, args, message):
    from kareus.cli import main

    assert main(["dev-cluster", "--kubeconfig", str(tmp_path / "kc"), *args]) == 1
    assert message in capsys.readouterr().err


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _pids_in(netns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False).stdout
    return {int(pid) for pid in out.split()}


def _written_since(stream) -> str:
    """What a process wrote that was not read yet, without waiting for an end of file that a child
    still holding the pipe would put off."""
    chunks = []
    while select.select([stream], [], [], 1)[0] and (chunk := os.read(stream.fileno(), 65536)):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_two_real_nodes_then_ctrl_c_stops_everything(tmp_path, control_plane):
    """The acceptance of the real-nodes work, as a user checks a kind cluster: `kareus dev-cluster --nodes 2`,
    then kubectl. control_plane: the binaries are there (built once per session); this cluster is its own."""
    from kareus_devcluster.controlplane import kubectl_path

    before = _netns()
    kubeconfig = tmp_path / "kc"
    process = subprocess.Popen([sys.executable, "-m", "kareus", "dev-cluster", "--nodes", "2", "--kubeconfig",
                                str(kubeconfig), "--workdir", str(tmp_path / "work")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if line.strip() == "ready" or (not line and process.poll() is not None):
            break
    assert lines[-1].strip() == "ready", "".join(lines[-20:])
    [slot] = [m.group(1) for line in lines if (m := re.match(r"API https://198\.18\.(\d+)\.1:", line))]
    # Its own nodes' namespaces (`kd<slot>-<node>`): another worker's dev cluster may come and go meanwhile.
    namespaces = {ns for ns in _netns() - before if ns.startswith(f"kd{slot}-")}
    assert namespaces
    started = psutil.Process(process.pid).children(recursive=True)
    names = set()
    for child in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            names.add(child.name())
    inside = set().union(*(_pids_in(ns) for ns in namespaces))

    def kubectl(*args: str) -> str:
        return subprocess.run([kubectl_path(), f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                              check=True, timeout=120).stdout

    try:
        nodes = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
        assert len(nodes) == 2
        node_ips = set()
        for node in nodes:
            info = node["status"]["nodeInfo"]
            assert re.fullmatch(r"v1\.34\.\d+", info["kubeletVersion"]), info
            assert info["containerRuntimeVersion"].startswith("containerd://"), info
            node_ips |= {a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"}
        wide = kubectl("get", "nodes", "-o", "wide")
        assert wide.count("containerd://") == 2 and wide.count("v1.34.") == 2, wide
        pods = json.loads(kubectl("get", "pods", "-A", "-o", "json"))["items"]
        running = [p for p in pods if p["status"]["phase"] == "Running"]
        assert {p["metadata"]["namespace"] for p in running} >= {"kube-system", "kareus-system", "kareus-node"}
        for pod in running:
            for status in pod["status"]["containerStatuses"]:
                assert status["containerID"].startswith("containerd://"), status
                assert status["imageID"].startswith("sha256:"), status
            ip = ipaddress.ip_address(pod["status"]["podIP"])
            assert not ip.is_loopback
            if not pod["spec"].get("hostNetwork"):
                assert str(ip) not in node_ips and ip in ipaddress.ip_network("10.244.0.0/16"), pod["metadata"]
        [operator] = [p["metadata"]["name"] for p in running if p["metadata"]["namespace"] == "kareus-system"]
        program = ("import os, socket; print(os.getuid()); "
                   "print(socket.gethostbyname('kubernetes.default.svc.cluster.local'))")
        uid, resolved = kubectl("exec", "-n", "kareus-system", operator, "--", "python", "-c", program).split()
        assert int(uid) != 0
        assert resolved == json.loads(kubectl("get", "service", "kubernetes", "-o", "json"))["spec"]["clusterIP"]
        for namespace in ("kareus-system", "kareus-node"):
            slices = json.loads(kubectl("get", "endpointslices", "-n", namespace, "-o", "json"))["items"]
            assert slices and all(any(e.get("conditions", {}).get("ready") for e in s.get("endpoints") or [])
                                  for s in slices), slices
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    assert process.returncode == 0, "".join(lines[-20:]) + _written_since(process.stdout)
    gone, alive = psutil.wait_procs(started, timeout=10)
    assert alive == [], [(p.pid, p.name()) for p in alive]
    assert {"etcd", "kube-apiserver", "kubelet", "containerd", "kube-proxy"} <= names
    assert len(gone) == len(started)
    assert not namespaces & _netns()  # the nodes' (and Prometheus') namespaces are gone
    assert not [pid for pid in inside if psutil.pid_exists(pid)]  # so is every process that ran in them
