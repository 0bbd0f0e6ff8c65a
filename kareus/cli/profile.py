"""`kareus profile JOB.yaml --out PROFILE.json`: measure every partition type of a job.

Runs the per-partition searches and per-clock sweeps (`kareus.profiler.profile_job`) on the
simulated GPU or on the real GPUs through NVML and writes the profile document. With `--store DIR`
every measurement is logged as it is taken, so a killed run resumes where it stopped and a later
job with the same profile key measures nothing again. The progress bar shows candidates measured,
the current partition's front hypervolume and the time left.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kareus.daemon_client import daemon_endpoint
from kareus.errors import KareusError
from kareus.profiler.profile import BACKENDS, ProfileProgress, profile_job
from kareus.search.algorithms import PRESETS
from kareus.sim import paramsfile
from kareus.spec import load_job


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="measure every partition type of a job",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("job", metavar="JOB.yaml", help="KareusJob manifest")
    parser.add_argument("--out", required=True, metavar="PROFILE.json", help="where to write the profile document")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="sim (simulated GPU), nvml (real GPUs) or auto; default: spec.profiling.backend")
    parser.add_argument("--require-gpu", action="store_true",
                        help="with --backend auto, fail (exit 78) instead of simulating when no GPU is visible "
                             "(what the operator's profiling pods do: a simulated profile must never pass for a "
                             "real GPU's)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="search preset; default: spec.profiling.preset")
    parser.add_argument("--store", metavar="DIR", default=None, help="measurement log directory (resumable)")
    parser.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    parser.add_argument("--noise", type=float, default=0.0, metavar="STD",
                        help="relative measurement noise of the simulated GPU (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    paramsfile.add_argument(parser)
    parser.add_argument("--daemon-address", metavar="HOST:PORT", default=os.environ.get("KAREUS_DAEMON_ADDRESS"),
                        help="node daemon TCP address for clock locks, authenticated with the token in "
                             "KAREUS_DAEMON_TOKEN_FILE (env KAREUS_DAEMON_ADDRESS)")
    parser.add_argument("--daemon-socket", default=os.environ.get("KAREUS_DAEMON_SOCKET"),
                        help="node daemon Unix socket for clock locks (env KAREUS_DAEMON_SOCKET)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.noise < 0:
        raise KareusError(f"--noise: must be >= 0, got {args.noise}")
    job = load_job(args.job)
    profiling = job.spec.profiling
    backend = args.backend or profiling.backend
    preset = args.preset or profiling.preset
    if args.sim_params:
        if backend != "sim":
            raise KareusError(f"--sim-params: only the simulated GPU takes simulator parameters (--backend sim), "
                              f"got --backend {backend}")
        from kareus.profiler.backends import SimBackend

        backend = SimBackend(job.spec.gpu_product, noise_std=args.noise, seed=args.seed,
                             calibration=paramsfile.load(args.sim_params))
    console = Console(stderr=True)
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("HV {task.fields[hv]:.3f}"), TimeRemainingColumn(),
                  console=console, disable=args.quiet or not console.is_terminal) as bar:
        task = bar.add_task("profiling", total=None, hv=0.0)

        def show(progress: ProfileProgress) -> None:
            bar.update(task, completed=progress.evaluations, total=progress.planned, hv=progress.hypervolume,
                       description=f"{progress.partition} ({progress.types_done + 1}/{progress.types_total})")

        document = profile_job(job, backend=backend, preset=preset, seed=args.seed, store_path=args.store,
                               progress=show, noise_std=args.noise, require_gpu=args.require_gpu,
                               daemon_endpoint=daemon_endpoint(args.daemon_socket, args.daemon_address))
    document.save(args.out)
    elapsed = time.perf_counter() - started
    grid = sum(p.grid_size for p in document.partitions.values())
    print(f"profile {document.key}: {len(document.partitions)} partition types, {document.evaluations} of "
          f"{grid} candidates measured, {len(document.clocks_mhz)} clocks, {elapsed:.1f} s → {args.out}",
          file=sys.stdout)
    return 0
