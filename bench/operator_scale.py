"""Operator at scale on the real control plane: many KareusJobs at once, fake phases, API load per job.

    python bench/operator_scale.py [--jobs 200] [--waves 1] [--pods-per-node 24] [--window-s 60]

`kareus dev-cluster`'s pieces (real kube-apiserver, controller manager, scheduler; one emulated
node whose `pods` capacity bounds how many pods run at once, as on a full node) with the operator
installed from the chart as its Deployment pod. Pods run shell stand-ins for the phases (the real
publish step still writes every result through the API). Each cadence runs under one operator configuration — the defaults, and the
cadence of the first build (`legacy`: progress every 1 s, resync every 10 s) — so both are
measured side by side in one run. Per cadence it first lets `--steady-jobs` long jobs train and
measures, by the API server's own counters over `--window-s` seconds in which nothing else
happens, per training job:

- operator requests/s: `apiserver_flowcontrol_dispatched_requests_total` of a FlowSchema that
  matches only the operator's ServiceAccount (whatever the resource);
- writes/min: `apiserver_request_total` for POST/PUT/PATCH/DELETE on kareusjobs (only the operator
  writes them) and on configmaps (the workers' progress; the emulated node writes none);

then runs `--waves` waves of `--jobs` short jobs (create all, wait until all succeed, delete all)
and prints the time until every job was admitted (past Pending) and succeeded, and the operator's
resident memory beside its idle memory.
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
from kareus_devcluster.cluster import RELEASE, RELEASE_NAMESPACE, DevCluster
from kareus_operator.kube import Kube, load_kubeconfig, path

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
STEP = '{"step": %d, "iteration_time_s": 0.25, "energy_j": 123.0}'
NAMESPACE = "scale"
JOBS = path("kareus.dev/v1alpha1", "kareusjobs", NAMESPACE)
PLAN = json.dumps({"predicted": {"iteration_time_s": 0.25, "iteration_energy_j": 123.0},
                   "frontier": {"rows": [{"time_s": 0.25, "energy_j": 123.0}]}})
FLOW_SCHEMA = "kareus-operator-bench"


CADENCES = {"default": {}, "legacy": {"RESYNC_S": "10", "PROGRESS_INTERVAL_S": "1"}}
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


def fake_settings(cadence: str) -> dict[str, str]:
    """Operator settings that make pods run shell one-liners instead of the real phases; training
    writes one step a second for $FAKE_TRAIN_S seconds (a job's spec.training.env sets it)."""
    train = ('for i in $(seq 1 "${FAKE_TRAIN_S:-5}"); do printf \'%s\\n\' "$(printf \'' + STEP + '\' $i)" '
             '>> "$5/train.jsonl"; sleep 1; done')
    return {
        "PROFILE_COMMAND": json.dumps(["sh", "-c", 'echo \'{"fake": true}\' > "$1"', "sh", "{profile}"]),
        "OPTIMIZE_COMMAND": json.dumps(["sh", "-c", 'printf "%s" "$FAKE_PLAN" > "$1"', "sh", "{plan}"]),
        "TRAIN_COMMAND": json.dumps(["sh", "-c", train, "sh"]),
        "EXTRA_POD_ENV": json.dumps({"FAKE_PLAN": PLAN}), **CADENCES[cadence],
    }


def job_manifest(wave: int, index: int, train_s: float | None = None) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"] = {"name": f"scale-{wave}-{index:03d}", "namespace": NAMESPACE}
    del job["spec"]["training"]["command"]
    if train_s is not None:
        job["spec"]["training"]["env"] = [{"name": "FAKE_TRAIN_S", "value": str(int(train_s))}]
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
        """`operator requests` (the operator's FlowSchema) and `<resource> writes` counts."""
        with urllib.request.urlopen(self.url, context=self.context, timeout=30) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("apiserver_flowcontrol_dispatched_requests_total{") and f'flow_schema="{FLOW_SCHEMA}"' in line:
                out["operator requests"] = out.get("operator requests", 0.0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith("apiserver_request_total{"):
                resource, verb = re.search(r'resource="(\w*)"', line), re.search(r'verb="(\w+)"', line)
                if resource and verb and resource.group(1) in ("kareusjobs", "configmaps") and verb.group(1) in WRITE_VERBS:
                    key = f"{resource.group(1)} writes"
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


async def steady_load(kube: Kube, metrics: ApiServerMetrics, jobs: int, window_s: float, settle_s: float,
                      train_s: float) -> dict[str, float] | None:
    """Per training job, over `window_s` in which exactly `jobs` jobs train and nothing else happens:
    create them, wait until all train and `settle_s` more (their start-up writes are over), measure."""
    gate = asyncio.Semaphore(20)

    async def create(i: int) -> None:
        async with gate:
            await kube.request("POST", JOBS, job_manifest(9, i, train_s))

    await asyncio.gather(*(create(i) for i in range(jobs)))
    while (await phases(kube)).get("Training", 0) < jobs:
        await asyncio.sleep(1.0)
    await asyncio.sleep(settle_s)
    before = metrics.counters()
    start = time.monotonic()
    await asyncio.sleep(window_s)
    after, counts = metrics.counters(), await phases(kube)
    elapsed = time.monotonic() - start
    await delete_all(kube)
    if counts.get("Training", 0) != jobs:
        return None  # a job finished or failed inside the window: not a steady state
    per_s = {key: (after.get(key, 0.0) - before.get(key, 0.0)) / elapsed / jobs for key in after}
    return {"training_jobs": jobs, "operator requests/s": per_s.get("operator requests", 0.0),
            "kareusjobs writes/min": 60 * per_s.get("kareusjobs writes", 0.0),
            "configmaps writes/min": 60 * per_s.get("configmaps writes", 0.0)}


async def run_wave(kube: Kube, wave: int, jobs: int, timeout_s: float) -> dict:
    started = time.monotonic()
    gate = asyncio.Semaphore(20)

    async def create(i: int) -> None:
        async with gate:
            await kube.request("POST", JOBS, job_manifest(wave, i))

    await asyncio.gather(*(create(i) for i in range(jobs)))
    result: dict = {"created_s": time.monotonic() - started, "admitted_s": None, "done_s": None}
    while time.monotonic() - started < timeout_s:
        counts = await phases(kube)
        if result["admitted_s"] is None and counts.get("None", 0) + counts.get("Pending", 0) == 0:
            result["admitted_s"] = time.monotonic() - started
        if counts.get("Succeeded", 0) == jobs:
            result["done_s"] = time.monotonic() - started
            break
        print(f"  wave {wave} t={time.monotonic() - started:6.1f}s  {dict(sorted(counts.items()))}", flush=True)
        await asyncio.sleep(2.0)
    return result


async def delete_all(kube: Kube) -> None:
    for item in await kube.list(JOBS):
        await kube.delete(f"{JOBS}/{item['metadata']['name']}")
    while await kube.list(JOBS):
        await asyncio.sleep(1.0)


async def measure(cluster: DevCluster, cadence: str, jobs: int, waves: int, steady_jobs: int, window_s: float,
                  settle_s: float, timeout_s: float) -> list[dict]:
    metrics = ApiServerMetrics(cluster)
    async with Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        sampler = RssSampler(operator_process())
        sampling = asyncio.create_task(sampler.run())
        await asyncio.sleep(3.0)
        idle_mib = max(sampler.samples)
        load = await steady_load(kube, metrics, steady_jobs, window_s, settle_s, train_s=window_s + settle_s + 120)
        results = []
        for wave in range(waves):
            result = await run_wave(kube, wave, jobs, timeout_s)
            await asyncio.sleep(2.0)
            results.append({**result, "cadence": cadence, "load": load, "rss_end_mib": sampler.samples[-1],
                            "rss_peak_mib": max(sampler.samples), "rss_idle_mib": idle_mib})
            await delete_all(kube)
        sampling.cancel()
    return results


def main(args: argparse.Namespace, cadences: list[str]) -> int:
    jobs, waves, pods_per_node = args.jobs, args.waves, args.pods_per_node
    workdir = Path(tempfile.mkdtemp(prefix="kareus-scale-"))
    # Each fake job asks for the quickstart's 2 GPUs: the node has enough for every pod it can hold.
    cluster = DevCluster(workdir, node_agent=False, pods_per_node=pods_per_node, gpus_per_node=2 * pods_per_node,
                         operator_settings=fake_settings(cadences[0]), worker_namespaces=[NAMESPACE])
    results = []
    with cluster:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(operator_flow_schema()))
        for cadence in cadences:
            if cadence != cadences[0]:  # `helm upgrade` with the other settings: a rolled-out operator pod
                cluster.install(RELEASE, RELEASE_NAMESPACE, cluster.values(
                    operator=True, node_agent=False, settings=fake_settings(cadence)))
                time.sleep(5.0)  # the old pod's process is gone before the new one is sampled
            results += asyncio.run(measure(cluster, cadence, jobs, waves, args.steady_jobs, args.window_s,
                                           args.settle_s, args.timeout_s))
    print(f"\n{jobs} KareusJobs created at once per wave, {pods_per_node} pods per node")
    print("cadence | wave | API create s | all admitted s | all Succeeded s | RSS idle MiB | RSS peak MiB | peak/idle")
    for r in results:
        print(f"{r['cadence']:>7} | {results.index(r):4d} | {r['created_s']:12.1f} | {_num(r['admitted_s']):>14} | "
              f"{_num(r['done_s']):>15} | {r['rss_idle_mib']:12.1f} | {r['rss_peak_mib']:12.1f} | "
              f"{r['rss_peak_mib'] / r['rss_idle_mib']:9.2f}")
    print(f"\nsteady-state API load per training job, {args.steady_jobs} jobs training, {args.window_s:.0f} s window "
          "(the API server's own counters):")
    print("cadence | jobs training | operator requests/s | kareusjobs writes/min | configmaps writes/min")
    for r in results:
        load = r["load"]
        if load is None:
            print(f"{r['cadence']:>7} | no steady training window")
            continue
        print(f"{r['cadence']:>7} | {load['training_jobs']:13.0f} | {load['operator requests/s']:19.3f} | "
              f"{load['kareusjobs writes/min']:21.2f} | {load['configmaps writes/min']:21.2f}")
    return 0 if all(r["done_s"] is not None for r in results) else 1


def _num(value: float | None) -> str:
    return "timeout" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--waves", type=int, default=1, help="waves per cadence: create, finish and delete")
    parser.add_argument("--cadences", default="default,legacy",
                        help=f"operator configurations to measure, comma-separated, of {', '.join(CADENCES)}")
    parser.add_argument("--pods-per-node", type=int, default=40, help="the node's pods capacity (the operator's pod included)")
    parser.add_argument("--steady-jobs", type=int, default=10, help="jobs training during the steady-state window")
    parser.add_argument("--window-s", type=float, default=120.0, help="steady-state measurement window")
    parser.add_argument("--settle-s", type=float, default=15.0, help="wait after all steady jobs train")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    chosen = [c for c in args.cadences.split(",") if c]
    if not chosen or any(c not in CADENCES for c in chosen):
        parser.error(f"--cadences: choose from {', '.join(CADENCES)}, got {args.cadences!r}")
    raise SystemExit(main(args, chosen))
