"""Operator at scale on the real control plane: many KareusJobs at once, fake phases, API load per job.

    python bench/operator_scale.py [--jobs 200] [--waves 2] [--pods-per-node 24] [--window-s 30]

`kareus dev-cluster`'s pieces (real kube-apiserver, controller manager, scheduler; one emulated
node whose `pods` capacity bounds how many pods run at once, as on a full node) with the operator
installed from the chart as its Deployment pod. Pods run shell stand-ins for the phases (the real
publish step still writes every result through the API); training runs `--train-s` seconds so a
steady state exists. Per wave (create all, wait until all succeed, delete all) it prints the time
until every job was admitted (past Pending) and succeeded, the operator's resident memory beside
its idle memory, and — measured by the API server itself over `--window-s` seconds of steady
training — the operator's requests per second per training job:

- `apiserver_flowcontrol_dispatched_requests_total` of a FlowSchema that matches only the
  operator's ServiceAccount (what the operator sent, whatever the resource);
- `apiserver_request_total` for kareusjobs, which only the operator reads and writes (the
  kubelet stand-in and the workers never touch them), by verb.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import ssl
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml
from kareus_operator.devcluster.cluster import RELEASE, RELEASE_NAMESPACE, DevCluster
from kareus_operator.kube import Kube, load_kubeconfig, path

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
STEP = '{"step": %d, "iteration_time_s": 0.25, "energy_j": 123.0}'
NAMESPACE = "scale"
JOBS = path("kareus.dev/v1alpha1", "kareusjobs", NAMESPACE)
PLAN = json.dumps({"predicted": {"iteration_time_s": 0.25, "iteration_energy_j": 123.0},
                   "frontier": {"rows": [{"time_s": 0.25, "energy_j": 123.0}]}})
FLOW_SCHEMA = "kareus-operator-bench"


def fake_settings(train_s: float) -> dict[str, str]:
    """Operator settings that make pods run shell one-liners instead of the real phases."""
    steps = max(1, int(train_s))
    train = (f'for i in $(seq 0 {steps - 1}); do printf \'%s\\n\' "$(printf \'{STEP}\' $i)" >> "$5/train.jsonl"; '
             'sleep 1; done')
    return {
        "PROFILE_COMMAND": json.dumps(["sh", "-c", 'echo \'{"fake": true}\' > "$1"', "sh", "{profile}"]),
        "OPTIMIZE_COMMAND": json.dumps(["sh", "-c", 'printf "%s" "$FAKE_PLAN" > "$1"', "sh", "{plan}"]),
        "TRAIN_COMMAND": json.dumps(["sh", "-c", train, "sh"]),
        "EXTRA_POD_ENV": json.dumps({"FAKE_PLAN": PLAN}),
        "RESYNC_S": "15", "PROGRESS_INTERVAL_S": "0.5",
    }


def job_manifest(wave: int, index: int) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"] = {"name": f"scale-{wave}-{index:03d}", "namespace": NAMESPACE}
    del job["spec"]["training"]["command"]
    return job


def operator_flow_schema() -> dict:
    """A FlowSchema matching only the operator's ServiceAccount, so the API server counts its requests."""
    return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": FLOW_SCHEMA},
            "spec": {"matchingPrecedence": 500, "priorityLevelConfiguration": {"name": "workload-high"},
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                         "name": f"{RELEASE}-operator", "namespace": RELEASE_NAMESPACE}}],
                         "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                            "clusterScope": True, "namespaces": ["*"]}],
                         "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}


class ApiServerMetrics:
    """The API server's /metrics, read with the admin's client certificate."""

    def __init__(self, cluster: DevCluster) -> None:
        plane = cluster.control_plane
        assert plane is not None and plane.admin is not None
        self.url = plane.url + "/metrics"
        self.context = ssl.create_default_context(cafile=str(plane.ca_file))
        self.context.load_cert_chain(str(plane.admin.pair.cert_file), str(plane.admin.pair.key_file))

    def counters(self) -> dict[str, float]:
        """`operator` (requests of the operator's FlowSchema) and `kareusjobs <verb>` counts."""
        with urllib.request.urlopen(self.url, context=self.context, timeout=30) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("apiserver_flowcontrol_dispatched_requests_total{") and f'flow_schema="{FLOW_SCHEMA}"' in line:
                out["operator"] = out.get("operator", 0.0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith("apiserver_request_total{") and 'resource="kareusjobs"' in line:
                verb = re.search(r'verb="(\w+)"', line)
                key = f"kareusjobs {verb.group(1) if verb else '?'}"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


def operator_process() -> psutil.Process:
    """The operator pod's process on the emulated node (`kareus-operator run`)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if any(part.endswith("kareus-operator") for part in cmdline) and "run" in cmdline:
            return process
    raise RuntimeError("the operator pod's process was not found")


class RssSampler:
    """Samples the operator's resident set size (MiB) until stopped."""

    def __init__(self, process: psutil.Process) -> None:
        self.process = process
        self.samples: list[float] = []

    async def run(self, interval_s: float = 0.5) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.samples.append(self.process.memory_info().rss / 2**20)
            await asyncio.sleep(interval_s)


async def phases(kube: Kube) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in await kube.list(JOBS):
        phase = (item.get("status") or {}).get("phase") or "None"
        counts[phase] = counts.get(phase, 0) + 1
    return counts


async def steady_load(kube: Kube, metrics: ApiServerMetrics, window_s: float) -> dict[str, float] | None:
    """Requests/s per training job over a window in which the number of training jobs is steady."""
    before, counts_before = metrics.counters(), await phases(kube)
    start = time.monotonic()
    await asyncio.sleep(window_s)
    after, counts_after = metrics.counters(), await phases(kube)
    elapsed = time.monotonic() - start
    training = (counts_before.get("Training", 0) + counts_after.get("Training", 0)) / 2
    if training < 1:
        return None
    load = {key: (after.get(key, 0.0) - before.get(key, 0.0)) / elapsed / training for key in after}
    return {"training_jobs": training, **load}


async def run_wave(kube: Kube, metrics: ApiServerMetrics, wave: int, jobs: int, window_s: float,
                   timeout_s: float) -> dict:
    started = time.monotonic()
    gate = asyncio.Semaphore(20)

    async def create(i: int) -> None:
        async with gate:
            await kube.request("POST", JOBS, job_manifest(wave, i))

    await asyncio.gather(*(create(i) for i in range(jobs)))
    result: dict = {"created_s": time.monotonic() - started, "admitted_s": None, "done_s": None, "load": None}
    while time.monotonic() - started < timeout_s:
        counts = await phases(kube)
        if result["admitted_s"] is None and counts.get("None", 0) + counts.get("Pending", 0) == 0:
            result["admitted_s"] = time.monotonic() - started
        if counts.get("Succeeded", 0) == jobs:
            result["done_s"] = time.monotonic() - started
            break
        print(f"  wave {wave} t={time.monotonic() - started:6.1f}s  {dict(sorted(counts.items()))}", flush=True)
        if result["load"] is None and counts.get("Training", 0) >= 2:
            result["load"] = await steady_load(kube, metrics, window_s)
        else:
            await asyncio.sleep(2.0)
    return result


async def delete_all(kube: Kube) -> None:
    for item in await kube.list(JOBS):
        await kube.delete(f"{JOBS}/{item['metadata']['name']}")
    while await kube.list(JOBS):
        await asyncio.sleep(1.0)


async def measure(cluster: DevCluster, jobs: int, waves: int, window_s: float, timeout_s: float) -> list[dict]:
    metrics = ApiServerMetrics(cluster)
    async with Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        sampler = RssSampler(operator_process())
        sampling = asyncio.create_task(sampler.run())
        await asyncio.sleep(3.0)
        idle_mib = max(sampler.samples)
        results = []
        for wave in range(waves):
            result = await run_wave(kube, metrics, wave, jobs, window_s, timeout_s)
            await asyncio.sleep(2.0)
            results.append({**result, "rss_end_mib": sampler.samples[-1], "rss_peak_mib": max(sampler.samples),
                            "rss_idle_mib": idle_mib})
            if wave + 1 < waves:
                await delete_all(kube)
        sampling.cancel()
    return results


def main(jobs: int, waves: int, pods_per_node: int, window_s: float, train_s: float, timeout_s: float) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kareus-scale-"))
    cluster = DevCluster(workdir, node_agent=False, pods_per_node=pods_per_node, operator_settings=fake_settings(train_s),
                         worker_namespaces=[NAMESPACE])
    with cluster:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(operator_flow_schema()))
        results = asyncio.run(measure(cluster, jobs, waves, window_s, timeout_s))
    idle = results[0]["rss_idle_mib"]
    print(f"\n{jobs} KareusJobs created at once per wave, {waves} wave(s), {pods_per_node} pods per node; "
          f"operator idle RSS {idle:.1f} MiB")
    print("wave | API create s | all admitted s | all Succeeded s | RSS end MiB | RSS peak MiB | peak/idle")
    for wave, r in enumerate(results):
        print(f"{wave:4d} | {r['created_s']:12.1f} | {_num(r['admitted_s']):>14} | {_num(r['done_s']):>15} | "
              f"{r['rss_end_mib']:11.1f} | {r['rss_peak_mib']:12.1f} | {r['rss_peak_mib'] / idle:9.2f}")
    print("\nsteady-state API load per training job (the API server's own counters, requests/s):")
    for wave, r in enumerate(results):
        load = r["load"]
        if load is None:
            print(f"  wave {wave}: no steady training window")
            continue
        parts = ", ".join(f"{key} {value:.3f}" for key, value in sorted(load.items()) if key != "training_jobs")
        print(f"  wave {wave}: {load['training_jobs']:.0f} jobs training; {parts}")
    return 0 if all(r["done_s"] is not None for r in results) else 1


def _num(value: float | None) -> str:
    return "timeout" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--waves", type=int, default=2, help="create, finish and delete this many times")
    parser.add_argument("--pods-per-node", type=int, default=24, help="the node's pods capacity (the operator's pod included)")
    parser.add_argument("--window-s", type=float, default=30.0, help="steady-state measurement window")
    parser.add_argument("--train-s", type=float, default=40.0, help="how long each fake training runs")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    raise SystemExit(main(args.jobs, args.waves, args.pods_per_node, args.window_s, args.train_s, args.timeout_s))
