"""`kareus validate JOB.yaml …` — check KareusJob manifests with the rules the operator applies.

Prints one line per valid file, and for an invalid one every problem as `FILE: field.path:
message`; exits 0 when all files are valid and 1 otherwise. Unreadable files and broken YAML are
reported the same way (one line, no traceback).

A valid job is then planned for memory (`kareus.workload.memory`): each pipeline stage's peak on
one rank of the job's GPU product (for a CPU-proxy job too: the plan is for the GPU model). A job
whose worst rank does not fit is refused with one line, `FILE: spec.gpu.product: stage 0 rank
needs … GiB on … (weights …, …)`, and exit code 78 (no retry can make it fit), as the operator
refuses it (condition reason `DoesNotFit`). An invalid spec still exits 1. `--no-memory-plan` checks
the manifest alone.
"""

from __future__ import annotations

import argparse
import json
import sys

from kareus.errors import EXIT_CONFIG
from kareus.sim.gpus import get_gpu
from kareus.spec import SpecError, load_job
from kareus.spec.types import KareusJob
from kareus.workload.memory import GIB, memory_plan


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("validate", help="check KareusJob manifests",
                                   description="Validate KareusJob manifests; print every error with its field path.")
    parser.add_argument("files", nargs="+", metavar="JOB.yaml", help="manifest files to check")
    parser.add_argument("--json", action="store_true", help="print one JSON object per file")
    parser.add_argument("--no-memory-plan", dest="memory_plan", action="store_false",
                        help="check the manifest only, not whether each rank's peak memory fits its GPU")
    parser.set_defaults(func=run)


def _summary(job: KareusJob) -> str:
    spec = job.spec
    par = spec.parallelism
    proxy = spec.cpu_proxy_shape()
    on_cpu = (f"; on CPU trains a proxy of {proxy.num_layers} layers, hidden {proxy.hidden_size}, "
              f"{spec.cpu_proxy_sequence_length} tokens" if proxy else "")
    return (f"valid KareusJob {job.namespace}/{job.name}: {spec.model_shape().name}, "
            f"TP{par.tensor} PP{par.pipeline} CP{par.context} DP{par.data} on {spec.num_gpus} GPUs, "
            f"objective {spec.objective.kind}{on_cpu}")


def _memory_json(plan, gpu, refusal: str | None) -> dict:
    return {"gpu": gpu.name, "capacity_gib": round(gpu.memory_gib, 2), "fits": refusal is None, "error": refusal,
            "stages": [{"stage": s.stage, "layers": s.layers, "peak_gib": round(s.peak_gib, 3), "moment": s.moment,
                        "parts_gib": {k: round(v / GIB, 3) for k, v in s.parts.items() if v}} for s in plan.stages]}


def run(args: argparse.Namespace) -> int:
    all_valid = True
    all_fit = True
    for path in args.files:
        try:
            job = load_job(path)
        except SpecError as error:
            all_valid = False
            if args.json:
                errors = [{"path": item.path, "message": item.message} for item in error.errors]
                print(json.dumps({"file": path, "valid": False, "errors": errors}))
            for item in error.errors:
                # File-level problems (missing, not YAML) already name the file as their path.
                line = str(item) if item.path == str(path) else f"{path}: {item}"
                print(line, file=sys.stderr)
            continue
        plan = memory_plan(job) if args.memory_plan else None
        gpu = get_gpu(job.spec.gpu_product) if plan else None
        refusal = plan.fits(gpu) if plan else None
        all_fit = all_fit and refusal is None
        if args.json:
            memory = {"memory": _memory_json(plan, gpu, refusal)} if plan else {}
            print(json.dumps({"file": path, "valid": True, "errors": [], "spec": job.spec.to_dict(), **memory}))
        else:
            print(f"{path}: {_summary(job)}")
            for line in plan.table() if plan else ():
                print(f"  {line}")
        if refusal is not None:
            print(f"{path}: spec.gpu.product: {refusal}", file=sys.stderr)
    if not all_valid:
        return 1
    return 0 if all_fit else EXIT_CONFIG
