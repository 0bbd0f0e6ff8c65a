"""Killing the operator (SIGKILL) in every phase and restarting it changes nothing in the outcome.

All state lives in the API (status and children), so a restarted operator picks up where the old
one was: the job ends exactly as an undisturbed one, and no child is ever created twice.
"""

from __future__ import annotations

import asyncio
import collections
import time

import kmock
import pytest
import yaml
from kareus_operator.devcluster.cluster import DevCluster
from kareus_operator.kube import Kube, load_kubeconfig, path
from operator_fakes import QUICKSTART, STEP_ENERGY_J, conditions, settings_env

PODS = kmock.resource("", "v1", "pods")
JOBS = kmock.resource("kareus.dev", "v1alpha1", "kareusjobs")

pytestmark = pytest.mark.timeout(240)


async def test_operator_killed_in_every_phase_resumes_without_duplicates(tmp_path):
    env = settings_env(tmp_path, step_s=0.4, steps=6, phase_s=2.0)
    cluster = DevCluster(tmp_path, node_daemon=False, operator_env=env)
    async with cluster, Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        pod_uids: dict[str, set[str]] = collections.defaultdict(set)

        async def record_pods() -> None:
            async for event in cluster.api.watch_events(PODS, "default"):
                meta = event["object"]["metadata"]
                pod_uids[meta["name"]].add(meta["uid"])

        recorder = asyncio.create_task(record_pods())
        job = yaml.safe_load(QUICKSTART.read_text())
        del job["spec"]["training"]["command"]
        await kube.request("POST", path("kareus.dev/v1alpha1", "kareusjobs", "default"), job)

        killed_in = []
        for phase in ("Profiling", "Optimizing", "Training"):
            deadline = time.monotonic() + 90
            while (cluster.api.get(JOBS, "default", "quickstart").get("status") or {}).get("phase") != phase:
                assert time.monotonic() < deadline, f"never saw phase {phase}"
                await asyncio.sleep(0.05)
            cluster.kill_operator()
            killed_in.append(phase)
            await asyncio.sleep(1.0)  # the world moves on while no operator runs
            cluster.start_operator()

        deadline = time.monotonic() + 120
        while (status := cluster.api.get(JOBS, "default", "quickstart").get("status") or {}).get("phase") not in (
                "Succeeded", "Failed"):
            assert time.monotonic() < deadline, f"job never finished: {status}"
            await asyncio.sleep(0.2)
        recorder.cancel()

        final = cluster.api.get(JOBS, "default", "quickstart")
        assert killed_in == ["Profiling", "Optimizing", "Training"]
        assert final["status"]["phase"] == "Succeeded"
        assert conditions(final) == {"Profiled": ("True", "Measured"), "Planned": ("True", "Optimized"),
                                     "Training": ("False", "Completed"), "Complete": ("True", "Completed")}
        assert final["status"]["restarts"] == 0
        assert final["status"]["measured"]["iterations"] == 6
        assert final["status"]["measured"]["energyJoules"] == pytest.approx(6 * STEP_ENERGY_J)
        assert sorted(pod_uids) == ["quickstart-optimize", "quickstart-profile", "quickstart-train-0"]
        assert all(len(uids) == 1 for uids in pod_uids.values()), dict(pod_uids)  # never created twice
