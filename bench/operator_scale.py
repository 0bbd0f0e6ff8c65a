"""Operator at scale: many KareusJobs created at once on the dev cluster, fake pods, bounded memory.

    python bench/operator_scale.py [--jobs 200] [--pod-slots 16]

All jobs are created together through the API; pods run tiny shell stand-ins for the phases (the
real publish step still writes every result through the API), at most `--pod-slots` at a time as
on a full node. The script prints how long until every job was admitted (past Pending) and until
every job succeeded, the operator's resident memory (idle, peak, end; sampled twice a second) side
by side with the number of jobs it tracks, and the operator's own `kareus_jobs{phase}` metric.
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


def job_manifest(index: int) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"] = {"name": f"scale-{index:03d}", "namespace": "default"}
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


async def main(jobs: int, pod_slots: int, timeout_s: float) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kareus-scale-"))
    cluster = DevCluster(workdir, node_daemon=False, operator_env=fake_env(), pod_slots=pod_slots,
                         operator_args=["--metrics-port", "0"])
    async with cluster, Kube(load_kubeconfig(cluster.kubeconfig)) as kube:
        await asyncio.sleep(3.0)  # the operator is up and idle
        sampler = RssSampler(cluster.operator_process.pid)
        sampling = asyncio.create_task(sampler.run())
        await asyncio.sleep(1.0)
        idle_mib = max(rss for _, rss in sampler.samples)
        started = time.monotonic()
        gate = asyncio.Semaphore(20)

        async def create(i: int) -> None:
            async with gate:
                await kube.request("POST", path("kareus.dev/v1alpha1", "kareusjobs", "default"), job_manifest(i))

        await asyncio.gather(*(create(i) for i in range(jobs)))
        created_s = time.monotonic() - started
        admitted_s = done_s = None
        phases: dict[str, int] = {}
        while time.monotonic() - started < timeout_s:
            items = await kube.list(path("kareus.dev/v1alpha1", "kareusjobs", "default"))
            phases = {}
            for item in items:
                phase = (item.get("status") or {}).get("phase") or "None"
                phases[phase] = phases.get(phase, 0) + 1
            if admitted_s is None and phases.get("None", 0) + phases.get("Pending", 0) == 0:
                admitted_s = time.monotonic() - started
            if phases.get("Succeeded", 0) == jobs:
                done_s = time.monotonic() - started
                break
            print(f"  t={time.monotonic() - started:6.1f}s  {dict(sorted(phases.items()))}", flush=True)
            await asyncio.sleep(2.0)
        await asyncio.sleep(2.0)
        sampling.cancel()
        metrics = _operator_metrics(workdir / "operator.log")
    rss = [r for _, r in sampler.samples]
    print(f"\njobs created at once: {jobs} (API create took {created_s:.1f}s), pod slots {pod_slots}")
    print(f"all admitted (past Pending) after: {admitted_s if admitted_s is None else round(admitted_s, 1)} s")
    print(f"all Succeeded after:               {done_s if done_s is None else round(done_s, 1)} s   final phases {phases}")
    print(f"operator RSS MiB: idle {idle_mib:.1f} | peak {max(rss):.1f} | end {rss[-1]:.1f} "
          f"| peak/idle {max(rss) / idle_mib:.2f} | {(max(rss) - idle_mib) * 1024 / jobs:.1f} KiB per job")
    print("operator metrics:", *[line for line in metrics if line.startswith("kareus_jobs{")], sep="\n  ")
    return 0 if done_s is not None else 1


def _operator_metrics(log: Path) -> list[str]:
    match = re.search(r"metrics on (http://\S+)", log.read_text())
    if match is None:
        return []
    with urllib.request.urlopen(match.group(1), timeout=5) as response:
        return response.read().decode().splitlines()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--pod-slots", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.jobs, args.pod_slots, args.timeout_s)))
