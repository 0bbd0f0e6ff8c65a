"""Operator at scale: many KareusJobs created at once on the dev cluster, fake pods, bounded memory.

    python bench/operator_scale.py [--jobs 200] [--waves 2] [--pod-slots 16]

All jobs are created together through the API; pods run tiny shell stand-ins for the phases (the
real publish step still writes every result through the API), at most `--pod-slots` at a time as
on a full node. Per wave (create all, wait until all succeed, delete all) the script prints how long
until every job was admitted (past Pending) and until every job succeeded, and the operator's
resident memory (sampled twice a second) side by side with its idle memory: a second wave that ends
at the first wave's memory shows the operator keeps nothing per finished job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml
from kareus_operator.devcluster.cluster import DevCluster
from kareus_operator.kube import Kube, load_kubeconfig, path

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
STEP = '{"step": %d, "iteration_time_s": 0.25, "energy_j": 123.0}'
JOBS = path("kareus.dev/v1alpha1", "kareusjobs", "default")
PLAN = json.dumps({"predicted": {"iteration_time_s": 0.25, "iteration_energy_j": 123.0},
                   "frontier": {"rows": [{"time_s": 0.25, "energy_j": 123.0}]}})


def fake_env() -> dict[str, str]:
    """Operator settings that make pods run shell one-liners instead of the real phases."""
    train = 'for i in 0 1 2 3; do printf \'%s\\n\' "$(printf \'' + STEP + '\' $i)" >> "$5/train.jsonl"; done'
    return {
        "KAREUS_OPERATOR_PROFILE_COMMAND": json.dumps(["sh", "-c", 'echo \'{"fake": true}\' > "$1"', "sh", "{profile}"]),
        "KAREUS_OPERATOR_OPTIMIZE_COMMAND": json.dumps(["sh", "-c", 'printf "%s" "$FAKE_PLAN" > "$1"', "sh", "{plan}"]),
        "KAREUS_OPERATOR_TRAIN_COMMAND": json.dumps(["sh", "-c", train, "sh"]),
        "KAREUS_OPERATOR_EXTRA_POD_ENV": json.dumps({"FAKE_PLAN": PLAN}),
        "KAREUS_OPERATOR_RESYNC_S": "15", "KAREUS_OPERATOR_PROGRESS_INTERVAL_S": "0.5",
    }


def job_manifest(wave: int, index: int) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"] = {"name": f"scale-{wave}-{index:03d}", "namespace": "default"}
    del job["spec"]["training"]["command"]
    return job


class RssSampler:
    """Samples the operator's resident set size (MiB) until stopped."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []

    async def run(self, interval_s: float = 0.5) -> None:
        start = time.monotonic()
        while True:
            with contextlib.suppress(psutil.Error):
                self.samples.append((time.monotonic() - start, self.process.memory_info().rss / 2**20))
            await asyncio.sleep(interval_s)


async def run_wave(kube: Kube, wave: int, jobs: int, timeout_s: float) -> tuple[float, float | None, float | None]:
    """Create `jobs` jobs at once; (API create time, time to all admitted, time to all succeeded)."""
    started = time.monotonic()
    gate = asyncio.Semaphore(20)

    async def create(i: int) -> None:
        async with gate:
            await kube.request("POST", JOBS, job_manifest(wave, i))

    await asyncio.gather(*(create(i) for i in range(jobs)))
    created_s = time.monotonic() - started
    admitted_s = done_s = None
    while time.monotonic() - started < timeout_s:
        phases: dict[str, int] = {}
        for item in await kube.list(JOBS):
            phase = (item.get("status") or {}).get("phase") or "None"
            phases[phase] = phases.get(phase, 0) + 1
        if admitted_s is None and phases.get("None", 0) + phases.get("Pending", 0) == 0:
            admitted_s = time.monotonic() - started
        if phases.get("Succeeded", 0) == jobs:
            done_s = time.monotonic() - started
            break
        print(f"  wave {wave} t={time.monotonic() - started:6.1f}s  {dict(sorted(phases.items()))}", flush=True)
        await asyncio.sleep(2.0)
    return created_s, admitted_s, done_s


async def delete_all(kube: Kube) -> None:
    for item in await kube.list(JOBS):
        await kube.delete(f"{JOBS}/{item['metadata']['name']}")
    while await kube.list(JOBS):
        await asyncio.sleep(1.0)


async def main(jobs: int, waves: int, pod_slots: int, timeout_s: float) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kareus-scale-"))
    cluster = DevCluster(workdir, node_daemon=False, operator_env=fake_env(), pod_slots=pod_slots,
                         operator_args=["--metrics-port", "0"])
    async with cluster, Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        while "metrics on" not in (workdir / "operator.log").read_text():
            await asyncio.sleep(0.2)  # the operator has imported everything and is serving
        sampler = RssSampler(cluster.operator_process.pid)
        sampling = asyncio.create_task(sampler.run())
        await asyncio.sleep(3.0)
        idle_mib = max(rss for _, rss in sampler.samples)
        results = []
        for wave in range(waves):
            created_s, admitted_s, done_s = await run_wave(kube, wave, jobs, timeout_s)
            await asyncio.sleep(2.0)
            wave_peak = max(rss for _, rss in sampler.samples)
            metrics = _operator_metrics(workdir / "operator.log")
            results.append((wave, created_s, admitted_s, done_s, sampler.samples[-1][1], wave_peak))
            if wave + 1 < waves:
                await delete_all(kube)
        sampling.cancel()
    print(f"\n{jobs} KareusJobs created at once per wave, {waves} wave(s), pod slots {pod_slots}; operator idle RSS "
          f"{idle_mib:.1f} MiB")
    print("wave | API create s | all admitted s | all Succeeded s | RSS end MiB | RSS peak MiB | peak/idle")
    for wave, created_s, admitted_s, done_s, end_mib, peak_mib in results:
        print(f"{wave:4d} | {created_s:12.1f} | {_num(admitted_s):>14} | {_num(done_s):>15} | {end_mib:11.1f} | "
              f"{peak_mib:12.1f} | {peak_mib / idle_mib:9.2f}")
    print("operator metrics after the last wave:", *[m for m in metrics if m.startswith("kareus_jobs{")], sep="\n  ")
    return 0 if all(r[3] is not None for r in results) else 1


def _num(value: float | None) -> str:
    return "timeout" if value is None else f"{value:.1f}"


def _operator_metrics(log: Path) -> list[str]:
    match = re.search(r"metrics on (http://\S+)", log.read_text())
    if match is None:
        return []
    with urllib.request.urlopen(match.group(1), timeout=5) as response:
        return response.read().decode().splitlines()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--waves", type=int, default=2, help="create, finish and delete this many times")
    parser.add_argument("--pod-slots", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.jobs, args.waves, args.pod_slots, args.timeout_s)))
