"""From a job and its profile to a plan: compose, solve the iteration frontier, apply the objective.

`optimize(job, profile)` is what `kareus optimize`, the operator's optimizer pod and `kareus run`
call. The plan carries the whole frontier table, so a later objective change is a `reselect`,
not a new optimisation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kareus import __version__
from kareus.errors import KareusError
from kareus.job import PlanJob, describe_job, gpu_label, job_spec_of
from kareus.optimizer.composition import CompositionSettings, compose_stages
from kareus.optimizer.frontier import FrontierSettings, iteration_frontier
from kareus.optimizer.sources import ProfileSource
from kareus.plan import FrontierTable, MethodFrontier, Plan, Provenance, plan_from_frontier
from kareus.profiler.document import ProfileDocument
from kareus.workload.partitions import Workload


def plan_job(job: Any, profile: ProfileDocument) -> PlanJob:
    """What the plan records about the job; the profile must have been measured for it."""
    spec = job_spec_of(job)
    check_profile_matches(spec, profile)
    par = spec.parallelism
    return PlanJob(
        model=spec.model_shape(), gpu=profile.gpu, tensor=par.tensor, context=par.context,
        pipeline=par.pipeline, data=par.data, micro_batch_size=par.micro_batch_size,
        num_micro_batches=par.num_micro_batches, sequence_length=spec.sequence_length,
        activation_checkpointing=bool(par.activation_checkpointing),
        stage_layers=tuple(profile.job.stage_layers), clocks_mhz=tuple(profile.clocks_mhz),
        p_static_w=profile.p_static_w, name=str(getattr(job, "name", "") if job is not spec else ""),
        steps=getattr(getattr(spec, "training", None), "steps", None))


MEASURED_FIELDS = ("model", "tp", "cp", "pp", "seq_len", "micro_batch_size", "activation_checkpointing",
                   "stage_layers")


def check_profile_matches(spec: Any, profile: ProfileDocument) -> None:
    """A profile measured for another layout or GPU cannot plan this job: say what differs.

    Microbatch count and data parallelism change the pipeline DAG and the GPU count, not what a
    GPU measures, so they may differ.
    """
    expected = describe_job(spec)
    for name in MEASURED_FIELDS:
        want, got = getattr(expected, name), getattr(profile.job, name)
        if want != got:
            raise KareusError(f"profile {profile.key} was measured for {name}={got!r}, but the job has "
                              f"{name}={want!r}: profile this job first")
    if gpu_label(str(spec.gpu_product)) != gpu_label(profile.gpu):
        raise KareusError(f"profile {profile.key} was measured on {profile.gpu}, but the job asks for "
                          f"{spec.gpu_product}: profile this job first")


def kareus_frontier(workload: Workload, profile: ProfileDocument, num_microbatches: int, gpus_per_stage: int,
                    settings: FrontierSettings = FrontierSettings()) -> FrontierTable:
    """Kareus' iteration frontier from the profile's measured partition frontiers."""
    options = compose_stages(workload, ProfileSource(profile), CompositionSettings())
    return iteration_frontier(options, num_microbatches, p_static_w=profile.p_static_w,
                              gpus_per_stage=gpus_per_stage, settings=settings)


def optimize(job: Any, profile: ProfileDocument, *, objective: Any = None,
             settings: FrontierSettings = FrontierSettings(),
             baselines: Mapping[str, MethodFrontier] | None = None,
             now: datetime | None = None) -> Plan:
    """The Kareus plan for `job` (a `KareusJob` or `JobSpec`) under its objective (or `objective`).

    Raises `KareusError` when the profile does not fit the job or the objective cannot be met
    (naming the closest feasible plan).
    """
    spec = job_spec_of(job)
    pjob = plan_job(job, profile)
    started = time.perf_counter()
    frontier = kareus_frontier(pjob.workload(), profile, pjob.num_micro_batches, pjob.gpus_per_stage, settings)
    provenance = solver_provenance(profile, pjob, settings, frontier, time.perf_counter() - started)
    chosen = objective if objective is not None else spec.objective
    return plan_from_frontier(pjob, frontier, chosen, provenance=provenance, baselines=baselines, now=now)


def solver_provenance(profile: ProfileDocument, pjob: PlanJob, settings: FrontierSettings,
                      frontier: FrontierTable, wall_s: float) -> Provenance:
    """Where a Kareus plan came from: the profile key and the solver's settings and cost."""
    solved_microbatches = settings.microbatches_for(pjob.pipeline, pjob.num_micro_batches)
    solved = 2 * pjob.pipeline * solved_microbatches  # instructions in the DAG the solver ran on
    return Provenance(
        profile_key=profile.key, method="kareus",
        solver={"algorithm": "phillips-dessouky (lowtime)", "cost_models": list(settings.models_for(solved)),
                "target_steps": settings.steps_for(solved), "solve_microbatches": solved_microbatches,
                "max_rows": settings.max_rows, "rows": len(frontier.rows), "wall_s": round(wall_s, 3)},
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), software_version=__version__)
