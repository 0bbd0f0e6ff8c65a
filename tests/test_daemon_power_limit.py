"""The node agent's board power limit (issue 28, item 1: the fallback below a frontier's low end).

`power_limit` takes the same lease as `lock` and ends the same ways: reset, disconnect, the pod
losing its GPU, the pod deleted, daemon shutdown, and on start for what the journal says was left
limited. The daemon runs in this process on its simulated backend with its real authorizers (the
`bench/daemon_abuse.py` harness, as tests/test_daemon_tenants.py), or as a real standalone process
where it must be SIGKILLed. The simulated A100-SXM4-40GB's board takes 100–400 W (default 400 W).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_daemon_support import CLOCK_CMD, start_daemon, wait_for

from kareus.daemon_client import DaemonClockClient, DaemonConnection, DaemonError, connect
from kareus.gpu import discover, sim_uuid
from kareus.metric_names import GPU_POWER_LIMIT_WATTS

_SPEC = importlib.util.spec_from_file_location("daemon_abuse", Path(__file__).resolve().parent.parent / "bench" / "daemon_abuse.py")
abuse = importlib.util.module_from_spec(_SPEC)
sys.modules["daemon_abuse"] = abuse
_SPEC.loader.exec_module(abuse)

GPU0 = sim_uuid("node-a", "A100-SXM4-40GB", 0)
GPU1 = sim_uuid("node-a", "A100-SXM4-40GB", 1)


class Node:
    """A running in-process daemon with two pods: `train` holds GPU 0, `other` GPU 1."""

    def __init__(self, tmp_path: Path) -> None:
        self.api = abuse.FakeAPIServer()
        self.daemon = abuse.RunningDaemon(tmp_path, self.api, gpus=2)
        self.gpus = [gpu.uuid for gpu in self.daemon.gpus]
        self.train = self.api.add_pod(abuse.FakePod("team-a", "llama-0", abuse.pod_uid(1), "127.0.0.10", [self.gpus[0]]))
        self.other = self.api.add_pod(abuse.FakePod("team-b", "gpt-0", abuse.pod_uid(2), "127.0.0.11", [self.gpus[1]]))

    def session(self, pod):
        sock = abuse.raw_tcp(self.daemon.tcp, source_ip=pod.ip)
        why = abuse._answer(sock, {"v": 1, "id": 1, "op": "hello", "token": self.api.token(pod)})
        assert why == "", why
        return sock

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` on /metrics whose labels include `labels`."""
        port = self.daemon.http.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and set(labels.items()) <= set(sample.labels.items()))

    def limit_w(self, index: int) -> float:
        return self.daemon.gpus[index].power_limit_w()

    def journal(self) -> dict:
        path = self.daemon.tmp / "state" / "leases.json"
        return json.loads(path.read_text())["leases"] if path.exists() else {}


def _request(sock, op: str, **fields) -> dict:
    sock.sendall(abuse.protocol.encode_frame({"v": 1, "id": 7, "op": op, **fields}))
    reply = abuse.recv_reply(sock)
    assert reply is not None, f"{op}: the daemon closed the connection"
    return reply


def _error(reply: dict) -> tuple[str, str]:
    assert not reply["ok"], reply
    return reply["error"]["code"], reply["error"]["message"]


@pytest.fixture
def node(tmp_path):
    made = Node(tmp_path)
    with made.daemon:
        yield made


def test_a_pod_limits_its_own_gpu_within_the_board_range_and_reset_restores_the_default(node):
    sock = node.session(node.train)
    gpu = node.gpus[0]
    assert _request(sock, "power_limit", gpus=[gpu], watts=250, wait=True)["ok"]
    assert node.limit_w(0) == 250.0
    assert node.daemon.gpus[0].run_power_limit_w() == 250.0  # what work on it now runs under
    assert node.metric(GPU_POWER_LIMIT_WATTS, gpu_uuid=gpu, pod="llama-0") == 250.0
    assert node.metric(GPU_POWER_LIMIT_WATTS, gpu_uuid=node.gpus[1]) == 400.0  # the default elsewhere
    assert node.journal()[gpu]["power_limit_w"] == 250.0  # durable before the board was touched
    status = next(g for g in _request(sock, "status")["gpus"] if g["uuid"] == gpu)
    assert (status["power_limit_w"], status["min_power_limit_w"], status["max_power_limit_w"],
            status["default_power_limit_w"], status["power_limit_changes"]) == (250.0, 100.0, 400.0, 400.0, 1)
    assert _request(sock, "read", gpus=[gpu])["gpus"][0]["power_limit_w"] == 250.0

    code, message = _error(_request(sock, "power_limit", gpus=[gpu], watts=90))
    assert code == "refused"
    assert message == f"watts: 90 W is outside the power-limit range 100–400 W of GPU {gpu} (NVIDIA A100-SXM4-40GB)"
    assert _error(_request(sock, "power_limit", gpus=[gpu], watts=401))[0] == "refused"
    code, message = _error(_request(sock, "power_limit", gpus=[gpu], watts="250"))
    assert code == "invalid" and message.startswith("watts: must be a number of watts")
    assert _error(_request(sock, "power_limit", gpus=[gpu], watts=250, reset=True))[1] == \
        "watts: give either watts or reset: true, not both"
    assert node.limit_w(0) == 250.0  # refusals change nothing

    assert _request(sock, "power_limit", gpus=[gpu], reset=True, wait=True)["ok"]
    assert node.limit_w(0) == 400.0
    assert node.daemon.call(lambda: node.daemon.daemon.leases[gpu].owner.pod) == "llama-0"  # the lease stays
    # The clock lease and the limit are one lease: `reset` ends it and restores both.
    assert _request(sock, "lock", gpus=[gpu], clock_mhz=1200, wait=True)["ok"]
    assert _request(sock, "power_limit", gpus=[gpu], watts=300, wait=True)["ok"]
    assert (node.daemon.gpus[0].locked_clock_mhz(), node.limit_w(0)) == (1200, 300.0)
    assert _request(sock, "reset", gpus=[gpu], wait=True)["ok"]
    assert (node.daemon.gpus[0].locked_clock_mhz(), node.limit_w(0)) == (None, 400.0)
    wait_for(lambda: node.journal() == {})
    sock.close()


def test_only_the_pods_own_gpus_and_only_by_the_lease_holder(node):
    sock = node.session(node.train)
    code, message = _error(_request(sock, "power_limit", gpus=[node.gpus[1]], watts=200))
    assert code == "refused" and f"GPU {node.gpus[1]} is not allocated to pod team-a/llama-0" in message
    assert node.limit_w(1) == 400.0
    holder, second = node.session(node.other), node.session(node.other)
    assert _request(holder, "lock", gpus=[node.gpus[1]], clock_mhz=1200, wait=True)["ok"]
    code, message = _error(_request(second, "power_limit", gpus=[node.gpus[1]], watts=200))
    assert code == "busy" and f"GPU {node.gpus[1]} is held by pod team-b/gpt-0" in message  # one lease holder
    assert _error(_request(second, "power_limit", gpus=[node.gpus[1]], reset=True))[0] == "busy"
    assert node.limit_w(1) == 400.0
    for each in (sock, holder, second):
        each.close()


def test_the_default_limit_comes_back_on_disconnect_lease_loss_and_pod_deletion(node):
    sock = node.session(node.train)
    assert _request(sock, "power_limit", gpus=[node.gpus[0]], watts=200, wait=True)["ok"]
    sock.close()  # the client went away
    wait_for(lambda: node.limit_w(0) == 400.0)
    wait_for(lambda: node.journal() == {})

    sock = node.session(node.train)
    assert _request(sock, "power_limit", gpus=[node.gpus[0]], watts=200, wait=True)["ok"]
    node.train.gpus.remove(node.gpus[0])  # the kubelet gave the GPU to nobody / someone else
    wait_for(lambda: node.limit_w(0) == 400.0)
    sock.close()

    other = node.session(node.other)
    assert _request(other, "power_limit", gpus=[node.gpus[1]], watts=150, wait=True)["ok"]
    node.api.pods.pop(node.other.uid)  # the pod is deleted: its token stops validating, the session ends
    wait_for(lambda: node.limit_w(1) == 400.0)
    wait_for(lambda: node.journal() == {})
    other.close()


def test_daemon_shutdown_restores_the_default_limit(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    holder = connect(daemon.socket_path, [GPU0], required=True)
    holder.set_power_limit(175)
    assert holder.flush()
    wait_for(lambda: _sim_limit(daemon.state_dir, 0) == 175.0)
    assert daemon.stop(signal.SIGTERM) == 0  # the holder is still connected
    assert _sim_limit(daemon.state_dir, 0) == 400.0
    assert json.loads((daemon.state_dir / "leases.json").read_text())["leases"] == {}
    holder.close()


def _sim_limit(state_dir: Path, index: int) -> float:
    """The limit a simulated GPU persisted (what a real board would still have), as a fresh process sees it."""
    return discover("sim", count=2, node="node-a", state_dir=state_dir / "sim")[index].power_limit_w()


def test_a_limit_left_by_a_killed_daemon_is_restored_on_start_and_nothing_else_is_touched(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    holder = connect(daemon.socket_path, [GPU0], required=True)
    assert isinstance(holder, DaemonClockClient)
    holder.request_clock(1200, instruction="s0.F0")
    holder.set_power_limit(220)  # the client method: asynchronous, under the clock's lease
    assert holder.flush() and not holder.degraded
    wait_for(lambda: _sim_limit(daemon.state_dir, 0) == 220.0)
    daemon.stop(signal.SIGKILL)
    assert _sim_limit(daemon.state_dir, 0) == 220.0  # nobody restored it
    journal = json.loads((daemon.state_dir / "leases.json").read_text())["leases"]
    assert journal[GPU0]["power_limit_w"] == 220  # the lease started with a lock; the limit was added
    # An administrator limited GPU 1 by hand: not journaled, so never touched.
    discover("sim", count=2, node="node-a", state_dir=daemon.state_dir / "sim")[1].set_power_limit_w(300)

    restarted = start_daemon(tmp_path, "--standalone", state_dir=daemon.state_dir)
    try:
        assert restarted.metric(GPU_POWER_LIMIT_WATTS, gpu_uuid=GPU0) == 400.0
        assert restarted.metric(GPU_POWER_LIMIT_WATTS, gpu_uuid=GPU1) == 300.0
        with DaemonConnection(restarted.socket_path) as admin:
            status = admin.status()
            assert status["restored_on_start"] == [GPU0]
            assert {g["uuid"]: g["locked_clock_mhz"] for g in status["gpus"]}[GPU0] is None
        table = subprocess.run([*CLOCK_CMD, "status", "--socket", restarted.socket_path], capture_output=True,
                               text=True, check=True).stdout.splitlines()
        assert "LIMIT W" in table[1] and "  300  " in next(line for line in table if line.startswith(GPU1))
        assert f"restoring GPU {GPU0} to default clocks and its default power limit" in (tmp_path / "daemon.log").read_text()
    finally:
        assert restarted.stop() == 0
        holder.close()
    assert _sim_limit(daemon.state_dir, 1) == 300.0


def test_the_client_sets_and_resets_and_close_restores(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    try:
        with DaemonConnection(daemon.socket_path) as connection:
            connection.power_limit([GPU1], 180, wait=True)
            assert [r.power_limit_w for r in connection.read([GPU1])] == [180.0]
            info = {g.uuid: g for g in connection.discover()}[GPU1]
            assert (info.min_power_limit_w, info.max_power_limit_w, info.default_power_limit_w) == (100.0, 400.0, 400.0)
            with pytest.raises(DaemonError, match="watts: 50 W is outside the power-limit range 100–400 W"):
                connection.power_limit([GPU1], 50)
            connection.power_limit([GPU1], None, wait=True)
            assert [r.power_limit_w for r in connection.read([GPU1])] == [400.0]
        client = connect(daemon.socket_path, [GPU0], required=True)
        client.set_power_limit(260)
        assert client.flush()
        wait_for(lambda: _sim_limit(daemon.state_dir, 0) == 260.0)
        client.close()  # what the runtime does on exit, however the run ended
        wait_for(lambda: _sim_limit(daemon.state_dir, 0) == 400.0)
    finally:
        assert daemon.stop() == 0
