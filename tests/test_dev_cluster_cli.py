"""`kareus dev-cluster` as a user runs it: `ready` once everything is up, Ctrl-C leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(300)


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


def test_ready_then_ctrl_c_stops_everything(tmp_path, control_plane):
    """control_plane: the binaries are there (built once per session); this cluster is its own."""
    process = subprocess.Popen([sys.executable, "-m", "kareus", "dev-cluster", "--kubeconfig", str(tmp_path / "kc"),
                                "--workdir", str(tmp_path / "work")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if line.strip() == "ready" or (not line and process.poll() is not None):
            break
    assert lines[-1].strip() == "ready", "".join(lines[-20:])
    assert any(line.startswith("API https://127.0.0.1:") for line in lines)
    started = psutil.Process(process.pid).children(recursive=True)
    names = {p.name() for p in started}
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"} <= names
    assert any("kareus-operator" in " ".join(p.cmdline()) for p in started)  # the operator pod runs
    assert any("kareus-node" in " ".join(p.cmdline()) for p in started)  # the node agent pod runs
    pods = [p for p in started if "kareus-operator" in " ".join(p.cmdline()) or "kareus-node" in " ".join(p.cmdline())]

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=90) == 0
    gone, alive = psutil.wait_procs(started, timeout=10)
    assert alive == [], [(p.pid, p.name()) for p in alive]
    assert len(gone) >= 4 + len(pods)
