"""Shared builders for the optimizer and plan tests: small real workloads on the simulated GPU."""

from __future__ import annotations

from functools import cache

from kareus.job import PlanJob
from kareus.optimizer.composition import compose_stages
from kareus.optimizer.frontier import FrontierSettings, iteration_frontier
from kareus.optimizer.sources import SimulatorSource
from kareus.plan import Plan, Provenance, plan_from_frontier
from kareus.sim import Simulator, get_gpu
from kareus.spec import parse_job
from kareus.workload.models import get_preset

GPU = "A100-SXM4-40GB"
CLOCKS_MHZ = (1410, 1230, 1050)


def job_manifest(model: str = "llama3.2-3b", *, tp: int = 8, cp: int = 1, pp: int = 2, mbs: int = 8,
                 seq: int = 4096, microbatches: int = 4, objective: dict | None = None, steps: int = 100) -> dict:
    gpus = tp * cp * pp
    return {
        "apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "opt-test"},
        "spec": {
            "model": {"preset": model}, "sequenceLength": seq,
            "parallelism": {"tensor": tp, "pipeline": pp, "context": cp, "data": 1, "microBatchSize": mbs,
                            "numMicroBatches": microbatches},
            "objective": objective or {"maxThroughput": {}},
            "training": {"image": "kareus:test", "steps": steps, "gpusPerNode": min(gpus, 8),
                         "nodes": max(gpus // 8, 1)},
            "gpu": {"product": GPU},
        },
    }


def job(**kwargs):
    return parse_job(job_manifest(**kwargs))


@cache
def simulator() -> Simulator:
    return Simulator(get_gpu(GPU))


def plan_job(microbatches: int = 4, pp: int = 2, steps: int | None = 100) -> PlanJob:
    shape = get_preset("llama3.2-3b")
    base, extra = divmod(shape.num_layers, pp)
    layers = tuple(base + (1 if s < extra else 0) for s in range(pp))
    return PlanJob(model=shape, gpu=GPU, tensor=8, context=1, pipeline=pp, data=1, micro_batch_size=8,
                   num_micro_batches=microbatches, sequence_length=4096, activation_checkpointing=True,
                   stage_layers=layers, clocks_mhz=CLOCKS_MHZ, p_static_w=simulator().p_static_w, steps=steps)


@cache
def stage_options(pp: int = 2):
    """Exhaustively composed microbatch frontiers at three clocks (real simulator numbers)."""
    pjob = plan_job(pp=pp)
    return compose_stages(pjob.workload(), SimulatorSource(simulator(), pjob.workload(), CLOCKS_MHZ))


@cache
def small_plan(microbatches: int = 4) -> Plan:
    pjob = plan_job(microbatches)
    frontier = iteration_frontier(stage_options(), microbatches, p_static_w=pjob.p_static_w,
                                  gpus_per_stage=pjob.gpus_per_stage, settings=FrontierSettings(target_steps=120))
    return plan_from_frontier(pjob, frontier, {"maxThroughput": {}}, provenance=Provenance(profile_key="test-key"))
