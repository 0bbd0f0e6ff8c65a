"""Helpers for the node-daemon tests: start `kareus-node` and `kareus clock` as real processes,
scrape the real metrics endpoint, poll for conditions with a deadline. (No tests in here.)"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PYTHON = sys.executable
DAEMON_CMD = [PYTHON, "-m", "kareus_node.main"]
KAREUS_CMD = [PYTHON, "-m", "kareus"]  # the real dispatcher (loads every command: slow to start)
CLOCK_CMD = [PYTHON, "-m", "kareus.cli.clock"]  # the same `clock` commands, quick to start


def wait_for(condition: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02) -> object:
    """Poll until `condition()` is truthy; return it, or fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def read_line(proc: subprocess.Popen, timeout_s: float = 15.0) -> str:
    """The next stdout line of `proc`, failing on timeout or exit."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not selector.select(timeout_s):
            raise AssertionError(f"no output from {proc.args} within {timeout_s} s")
        line = proc.stdout.readline()
    finally:
        selector.close()
    if not line:
        raise AssertionError(f"{proc.args} exited ({proc.wait()}) before printing a line")
    return line


@dataclass
class DaemonProcess:
    proc: subprocess.Popen
    socket_path: str
    state_dir: Path
    metrics_url: str

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics: (name, sorted labels) → value."""
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        return sum(value for (sample, sample_labels), value in self.scrape().items()
                   if sample == name and set(labels.items()) <= set(sample_labels))

    def http_status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"{self.metrics_url}{path}", timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)


def start_daemon(tmp_path: Path, *args: str, gpus: int = 2, state_dir: Path | None = None,
                 socket_name: str = "node.sock") -> DaemonProcess:
    socket_path = str(tmp_path / socket_name)
    state_dir = state_dir or tmp_path / "state"
    cmd = [*DAEMON_CMD, "--backend", "sim", "--sim-gpus", str(gpus), "--socket", socket_path,
           "--state-dir", str(state_dir), "--metrics-port", "0", "--metrics-address", "127.0.0.1",
           "--node-name", "node-a", *args]
    with open(tmp_path / "daemon.log", "a") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    line = read_line(proc)
    assert "serving" in line, line
    url = line.split("metrics=")[1].split()[0]
    return DaemonProcess(proc, socket_path, state_dir, url)


def start_hold(socket_path: str, gpu: str, mhz: int, *, cmd: tuple[str, ...] = tuple(CLOCK_CMD)) -> subprocess.Popen:
    """`kareus clock hold`, returned once it printed that the lock is in place."""
    proc = subprocess.Popen([*cmd, "hold", "--socket", socket_path, "--gpu", gpu, "--mhz", str(mhz)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = read_line(proc)
    assert line.startswith("locked "), line
    return proc


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
