"""`kareus validate JOB.yaml …` — check KareusJob manifests with the rules the operator applies.

Prints one line per valid file, and for an invalid one every problem as `FILE: field.path:
message`; exits 0 when all files are valid and 1 otherwise. Unreadable files and broken YAML are
reported the same way (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys

from kareus.spec import SpecError, load_job
from kareus.spec.types import KareusJob


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("validate", help="check KareusJob manifests",
                                   description="Validate KareusJob manifests; print every error with its field path.")
    parser.add_argument("files", nargs="+", metavar="JOB.yaml", help="manifest files to check")
    parser.add_argument("--json", action="store_true", help="print one JSON object per file")
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


def run(args: argparse.Namespace) -> int:
    all_valid = True
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
        if args.json:
            print(json.dumps({"file": path, "valid": True, "errors": [], "spec": job.spec.to_dict()}))
        else:
            print(f"{path}: {_summary(job)}")
    return 0 if all_valid else 1
