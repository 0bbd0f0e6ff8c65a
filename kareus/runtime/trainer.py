"""Training: configuration, one rank's loop, and `train(job, plan)` for whole jobs.

`TrainConfig` is everything a run needs besides the schedule (model shape, layout, batch, steps,
optimizer, data, outputs). `run_rank(ctx, config, schedule)` is one process's loop: build its
stage's parameters, follow its stage of the schedule every iteration, synchronise gradients over
data parallelism (and tied embeddings across the pipeline ends), step the optimizer, account
energy, write `train.jsonl` (rank 0) and serve metrics. `train(job, plan, ...)` runs a job from its
`KareusJob` spec and an optional plan: in-process under `torchrun` (or for one process), or by
spawning the job's processes on this machine (CPU, gloo).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from kareus.daemon_client import ClockClient, DaemonConnection, DaemonError, connect
from kareus.errors import KareusError
from kareus.runtime.comm import GroupComm, nccl_groups_by_sms
from kareus.runtime.data import Batcher, load_tokens
from kareus.runtime.energy import MeasuredEnergy, SimulatedEnergy
from kareus.runtime.follower import ClockRequest, PlanFollower
from kareus.runtime.metrics import JsonlWriter, MetricsExporter, StepRecord
from kareus.runtime.model import StageLayout, StageModel
from kareus.runtime.parallel import DistContext, Layout, NodeGroup, init_distributed, shutdown, spawn_local
from kareus.runtime.pipeline import StageExecutor
from kareus.runtime.schedule import Schedule
from kareus.workload.models import ModelShape
from kareus.workload.partitions import build_workload, split_layers

log = logging.getLogger("kareus.runtime")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """One training run; sizes as in the job spec."""

    shape: ModelShape
    seq_len: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch_size: int = 2
    num_microbatches: int = 1
    activation_checkpointing: bool = True
    steps: int = 10
    seed: int = 0
    lr: float = 3e-3
    optimizer: str = "adamw"
    gpu_product: str = "A100-SXM4-40GB"
    stage_layers: tuple[int, ...] | None = None
    data_path: str | None = None
    out_dir: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    daemon_socket: str | None = None
    job_name: str = ""
    plan_labels: dict[str, str] = field(default_factory=dict)
    device: str = "auto"
    dtype: str = "float32"
    comm_standin: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise KareusError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise KareusError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("seq_len", "tp", "pp", "dp", "cp", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise KareusError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len % self.cp:
            raise KareusError(f"spec.sequenceLength {self.seq_len} must be divisible by context parallelism {self.cp}")
        if self.steps < 0:
            raise KareusError(f"steps must be >= 0, got {self.steps}")

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.cp)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return self.stage_layers or split_layers(self.shape.num_layers, self.pp)

    @classmethod
    def from_job(cls, spec, **overrides) -> TrainConfig:
        """From a `kareus.spec.JobSpec` (or a `KareusJob`, whose `.spec` is used)."""
        spec = getattr(spec, "spec", spec)
        par = spec.parallelism
        base = cls(shape=spec.model_shape(), seq_len=spec.sequence_length, tp=par.tensor, pp=par.pipeline,
                   dp=par.data, cp=par.context, micro_batch_size=par.micro_batch_size, num_microbatches=par.num_micro_batches,
                   activation_checkpointing=par.activation_checkpointing, steps=spec.training.steps,
                   gpu_product=spec.gpu_product)
        return replace(base, **overrides)


@dataclass(frozen=True)
class TrainResult:
    """What a run did, from rank 0's point of view (losses and energies are whole-job)."""

    losses: tuple[float, ...]
    iteration_time_s: tuple[float, ...]
    energy_j: tuple[float, ...]
    tokens_per_step: int
    energy_source: str
    modelled_time_s: float | None
    clock_log: tuple[ClockRequest, ...]
    out_dir: str | None = None
    metrics_port: int | None = None


def run_rank(ctx: DistContext, config: TrainConfig, schedule: Schedule, *,
             clock: ClockClient | None = None, keep_model: bool = False) -> tuple[TrainResult, StageModel | None]:
    """Train on this rank; the process group (if any) is already set up in `ctx`."""
    _check(config, schedule)
    torch.manual_seed(config.seed)
    cuda = ctx.device.type == "cuda"
    layout = StageLayout.of(ctx.pp_rank, config.layers_per_stage)
    model = StageModel(config.shape, layout, tp=config.tp, tp_rank=ctx.tp_rank, seed=config.seed,
                       device=ctx.device, dtype=DTYPES[config.dtype])
    tp, cp = _comms(ctx, config, schedule, cuda)
    meter = _nvml_meter(ctx) if cuda else None
    if clock is None:
        clock = connect(config.daemon_socket, _my_gpus(config.daemon_socket, meter), job=config.job_name or None)
    follower = PlanFollower(schedule.stages[ctx.pp_rank], stage=ctx.pp_rank, clock=clock)
    executor = StageExecutor(model, ctx, tp, follower, config.seq_len, config.micro_batch_size,
                             config.activation_checkpointing, cp)
    batcher = Batcher(load_tokens(config.data_path, config.shape.vocab_size), config.seq_len,
                      config.micro_batch_size, config.num_microbatches, config.dp, config.seed)
    simulated = None if meter else _simulated_energy(config, schedule)
    source = "nvml" if meter else "simulated"
    optimizer = _optimizer(config, model)
    outputs = _Outputs(ctx, config, schedule)
    records: list[StepRecord] = []
    if meter:
        meter.lap_j()  # count from the first step, not from start-up
    try:
        for step in range(config.steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batches = [_my_chunk(x, y, ctx.cp_rank, config.cp)
                       for x, y in batcher.microbatches(step, ctx.dp_rank, ctx.device)]
            local_loss = executor.run(batches, 1.0 / batcher.tokens_per_step, step)
            _sync_gradients(ctx, model)
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            gpu_j = meter.lap_j() if meter else simulated.stage_gpu_energy_j[ctx.pp_rank]
            loss, elapsed, job_j = _reduce_step(ctx, local_loss, elapsed, gpu_j)
            record = StepRecord(step, loss, elapsed, job_j, batcher.tokens_per_step,
                                batcher.tokens_per_step / job_j if job_j > 0 else 0.0,
                                simulated.time_s if simulated else None, source, outputs.clock_summary)
            outputs.write(record, gpu_j)
            records.append(record)
    finally:
        outputs.close()
        clock.close()
    result = TrainResult(tuple(r.loss for r in records), tuple(r.iteration_time_s for r in records),
                         tuple(r.energy_j for r in records), batcher.tokens_per_step, source,
                         simulated.time_s if simulated else None, tuple(follower.log), config.out_dir,
                         outputs.metrics_port)
    return result, (model if keep_model else None)


def _comms(ctx: DistContext, config: TrainConfig, schedule: Schedule, cuda: bool) -> tuple[GroupComm, GroupComm]:
    """The TP and CP collectives; on CUDA they share one comm stream and get one communicator per
    SM count the schedule uses. The one-GPU stand-in replaces the TP all-reduce."""
    stream = torch.cuda.Stream() if cuda else None
    sms = schedule.comm_sms_in_use()

    def comm(size: int, group, all_ranks, my_ranks, standin: bool) -> GroupComm:
        by_sms = nccl_groups_by_sms(all_ranks, my_ranks, sms) if cuda and size > 1 else {}
        return GroupComm(group, size, cuda=cuda, standin=standin, groups_by_sms=by_sms, stream=stream)

    return (comm(config.tp, ctx.tp_group, config.layout.tp_groups(), ctx.tp_ranks, config.comm_standin),
            comm(config.cp, ctx.cp_group, config.layout.cp_groups(), ctx.cp_ranks, False))


def _my_chunk(tokens: torch.Tensor, targets: torch.Tensor, cp_rank: int, cp: int):
    """This context-parallel rank's contiguous chunk of every sequence."""
    chunk = tokens.shape[1] // cp
    rows = slice(cp_rank * chunk, (cp_rank + 1) * chunk)
    return tokens[:, rows], targets[:, rows]


def _check(config: TrainConfig, schedule: Schedule) -> None:
    if schedule.num_stages != config.pp:
        raise KareusError(f"the schedule has {schedule.num_stages} stages, spec.parallelism.pipeline is {config.pp}")
    if schedule.num_microbatches != config.num_microbatches:
        raise KareusError(f"the schedule has {schedule.num_microbatches} microbatches per stage, "
                          f"spec.parallelism.numMicroBatches is {config.num_microbatches}")
    partitioned = any(i.mode == "partitioned" for stage in schedule.stages for i in stage)
    if partitioned and config.micro_batch_size % 2:
        raise KareusError(f"spec.parallelism.microBatchSize must be even for partitioned (nanobatched) "
                          f"execution, got {config.micro_batch_size}; or use --schedule sequential")


def _my_gpus(socket_path: str | None, meter: MeasuredEnergy | None) -> list[str] | None:
    """The GPU whose clock this rank controls: its CUDA device; on a CPU run (simulated GPUs behind
    the daemon) the daemon's controllable GPU number LOCAL_RANK, so ranks never fight over a clock."""
    if meter is not None:
        return [meter.uuid]
    if not socket_path:
        return None
    try:
        with DaemonConnection(socket_path) as daemon:
            controllable = [gpu.uuid for gpu in daemon.discover() if gpu.controllable]
    except DaemonError:
        return None  # `connect` reports the same problem and degrades to no clock control
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return [controllable[local_rank % len(controllable)]] if controllable else None


def _nvml_meter(ctx: DistContext) -> MeasuredEnergy | None:
    """This GPU's NVML energy counter; None (simulated accounting, with a warning) without NVML."""
    try:
        return MeasuredEnergy(ctx.device.index or 0)
    except KareusError as error:
        log.warning("no NVML energy counter (%s); accounting energy on the simulated GPU", error)
        return None


def _simulated_energy(config: TrainConfig, schedule: Schedule):
    mbs = config.micro_batch_size + config.micro_batch_size % 2  # the workload counts nanobatch pairs
    workload = build_workload(config.shape, tp=config.tp, cp=config.cp, pp=config.pp, seq_len=config.seq_len,
                              micro_batch_size=mbs, activation_checkpointing=config.activation_checkpointing,
                              stage_layers=config.layers_per_stage)
    return SimulatedEnergy(workload, config.gpu_product, schedule, config.tp * config.cp * config.dp).result


def _optimizer(config: TrainConfig, model: StageModel) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr)
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)


def _sync_gradients(ctx: DistContext, model: StageModel) -> None:
    """Sum gradients over the data- and context-parallel replicas (one flat buffer) and tied
    embeddings over the pipeline ends."""
    params = list(model.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if ctx.grad_group is not None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=ctx.grad_group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    if ctx.end_group is not None and model.shape.tied_embeddings:
        dist.all_reduce(model.param("embedding").grad, group=ctx.end_group)


def _reduce_step(ctx: DistContext, local_loss: float, elapsed: float, gpu_j: float) -> tuple[float, float, float]:
    """Whole-job loss (sum of last-stage contributions), time (max over ranks) and energy."""
    counts_loss = ctx.tp_rank == 0
    if not ctx.distributed:
        return local_loss, elapsed, gpu_j
    sums = torch.tensor([local_loss if counts_loss else 0.0, gpu_j], dtype=torch.float64)
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    if ctx.device.type == "cuda":
        sums, slowest = sums.to(ctx.device), slowest.to(ctx.device)
    dist.all_reduce(sums)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(sums[0]), float(slowest[0]), float(sums[1])


class _Outputs:
    """train.jsonl on rank 0 and the rank-local metrics endpoint."""

    def __init__(self, ctx: DistContext, config: TrainConfig, schedule: Schedule) -> None:
        self.writer = JsonlWriter(Path(config.out_dir) / "train.jsonl") if config.out_dir and ctx.rank == 0 else None
        self.exporter = None
        if config.metrics_port is not None:
            port = config.metrics_port + int(os.environ.get("LOCAL_RANK", ctx.rank)) if config.metrics_port else 0
            plan = {"mode": _mode_summary(schedule), **config.plan_labels}
            self.exporter = MetricsExporter(port, addr=config.metrics_addr, rank=ctx.rank, stage=ctx.pp_rank,
                                            job=config.job_name, plan=plan)
        self.metrics_port = self.exporter.port if self.exporter else None
        clocks = [i.clock_mhz for stage in schedule.stages for i in stage if i.clock_mhz]
        self.clock_summary = ({"min": float(min(clocks)), "max": float(max(clocks)),
                               "mean": sum(clocks) / len(clocks)} if clocks else {})

    def write(self, record: StepRecord, gpu_energy_j: float) -> None:
        if self.writer:
            self.writer.write(record)
        if self.exporter:
            self.exporter.observe(record, gpu_energy_j)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.exporter:
            self.exporter.close()


def _mode_summary(schedule: Schedule) -> str:
    modes = {i.mode for stage in schedule.stages for i in stage}
    return modes.pop() if len(modes) == 1 else "mixed"


# whole jobs ----------------------------------------------------------------------------------

def train(job, plan=None, *, schedule_mode: str = "plan", nproc: int | None = None,
          clock: ClockClient | None = None, **overrides) -> TrainResult:
    """Train the job (`KareusJob` or `JobSpec`) following `plan` (a `kareus.plan.Plan` or None).

    `schedule_mode="sequential"` keeps the plan's clocks but runs every microbatch sequentially.
    Without a plan every instruction is partitioned at default configs (unless the job turns
    nanobatching off) at the default clock. `overrides` are `TrainConfig` fields (steps, seed,
    data_path, out_dir, metrics_port, daemon_socket, …). Under torchrun (WORLD_SIZE set) this
    process is one rank; otherwise this node's processes are spawned here: `nproc` per node (default
    all of them), several nodes through NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT as the training
    pods set them.
    """
    config = TrainConfig.from_job(job, **overrides)
    schedule = build_schedule(job, plan, config, schedule_mode)
    world = config.layout.world_size
    if "WORLD_SIZE" in os.environ or (world == 1 and nproc in (None, 1)):
        ctx = init_distributed(config.layout, device=config.device)
        try:
            result, _ = run_rank(ctx, config, schedule, clock=clock)
        finally:
            shutdown()
        return result
    nodes = NodeGroup.from_env()
    per_node = nproc if nproc is not None else world // nodes.nnodes
    if per_node * nodes.nnodes != world:
        raise KareusError(f"--nproc {per_node} × NNODES {nodes.nnodes} = {per_node * nodes.nnodes} processes, "
                          f"but tensor×context×pipeline×data = {world}")
    with tempfile.TemporaryDirectory(prefix="kareus-train-") as tmp:
        device = _spawn_device(config.device, per_node)
        spawn_local(per_node, _spawned_rank, replace(config, device=device), schedule, tmp, nodes=nodes)
        return pickle.loads((Path(tmp) / "result.pkl").read_bytes())


def _spawn_device(device: str, world: int) -> str:
    """Local processes use one GPU each when there are enough, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.device_count() >= world else "cpu"
    if device == "cuda" and torch.cuda.device_count() < world:
        raise KareusError(f"--device cuda: {world} processes need {world} GPUs, "
                          f"{torch.cuda.device_count()} visible")
    return device


def build_schedule(job, plan, config: TrainConfig, schedule_mode: str = "plan") -> Schedule:
    if schedule_mode not in ("plan", "sequential"):
        raise KareusError(f"--schedule must be 'plan' or 'sequential', got {schedule_mode!r}")
    spec = getattr(job, "spec", job)
    if plan is not None:
        _check_plan_matches(plan, config)
        schedule = Schedule.from_plan(plan)
    else:
        nanobatching = getattr(spec.parallelism, "nanobatching", True)
        schedule = Schedule.uniform(config.pp, config.num_microbatches,
                                    mode="partitioned" if nanobatching else "sequential")
    return schedule.as_sequential() if schedule_mode == "sequential" else schedule


def _check_plan_matches(plan, config: TrainConfig) -> None:
    job = plan.job
    mine = (config.tp, config.cp, config.pp, config.dp, config.micro_batch_size, config.num_microbatches,
            config.seq_len)
    theirs = (job.tensor, job.context, job.pipeline, job.data, job.micro_batch_size, job.num_micro_batches,
              job.sequence_length)
    if mine != theirs:
        names = ("tensor", "context", "pipeline", "data", "microBatchSize", "numMicroBatches", "sequenceLength")
        diffs = ", ".join(f"{n}: job {a}, plan {b}" for n, a, b in zip(names, mine, theirs, strict=True) if a != b)
        raise KareusError(f"the plan was made for another layout ({diffs})")


def _spawned_rank(rank: int, store, config: TrainConfig, schedule: Schedule, result_dir: str) -> None:
    ctx = init_distributed(config.layout, rank=rank, store=store, device=config.device)
    result, _ = run_rank(ctx, config, schedule)
    if int(os.environ["LOCAL_RANK"]) == 0:  # the node's first process reports (losses are global)
        (Path(result_dir) / "result.pkl").write_bytes(pickle.dumps(result))
