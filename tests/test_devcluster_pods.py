"""The dev cluster's pod runner: pods as local processes, with env, volumes, status, logs and deletion."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from kareus_operator.devcluster.cluster import DevCluster
from kareus_operator.kube import Kube, load_kubeconfig, path

PY = sys.executable
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"

pytestmark = pytest.mark.timeout(120)


def pod(name: str, command: list[str], **spec) -> dict:
    return {"metadata": {"name": name, "labels": {"app": "t"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "command": command, **spec.pop("container", {})}],
                     **spec}}


async def wait_phase(kube: Kube, name: str, phases: tuple[str, ...], timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = await kube.get(path("v1", "pods", "default", name))
        if body is not None and (body.get("status") or {}).get("phase") in phases:
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"pod {name} never reached {phases}: {body and body.get('status')}")


async def test_pods_run_with_env_volumes_and_logs(tmp_path):
    async with DevCluster(tmp_path, operator=False, node_daemon=False) as cluster, \
            Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        await kube.create(path("v1", "configmaps", "default"), {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}})
        program = ("import os, pathlib, sys;"
                   "print(pathlib.Path(sys.argv[1]).read_text(), os.environ['MY_POD'], os.environ['FIXED'],"
                   " os.environ['PEER'], os.environ['KUBERNETES_SERVICE_HOST']);"
                   "pathlib.Path(os.environ['KAREUS_SERVICEACCOUNT_DIR'], 'token').read_text()")
        env = [{"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
               {"name": "FIXED", "value": "42"}, {"name": "PEER", "value": "p-0.svc-name.default.svc"}]
        body = pod("greeter", [PY, "-c", program, "/etc/cfg/greeting"],
                   container={"env": env, "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]},
                   volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}])
        created, _ = await kube.create(path("v1", "pods", "default"), body)
        assert "status" not in created
        done = await wait_phase(kube, "greeter", ("Succeeded", "Failed"))
        assert done["status"]["phase"] == "Succeeded" and done["spec"]["nodeName"] == "kareus-dev-node"
        assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        log = await kube.request("GET", path("v1", "pods", "default", "greeter", "log"))
        assert log.split() == ["hello", "greeter", "42", "127.0.0.1", "127.0.0.1"]

        await kube.create(path("v1", "pods", "default"), pod("crasher", [PY, "-c", "import sys; sys.exit(7)"]))
        failed = await wait_phase(kube, "crasher", ("Succeeded", "Failed"))
        assert failed["status"]["phase"] == "Failed"
        assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 7


async def test_configmap_updates_reach_running_pods_and_deletion_kills(tmp_path):
    async with DevCluster(tmp_path, operator=False, node_daemon=False) as cluster, \
            Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        await kube.create(path("v1", "configmaps", "default"), {"metadata": {"name": "plan"}, "data": {"v": "1"}})
        marker = tmp_path / "seen"
        program = ("import pathlib, sys, time\n"
                   "while pathlib.Path(sys.argv[1]).read_text() != '2': time.sleep(0.05)\n"
                   "pathlib.Path(sys.argv[2]).write_text('updated')\n"
                   "time.sleep(600)\n")
        body = pod("watcher", [PY, "-c", program, "/plan/v", str(marker)],
                   container={"volumeMounts": [{"name": "plan", "mountPath": "/plan"}]},
                   volumes=[{"name": "plan", "configMap": {"name": "plan"}}])
        await kube.create(path("v1", "pods", "default"), body)
        await wait_phase(kube, "watcher", ("Running",))
        await kube.merge_patch(path("v1", "configmaps", "default", "plan"), {"data": {"v": "2"}})
        deadline = time.monotonic() + 20
        while not marker.exists():
            assert time.monotonic() < deadline, "the ConfigMap change never reached the pod's file"
            await asyncio.sleep(0.1)
        process = next(p for p in cluster.runner.pods.values() if p.name == "watcher").processes[0]
        await kube.delete(path("v1", "pods", "default", "watcher"))
        await asyncio.wait_for(process.wait(), 10)  # deleting the pod terminated its process
        assert process.returncode is not None


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
async def test_kubectl_talks_to_the_dev_cluster(tmp_path):
    async with DevCluster(tmp_path, operator=False, node_daemon=False) as cluster:
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}

        async def kubectl(*args: str) -> str:
            process = await asyncio.create_subprocess_exec(
                "kubectl", *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(process.communicate(), 60)
            assert process.returncode == 0, out.decode()
            return out.decode()

        assert "created" in await kubectl("apply", "--validate=false", "-f", str(QUICKSTART))
        assert await kubectl("get", "kj", "-o", "jsonpath={.items[*].metadata.name}") == "quickstart"
        await kubectl("run", "hello", "--image=none", "--restart=Never", "--command", "--", PY, "-c", "print('hi')")
        deadline = time.monotonic() + 30
        while "Succeeded" not in await kubectl("get", "pod", "hello", "-o", "jsonpath={.status.phase}"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        assert (await kubectl("logs", "hello")).strip() == "hi"


@pytest.mark.parametrize(("args", "message"), [
    (["--operator-env", "NOEQUALS"], "--operator-env: expected NAME=VALUE"),
    (["--pod-slots", "0"], "--pod-slots: must be >= 1"),
    (["--crd", "/does/not/exist.yaml"], "--crd: no such file"),
])
def test_dev_cluster_cli_rejects_bad_arguments(tmp_path, capsys, args, message):
    from kareus.cli import main

    assert main(["dev-cluster", "--kubeconfig", str(tmp_path / "kc"), *args]) == 1
    assert message in capsys.readouterr().err


async def test_gpus_are_handed_out_whole_and_never_shared(tmp_path):
    from kareus_operator.devcluster.cluster import NODE_GPUS, node_gpu_uuids

    async with DevCluster(tmp_path, operator=False, node_daemon=False) as cluster, \
            Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        # Each pod holds its GPUs until a file appears, so all three overlap in time.
        release = tmp_path / "release"
        program = ("import os, pathlib, sys, time\n"
                   "print(os.environ.get('NVIDIA_VISIBLE_DEVICES', ''), flush=True)\n"
                   "while not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.05)\n")
        for name, gpus in (("a", 3), ("b", 3), ("c", 3)):
            await kube.create(path("v1", "pods", "default"), pod(
                name, [PY, "-c", program, str(release)],
                container={"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}))
        await kube.create(path("v1", "pods", "default"), pod(
            "greedy", [PY, "-c", "pass"], container={"resources": {"limits": {"nvidia.com/gpu": str(NODE_GPUS + 1)}}}))
        refused = await wait_phase(kube, "greedy", ("Succeeded", "Failed"))
        assert refused["status"]["phase"] == "Failed" and "nvidia.com/gpu" in refused["status"]["message"]

        await wait_phase(kube, "a", ("Running",))
        await wait_phase(kube, "b", ("Running",))
        deadline = time.monotonic() + 20
        logs: dict[str, str] = {}
        while time.monotonic() < deadline and len(logs) < 2:
            for name in ("a", "b"):
                text = await kube.request("GET", path("v1", "pods", "default", name, "log"))
                if text and text.strip():
                    logs[name] = text.strip()
            await asyncio.sleep(0.1)
        held = [set(logs[name].split(",")) for name in ("a", "b")]
        assert all(len(h) == 3 for h in held) and not held[0] & held[1]
        assert held[0] | held[1] <= set(node_gpu_uuids())
        # 8 GPUs: the third pod waits for GPUs (Pending), as on a real node, until one finishes.
        waiting = await kube.get(path("v1", "pods", "default", "c"))
        assert (waiting.get("status") or {}).get("phase", "Pending") == "Pending"
        release.touch()
        done = await wait_phase(kube, "c", ("Succeeded", "Failed"))
        assert done["status"]["phase"] == "Succeeded"
