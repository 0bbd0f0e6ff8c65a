"""The runtime's clock client against a real `kareus-node` process: pipelined requests, schedule
upload and advance, the blocking variant, refusals and a vanished daemon that degrade the client
instead of failing training, dry-run."""

from __future__ import annotations

import os
import signal

import pytest
from test_daemon_support import start_daemon, wait_for

from kareus.daemon_client import DaemonClockClient, DaemonConnection, DaemonError, NullClockClient, connect
from kareus.gpu import sim_uuid
from kareus.metric_names import DAEMON_REQUESTS_TOTAL, GPU_CLOCK_CHANGES_TOTAL

GPU0, GPU1 = (sim_uuid("node-a", "A100-SXM4-40GB", i) for i in range(2))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("clock")
    allow = tmp_path / "allow.yaml"
    allow.write_text(f"allow:\n  - uid: {os.getuid()}\n    gpus: [{GPU0}]\n  - gid: 4242\n    gpus: all\n")
    config = tmp_path / "config.yaml"
    config.write_text("clockBounds:\n  default: {floorMHz: 1005, ceilingMHz: 1305}\n")
    daemon = start_daemon(tmp_path, "--standalone", "--allow-list", str(allow), "--config", str(config))
    yield daemon
    assert daemon.stop() == 0


def _locked(socket_path: str, gpu: str) -> int | None:
    with DaemonConnection(socket_path) as connection:
        return connection.read([gpu])[0].locked_clock_mhz


def test_requests_schedule_and_close(daemon):
    client = connect(daemon.socket_path, job="llama")
    assert isinstance(client, DaemonClockClient)
    assert client.gpu_uuids == (GPU0,)  # the only GPU the allow-list gives this uid
    ok_before = daemon.metric(DAEMON_REQUESTS_TOTAL, result="ok")
    client.request_clock(1200, instruction="s0.F0")
    client.request_clock(1200, instruction="s0.F1")  # unchanged: not sent again
    assert client.flush()
    assert daemon.metric(DAEMON_REQUESTS_TOTAL, result="ok") == ok_before + 1
    wait_for(lambda: _locked(daemon.socket_path, GPU0) == 1200)
    with DaemonConnection(daemon.socket_path) as other:
        owner = next(g for g in other.status()["gpus"] if g["uuid"] == GPU0)["owner"]
        assert (owner["pid"], owner["job"]) == (os.getpid(), "llama")
        with pytest.raises(DaemonError) as info:
            other.lock([GPU0], 1005)
        assert info.value.code == "busy"

    client.upload_schedule([1005, 1305, 1110])
    for expected in [1005, 1305, 1110, 1005]:  # cyclic
        client.advance()
        assert client.flush()
        wait_for(lambda expected=expected: _locked(daemon.socket_path, GPU0) == expected)
    assert not client.degraded
    client.close()
    wait_for(lambda: _locked(daemon.socket_path, GPU0) is None)


def test_blocking_variant_has_applied_before_it_answers(daemon):
    with DaemonConnection(daemon.socket_path) as connection:
        assert connection.lock([GPU0], 1110, wait=True)["applied"] is True
        assert connection.read([GPU0])[0].locked_clock_mhz == 1110
        connection.upload_schedule([GPU0], [1200, 1005])
        assert connection.advance(wait=True)["clocks_mhz"] == {GPU0: 1200}
        assert connection.read([GPU0])[0].locked_clock_mhz == 1200
        assert connection.reset([GPU0], wait=True)["applied"] is True
        assert connection.read([GPU0])[0].locked_clock_mhz is None
        changes = daemon.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=GPU0)
        # A burst is coalesced by the GPU worker: it ends at the last request, in fewer changes.
        for clock_mhz in [1005, 1200] * 100 + [1305]:
            connection.send("lock", gpus=[GPU0], clock_mhz=clock_mhz)
        for _ in range(201):
            assert connection.receive()["ok"]
        assert connection.lock([GPU0], 1305, wait=True)["applied"]
        assert connection.read([GPU0])[0].locked_clock_mhz == 1305
        assert daemon.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=GPU0) - changes <= 201


def test_refusals_degrade_the_client_but_never_raise(daemon):
    client = connect(daemon.socket_path, [GPU0])
    client.request_clock(1410, instruction="s0.B3")  # above the policy ceiling
    assert client.flush()
    assert client.degraded
    assert "outside the policy bounds 1005–1305 MHz" in client.degraded_reason
    client.close()
    refused = connect(daemon.socket_path, [GPU1])
    assert isinstance(refused, NullClockClient) and refused.degraded
    assert "is not allowed GPU" in refused.degraded_reason
    with pytest.raises(DaemonError, match="is not on this node"):
        connect(daemon.socket_path, ["GPU-elsewhere"], required=True)


def test_a_vanished_daemon_degrades_the_client(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    client = connect(daemon.socket_path, [GPU0])
    client.request_clock(1200, instruction="s0.F0")
    assert client.flush()
    daemon.stop(signal.SIGKILL)
    wait_for(lambda: client.degraded)
    assert "connection closed by the daemon" in client.degraded_reason
    client.request_clock(1005, instruction="s0.F1")  # no exception, no effect
    client.advance()
    client.close()


def test_dry_run_accepts_and_changes_nothing(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone", "--dry-run")
    try:
        with DaemonConnection(daemon.socket_path) as connection:
            reply = connection.lock([GPU0], 1200, wait=True)
            assert reply["dry_run"] is True
            assert connection.read([GPU0])[0].locked_clock_mhz is None
        assert daemon.metric(DAEMON_REQUESTS_TOTAL, result="dry_run") == 1
        with DaemonConnection(daemon.socket_path) as connection:
            wait_for(lambda: next(g for g in connection.status()["gpus"] if g["uuid"] == GPU0)["owner"] is None)
        assert daemon.metric(GPU_CLOCK_CHANGES_TOTAL) == 0  # neither the lock nor the release changed anything
        assert not (daemon.state_dir / "leases.json").exists()  # nothing was ever journaled
        assert not (daemon.state_dir / "sim").exists() or not any((daemon.state_dir / "sim").iterdir())
    finally:
        daemon.stop()
