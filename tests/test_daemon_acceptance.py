"""Issue 6 acceptance with the simulated backend, real sockets and real processes: a held lock shows
in the metrics, and every way of losing the owner (holder SIGKILLed, daemon SIGTERMed, daemon
SIGKILLed and restarted) puts the GPU back to default clocks — and only GPUs the daemon journaled."""

from __future__ import annotations

import json
import signal
import subprocess

from test_daemon_support import CLOCK_CMD, DAEMON_CMD, KAREUS_CMD, kill, start_daemon, start_hold, wait_for

from kareus.gpu import discover, sim_uuid
from kareus.metric_names import GPU_CLOCK_CHANGES_TOTAL, GPU_LOCKED_CLOCK_HERTZ

GPU0 = sim_uuid("node-a", "A100-SXM4-40GB", 0)
GPU1 = sim_uuid("node-a", "A100-SXM4-40GB", 1)


def _sim_lock(state_dir, index):
    """The lock a simulated GPU has persisted (what a real GPU would still have), as a fresh process sees it."""
    return discover("sim", count=2, node="node-a", state_dir=state_dir / "sim")[index].locked_clock_mhz()


def _journal(state_dir):
    return json.loads((state_dir / "leases.json").read_text())["leases"]


def test_hold_shows_in_metrics_and_sigkill_of_the_holder_resets_within_a_second(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    try:
        holder = start_hold(daemon.socket_path, GPU0, 1200, cmd=(*KAREUS_CMD, "clock"))  # the real `kareus clock hold`
        assert daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU0) == 1.2e9
        assert daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU1) == 0
        assert list(_journal(daemon.state_dir)) == [GPU0]
        kill(holder)
        wait_for(lambda: daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU0) == 0, timeout_s=1.0)
        assert daemon.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=GPU0) == 2  # lock, reset
        wait_for(lambda: _journal(daemon.state_dir) == {})
        assert _sim_lock(daemon.state_dir, 0) is None
        assert daemon.http_status("/healthz") == 200
        assert daemon.http_status("/readyz") == 200
    finally:
        assert daemon.stop() == 0


def test_sigterm_of_the_daemon_resets_every_locked_gpu(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    holders = [start_hold(daemon.socket_path, GPU0, 1200), start_hold(daemon.socket_path, GPU1, 1005)]
    assert [_sim_lock(daemon.state_dir, i) for i in (0, 1)] == [1200, 1005]
    assert daemon.stop(signal.SIGTERM) == 0
    assert [_sim_lock(daemon.state_dir, i) for i in (0, 1)] == [None, None]
    assert _journal(daemon.state_dir) == {}
    for holder in holders:
        assert holder.wait(10) == 1
        assert "connection to the daemon lost" in holder.stderr.read()


def test_sigkill_of_the_daemon_then_restart_resets_journaled_gpus_only(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone")
    holder = start_hold(daemon.socket_path, GPU0, 1200)
    daemon.stop(signal.SIGKILL)
    assert holder.wait(10) == 1  # its lease died with the daemon's connection
    assert _sim_lock(daemon.state_dir, 0) == 1200  # still locked: nobody reset it
    assert list(_journal(daemon.state_dir)) == [GPU0]
    # Someone else (an administrator, another tool) locked GPU 1: not journaled, so never touched.
    discover("sim", count=2, node="node-a", state_dir=daemon.state_dir / "sim")[1].lock_sm_clock(1005, 1005)

    restarted = start_daemon(tmp_path, "--standalone", state_dir=daemon.state_dir)
    try:
        assert restarted.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU0) == 0
        assert restarted.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=GPU0) == 1  # the restore, counted
        assert restarted.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU1) == 1.005e9
        assert restarted.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=GPU1) == 0
        assert _journal(restarted.state_dir) == {}
        status = json.loads(subprocess.run([*CLOCK_CMD, "status", "--socket", restarted.socket_path, "--json"],
                                           capture_output=True, text=True, check=True).stdout)
        assert status["restored_on_start"] == [GPU0]
        table = subprocess.run([*KAREUS_CMD, "clock", "status", "--socket", restarted.socket_path],
                               capture_output=True, text=True, check=True).stdout
        assert f"reset on start (left locked by a previous daemon): {GPU0}" in table
        assert "restoring GPU" in (tmp_path / "daemon.log").read_text()
    finally:
        assert restarted.stop() == 0
    assert _sim_lock(daemon.state_dir, 1) == 1005  # the SIGTERM reset covered only its own leases


def test_hold_refusals_are_one_line_errors(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone", "--config", str(_policy(tmp_path)))
    try:
        def hold(*args):
            return subprocess.run([*CLOCK_CMD, "hold", "--socket", daemon.socket_path, *args],
                                  capture_output=True, text=True, timeout=30)
        out = hold("--gpu", GPU0, "--mhz", "1410")
        assert out.returncode == 1
        assert out.stderr.strip() == (f"kareus: error: node daemon: clock_mhz: 1410 MHz is outside the policy bounds "
                                      f"1005–1305 MHz of GPU {GPU0} (NVIDIA A100-SXM4-40GB)")
        out = hold("--gpu", "GPU-nope", "--mhz", "1200")
        assert "gpus[0]: 'GPU-nope' is not a GPU on this node" in out.stderr
        assert "Traceback" not in out.stderr
        assert daemon.metric("kareus_daemon_requests_total", result="refused") == 1
        assert daemon.metric("kareus_daemon_requests_total", result="invalid") == 1
        missing = subprocess.run([*CLOCK_CMD, "status", "--socket", str(tmp_path / "none.sock")],
                                 capture_output=True, text=True, timeout=30)
        assert missing.returncode == 1
        assert "cannot connect to" in missing.stderr
    finally:
        daemon.stop()


def _policy(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("clockBounds:\n  default: {floorMHz: 900}\n  gpuModels:\n"
                    "    NVIDIA-A100-SXM4-40GB: {floorMHz: 1005, ceilingMHz: 1305}\n")
    return path


def test_startup_errors_are_one_line_and_nothing_is_served(tmp_path):
    base = [*DAEMON_CMD, "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state"),
            "--metrics-port", "0", "--metrics-address", "127.0.0.1", "--standalone"]
    (tmp_path / "bad.yaml").write_text("maxConnections: 0\n")
    cases = [
        (["--backend", "nvml"], "kareus-node: error: NVML is not available"),  # no driver here: fail closed
        (["--backend", "sim", "--config", str(tmp_path / "bad.yaml")], "maxConnections: must be a whole number > 0, got 0"),
        (["--backend", "sim", "--allow-list", str(tmp_path / "none.yaml")], "none.yaml: cannot be read"),
    ]
    for args, message in cases:
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / "s.sock").exists()


def test_json_logs_say_why_a_gpu_was_reset(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone", "--log-format", "json")
    holder = start_hold(daemon.socket_path, GPU1, 1200)
    kill(holder)
    wait_for(lambda: daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU1) == 0)
    assert daemon.stop() == 0
    records = [json.loads(line) for line in (tmp_path / "daemon.log").read_text().splitlines()]
    reset = [r for r in records if r["message"].startswith(f"GPU {GPU1} back to default clocks")]
    assert len(reset) == 1 and "client disconnected" in reset[0]["message"]
    assert {"time", "level", "logger", "message"} <= set(reset[0])
