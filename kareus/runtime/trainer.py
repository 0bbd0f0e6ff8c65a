"""Training: configuration, one rank's loop, and `train(job, plan)` for whole jobs.

`TrainConfig` is everything a run needs besides the schedule (model shape, layout, batch, steps,
optimizer, data, outputs). `run_rank(ctx, config, schedule)` is one process's loop: build its
stage's parameters, follow its stage of the schedule every iteration, synchronise gradients over
data parallelism (and tied embeddings across the pipeline ends), clip them by the global norm and
step the optimizer at the schedule's rate (`OptimizerRecipe`; in bf16 on fp32 masters), account
energy, write `train.jsonl` (rank 0) and serve metrics. `train(job, plan, ...)` runs a job from its
`KareusJob` spec and an optional plan: in-process under `torchrun` (or for one process), or by
spawning the job's processes on this machine (CPU, gloo).

With `plan_path` the plan file is watched: a changed plan (the operator re-selected one for a new
objective) takes effect on every rank at the same step boundary, or is rejected with one log line
(`kareus.runtime.reload`). Every step records which plan revision ran and whether this job's clock
control works (`clock_control`: active, none, degraded — the operator's ClockControlDegraded).

With data parallelism the replicas share their iteration times every step; when one is slower for
a few steps the others re-select a cheaper frontier point of the same plan, and return when it
recovers (`kareus.runtime.straggler`, `kareus.straggler`); train.jsonl records each such revision
with its reason.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from kareus.daemon_client import ClockClient, DaemonError, NullClockClient, connect, open_connection
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.gpu.pairing import EnergyAttributionError
from kareus.plan import plan_at_row
from kareus.runtime import stopping
from kareus.runtime.checkpoint import (
    Checkpointer,
    CheckpointSettings,
    Identity,
    Resumed,
    TrainState,
    complete_checkpoints,
)
from kareus.runtime.clocking import CudaProgress, HostProgress
from kareus.runtime.comm import GroupComm, comm_stream, nccl_groups_by_sms
from kareus.runtime.data import Batcher, TokenData, builtin_corpus_allowed, load_data
from kareus.runtime.energy import MeasuredEnergy, SimulatedEnergy, TwinEnergy
from kareus.runtime.follower import ClockRequest, PlanFollower
from kareus.runtime.grad_norm import clip_, counted_here, global_grad_norm
from kareus.runtime.gradsync import all_reduce_bucketed
from kareus.runtime.init_from import InitSource, check_source, stage_params
from kareus.runtime.metrics import JsonlWriter, MetricsExporter, StepRecord
from kareus.runtime.model import StageLayout, StageModel
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import DistContext, Layout, NodeGroup, init_distributed, shutdown, spawn_local
from kareus.runtime.pipeline import StageExecutor, checkpointing_mode
from kareus.runtime.precision import MasterParams
from kareus.runtime.reload import PlanRollout, broadcast_bytes
from kareus.runtime.schedule import Schedule
from kareus.runtime.straggler import SIM_STRAGGLER_ENV, BusyTimer, SimStraggler, StragglerRuntime
from kareus.straggler import Decision, StragglerPolicy
from kareus.workload.models import ModelShape
from kareus.workload.partitions import build_workload, split_layers

log = logging.getLogger("kareus.runtime")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # spec.training.precision -> TrainConfig.dtype


@dataclass(frozen=True)
class TrainedModel:
    """What a run's processes train: the job's model, or on CPU its proxy (`spec.training.cpuProxy`)."""

    shape: ModelShape
    seq_len: int
    layers_per_stage: tuple[int, ...]
    proxy: bool = False


@dataclass(frozen=True)
class TrainConfig:
    """One training run; sizes as in the job spec.

    `shape`, `seq_len` and the stage split are the job's model: what the plan was made for and what
    the simulated GPU accounts time and energy for. `cpu_proxy` (shape, sequence length) is what
    the processes train instead when they run on CPU (`trained_model`)."""

    shape: ModelShape
    seq_len: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch_size: int = 2
    num_microbatches: int = 1
    # True/False are "layer"/"none"; "stage" (the whole stage recomputed) stays selectable for comparison.
    activation_checkpointing: bool | str = True
    steps: int = 10
    seed: int = 0
    # Optimizer, schedule, weight decay, clipping (`spec.training.optimizer`); its open values
    # (peak lr, warmup, decay steps) are resolved for this run's model and steps.
    recipe: OptimizerRecipe = field(default_factory=OptimizerRecipe)
    gpu_product: str = "A100-SXM4-40GB"
    stage_layers: tuple[int, ...] | None = None
    data_path: str | None = None
    data_format: str | None = None  # npy | bin | megatron | bytes; None: from the file's name
    data_dtype: str | None = None  # a `bin` file's token type; None: uint16 when the vocabulary fits, else uint32
    checkpoint_dir: str | None = None  # resume from the newest usable checkpoint here, save into it
    checkpoint_every: int = 0  # steps between checkpoints (0: only when a SIGTERM stops the run)
    checkpoint_keep: int = 2
    # After the final step: a checkpoint of it, exported by rank 0 as a Hugging Face directory here
    # (`kareus.runtime.export`); needs checkpoint_dir, since the export reads the checkpoint.
    export_dir: str | None = None
    out_dir: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    daemon_socket: str | None = None
    job_name: str = ""
    plan_labels: dict[str, str] = field(default_factory=dict)
    device: str = "auto"
    dtype: str = "float32"  # bfloat16: bf16 compute, fp32 master weights, gradients and optimizer state
    tf32: bool = True  # TF32 tensor cores for fp32 matmuls and convolutions on CUDA
    comm_standin: bool = False
    plan_path: str | None = None  # watched for a new plan at every step boundary
    plan_digest: str | None = None  # SHA-256 of the plan file's bytes the run started with
    schedule_mode: str = "plan"  # "sequential": every plan (also a rolled-out one) runs un-nanobatched
    clock_lead_s: float = 0.005  # a clock request goes out this long before the GPU's instruction boundary
    # Straggler-aware re-selection (data parallelism): threshold, patience and recovery of `kareus.straggler`.
    straggler_reselect: bool = True
    straggler_threshold: float = 0.05
    straggler_patience_steps: int = 3
    straggler_recovery_steps: int = 3
    # Test/demo knob: one simulated replica slower (`REPLICA:SLOWDOWN[@FIRST-END]`, runtime.straggler).
    sim_straggler: str | None = field(default_factory=lambda: os.environ.get(SIM_STRAGGLER_ENV) or None)
    cpu_proxy: tuple[ModelShape, int] | None = None  # trained on CPU instead of (shape, seq_len)
    sim_params: str | None = None  # `kareus sim calibrate` file for the simulated GPU's accounting
    # Starting weights: a Hugging Face model directory or a Kareus checkpoint (`kareus.runtime.init_from`);
    # ignored when --checkpoint-dir already holds a checkpoint of this run (it wins).
    init_from: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, OptimizerRecipe):
            raise KareusError(f"recipe must be an OptimizerRecipe, got {type(self.recipe).__name__}")
        if self.dtype not in DTYPES:
            raise KareusError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("seq_len", "tp", "pp", "dp", "cp", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise KareusError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len % self.cp:
            raise KareusError(f"spec.sequenceLength {self.seq_len} must be divisible by context parallelism {self.cp}")
        if self.steps < 0:
            raise KareusError(f"steps must be >= 0, got {self.steps}")
        if self.export_dir and not self.checkpoint_dir:
            raise KareusError("--export-dir needs --checkpoint-dir: the export is written from the final step's "
                              "checkpoint", exit_code=EXIT_CONFIG)
        if self.clock_lead_s < 0:
            raise KareusError(f"clock_lead_s must be >= 0, got {self.clock_lead_s}")
        checkpointing_mode(self.activation_checkpointing)
        self.straggler_policy  # noqa: B018 — validates the straggler settings
        self.checkpoint_settings  # noqa: B018 — validates the checkpoint settings
        SimStraggler.parse(self.sim_straggler)

    @property
    def straggler_policy(self) -> StragglerPolicy:
        return StragglerPolicy(self.straggler_threshold, self.straggler_patience_steps, self.straggler_recovery_steps)

    @property
    def checkpoint_settings(self) -> CheckpointSettings | None:
        if self.checkpoint_dir is None:
            if self.checkpoint_every:
                raise KareusError("--checkpoint-every needs --checkpoint-dir")
            return None
        return CheckpointSettings(self.checkpoint_dir, self.checkpoint_every, self.checkpoint_keep)

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.cp)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return self.stage_layers or split_layers(self.shape.num_layers, self.pp)

    def trained_model(self, cuda: bool) -> TrainedModel:
        """The job's model on a GPU; on CPU its proxy when the job has one (same layout and
        schedule, the job's model still what time and energy are accounted for)."""
        if cuda or self.cpu_proxy is None:
            return TrainedModel(self.shape, self.seq_len, self.layers_per_stage)
        shape, seq_len = self.cpu_proxy
        return TrainedModel(shape, seq_len, split_layers(shape.num_layers, self.pp), proxy=True)

    @classmethod
    def from_job(cls, spec, **overrides) -> TrainConfig:
        """From a `kareus.spec.JobSpec` (or a `KareusJob`, whose `.spec` is used)."""
        spec = getattr(spec, "spec", spec)
        par = spec.parallelism
        base = cls(shape=spec.model_shape(), seq_len=spec.sequence_length, tp=par.tensor, pp=par.pipeline,
                   dp=par.data, cp=par.context, micro_batch_size=par.micro_batch_size, num_microbatches=par.num_micro_batches,
                   activation_checkpointing=par.activation_checkpointing, steps=spec.training.steps,
                   gpu_product=spec.gpu_product, cpu_proxy=_cpu_proxy(spec), **_recipe_fields(spec.training))
        return replace(base, **overrides)


def _recipe_fields(training) -> dict:
    """The optimizer recipe, precision and TF32 switch of `spec.training`."""
    out: dict = {"recipe": OptimizerRecipe.from_spec(training.optimizer)}
    if training.precision is not None:
        out["dtype"] = PRECISIONS[training.precision]
    if training.tf32 is not None:
        out["tf32"] = training.tf32
    return out


def _cpu_proxy(spec) -> tuple[ModelShape, int] | None:
    shape = spec.cpu_proxy_shape()
    return None if shape is None else (shape, spec.cpu_proxy_sequence_length)


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
    plan_revisions: tuple[int, ...] = ()  # per step: 0 the starting plan, +1 at every roll-out or re-selection
    clock_control: tuple[str, ...] = ()  # per step: active | none | degraded (any rank)
    frontier_rows: tuple[int | None, ...] = ()  # per step: the frontier row this rank's replica ran
    straggler_decisions: tuple[Decision, ...] = ()  # the re-selections, as every rank decided them
    cpu_proxy: bool = False  # the processes trained spec.training.cpuProxy (a CPU run), not the job's model
    stopped_early: bool = False  # a SIGTERM stopped every rank after the last step here
    first_step: int = 0  # the step this run started at: the resumed checkpoint's, else 0
    checkpoint_step: int | None = None  # steps completed in the last checkpoint this run saved
    grad_norms: tuple[float, ...] = ()  # per step: the global gradient norm before clipping
    lrs: tuple[float, ...] = ()  # per step: the learning rate of its optimizer step
    exported: str | None = None  # the Hugging Face export of the final step (export_dir), once it is there


def run_rank(ctx: DistContext, config: TrainConfig, schedule: Schedule, *,
             clock: ClockClient | None = None, keep_model: bool = False, plan=None,
             step_hook: Callable[[int], None] | None = None) -> tuple[TrainResult, StageModel | None]:
    """Train on this rank; the process group (if any) is already set up in `ctx`.

    `plan` is the `kareus.plan.Plan` the schedule came from (its predictions go into train.jsonl);
    with `config.plan_path` the file is checked for a new plan before every step. `step_hook(step)`
    runs on every rank at each step boundary before that check (tests use it to swap the file).
    """
    _check(config, schedule)
    torch.manual_seed(config.seed)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = config.tf32
        torch.backends.cudnn.allow_tf32 = config.tf32
    trained = config.trained_model(cuda)
    # Before any weight is built: a real model's refusal should not wait for its parameters.
    if config.data_path is None and not builtin_corpus_allowed(trained.shape.vocab_size, trained.proxy):
        raise KareusError(f"model {trained.shape.name} (vocabulary {trained.shape.vocab_size}) has no training data: "
                          "give --data (spec.training.data in a KareusJob), e.g. a `kareus data prepare` dataset; "
                          "the built-in byte-level corpus is only for a byte-level model (vocabulary 256, the tiny "
                          "preset) or a CPU proxy", exit_code=EXIT_CONFIG)
    if trained.proxy and ctx.rank == 0:
        log.info("training the CPU proxy %s (hidden %d, %d layers, %d tokens per sequence); time and energy are "
                 "%s's on the simulated %s", trained.shape.name, trained.shape.hidden_size, trained.shape.num_layers,
                 trained.seq_len, config.shape.name, config.gpu_product)
    layout = StageLayout.of(ctx.pp_rank, trained.layers_per_stage)
    source = _init_source(config, trained, ctx.rank)
    pretrained = stage_params(source, trained.shape, layout, config.tp, ctx.tp_rank) if source else None
    model = StageModel(trained.shape, layout, tp=config.tp, tp_rank=ctx.tp_rank, seed=config.seed,
                       device=ctx.device, dtype=DTYPES[config.dtype], params=pretrained)
    tp, cp = _comms(ctx, config, schedule, cuda)
    meter = _nvml_meter(ctx) if cuda else None
    # On CPU, the node's simulated GPU when it is a shared device (dev cluster): the agent reads it too.
    twin = TwinEnergy.from_env(config.gpu_product) if meter is None else None
    if clock is None:
        clock = connect(config.daemon_socket, _my_gpus(config.daemon_socket, meter), job=config.job_name or None)
    progress = CudaProgress() if cuda else HostProgress()
    power_limit_w = _follow_power_limit(clock, plan, None)  # close() gives the default back, whatever ends the run
    follower = PlanFollower(schedule.stages[ctx.pp_rank], stage=ctx.pp_rank, clock=clock, progress=progress,
                            lead_s=config.clock_lead_s)
    executor = StageExecutor(model, ctx, tp, follower, trained.seq_len, config.micro_batch_size,
                             config.activation_checkpointing, cp)
    data = load_data(config.data_path, trained.shape.vocab_size, config.data_format, config.data_dtype)
    if ctx.rank == 0:
        log.info("data: %s (%s, %d tokens%s)", data.source, data.format, data.tokens.size,
                 f", tokenizer {data.tokenizer['name']} of vocabulary {data.tokenizer['vocab_size']}"
                 if data.tokenizer else "")
    batcher = Batcher(data.tokens, trained.seq_len, config.micro_batch_size, config.num_microbatches, config.dp,
                      config.seed, data.order)
    # Tokens per step of the job's model: what its (simulated or measured) energy is spent on.
    tokens_per_step = batcher.global_batch_size * config.seq_len
    source = "nvml" if meter else "simulated"
    knob = SimStraggler.parse(config.sim_straggler) if not meter else None
    running = _Running(config, schedule, plan, simulate=meter is None, slowdown=knob.slowdown if knob else 0.0)
    straggle = StragglerRuntime(ctx, dp=config.dp, plan=plan, policy=config.straggler_policy,
                                enabled=config.straggler_reselect, knob=knob)
    timer = BusyTimer(cuda)
    decisions: list[Decision] = []
    rollout = _rollout(ctx, config, executor) if config.plan_path else None
    running.digest = config.plan_digest or (rollout.digest if rollout else None)
    masters = MasterParams(model.named_model_params())
    lr_at = config.recipe.schedule(config.steps, trained.shape)
    optimizer = config.recipe.build(masters.masters, lr_at(0))
    norm_counted = {name: counted_here(name, p, trained.shape, tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank,
                                       dp_rank=ctx.dp_rank, cp_rank=ctx.cp_rank)
                    for name, p in masters.masters.items()}
    # Checkpoints hold the fp32 masters (in bf16 too), so a resumed run steps exactly the same weights.
    state = TrainState(masters.masters, optimizer, ctx.tp_rank, config.tp, ctx.rank)
    checkpointer = _checkpointer(ctx, config, trained, data)
    resumed = checkpointer.resume(state, config.steps) if checkpointer else None
    first_step = resumed.step if resumed else 0
    if resumed:
        masters.to_model()
        running.resumed(ctx, resumed)
    outputs = _Outputs(ctx, config, schedule)
    records: list[StepRecord] = []
    stopped_early = False
    signalled = False  # every rank agreed to stop after a step (SIGTERM), the final one included
    saved_step: int | None = None

    def save(steps_done: int, reason: str) -> None:
        nonlocal saved_step
        checkpointer.save(state, steps_done, plan_revision=running.revision, plan_digest=running.digest,
                          reason=reason)
        saved_step = steps_done

    if meter:
        meter.lap_j()  # count from the first step, not from start-up
    try:
        for step in range(first_step, config.steps):
            if step_hook is not None:
                step_hook(step)
            if rollout is not None and (new := rollout.check(step)) is not None:
                running.switch(ctx, step, new.plan, new.built, new.digest, executor, outputs, (tp, cp))
                straggle.rolled_out(new.plan)
                power_limit_w = _follow_power_limit(clock, running.plan, power_limit_w)
            simulated = running.simulated(straggle.slowed(step), _power_limit_in_force(twin, running.plan))
            start = time.perf_counter()
            timer.start()
            masters.zero_grad()
            batches = [_my_chunk(x, y, ctx.cp_rank, config.cp)
                       for x, y in batcher.microbatches(step, ctx.dp_rank, ctx.device)]
            local_loss = executor.run(batches, 1.0 / batcher.tokens_per_step, step)
            timer.stop()
            grads = masters.grads()
            _sync_gradients(ctx, model, grads)
            grad_norm = global_grad_norm(grads, norm_counted, distributed=ctx.distributed)
            clip_(grads, grad_norm, config.recipe.clip_grad_norm)
            lr = lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            masters.to_model()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            # The replicas' own times (before the gradient all-reduce made them wait for each other).
            replica_s = straggle.replica_times(simulated.time_s if simulated else timer.seconds()) \
                if straggle.exchanges else None
            modelled_s = (max(replica_s) if replica_s else simulated.time_s) if simulated else None
            gpu_j = meter.lap_j() if meter else simulated.stage_gpu_energy_j(modelled_s)[ctx.pp_rank]
            if twin is not None:  # onto the GPU's counter, and read back from it as from NVML's
                elapsed, gpu_j = twin.run_step(start, gpu_j, modelled_s)
            loss, elapsed, job_j, control = _reduce_step(ctx, local_loss, elapsed, gpu_j, clock)
            rows_ran = straggle.rows
            decision = straggle.observe(step, replica_s) if replica_s is not None else None
            record = StepRecord(step, loss, elapsed, job_j, tokens_per_step,
                                tokens_per_step / job_j if job_j > 0 else 0.0,
                                modelled_s, source, outputs.clock_summary, *running.record_fields(), *control,
                                **running.straggler_fields(straggle, rows_ran, replica_s), grad_norm=grad_norm, lr=lr,
                                data_source=data.source if not records else None)
            outputs.write(record, gpu_j)
            records.append(record)
            if decision is not None:  # every rank decided the same: the replicas switch before the next step
                running.reselect(ctx, decision, executor, outputs, (tp, cp))
                decisions.append(decision)
            if stopping.stop_now(distributed=ctx.distributed):
                # One write with its newline: the ranks share the pod's stderr, and print's two writes interleave.
                sys.stderr.write(f"rank {ctx.rank}: stopping after step {step} of {config.steps} (SIGTERM)\n")
                sys.stderr.flush()
                signalled = True
                stopped_early = step + 1 < config.steps
                if checkpointer and stopped_early:  # within the pod's grace period: the work so far is kept
                    save(step + 1, "sigterm")
                break
            if checkpointer and checkpointer.settings.due(step + 1):
                save(step + 1, "periodic")
    finally:
        outputs.close()
        follower.close()
        clock.close()
    exported = None
    if config.export_dir and not stopped_early:
        if saved_step != config.steps and not (resumed and resumed.step == config.steps):
            save(config.steps, "sigterm" if signalled else "final")
        if signalled:
            # The pod is being stopped: its grace period is for the checkpoint, not an export of the whole
            # model. The next run resumes at the final step and exports; exit as stopped, so it is retried.
            stopped_early = True
            if ctx.rank == 0:
                log.info("export to %s left to the next run: stopped by SIGTERM after the final step", config.export_dir)
        elif ctx.rank == 0:
            exported = str(export_final(config.checkpoint_dir, config.export_dir, config.steps))
    result = TrainResult(tuple(r.loss for r in records), tuple(r.iteration_time_s for r in records),
                         tuple(r.energy_j for r in records), tokens_per_step, source,
                         records[-1].modelled_time_s if records else None, tuple(follower.log), config.out_dir,
                         outputs.metrics_port, tuple(r.plan_revision for r in records),
                         tuple(r.clock_control for r in records), tuple(running.rows_run),
                         tuple(decisions), trained.proxy, stopped_early, first_step, saved_step,
                         tuple(r.grad_norm for r in records), tuple(r.lr for r in records), exported)
    return result, (model if keep_model else None)


def _init_source(config: TrainConfig, trained: TrainedModel, rank: int) -> InitSource | None:
    """Where this run's starting weights come from (None: the seeded random initialisation).
    The source's shape is checked against the trained model before any weight is read."""
    if not config.init_from:
        return None
    if config.checkpoint_dir and complete_checkpoints(config.checkpoint_dir):
        if rank == 0:
            log.info("--init-from %s ignored: --checkpoint-dir %s holds a checkpoint of this run, which wins",
                     config.init_from, config.checkpoint_dir)
        return None
    source = check_source(config.init_from, trained.shape)
    if rank == 0:
        log.info("initialising the weights from %s (the optimizer starts afresh)", source.describe())
    return source


def _checkpointer(ctx: DistContext, config: TrainConfig, trained: TrainedModel, data: TokenData) -> Checkpointer | None:
    """The run's checkpoints, and what a checkpoint must agree with to be resumed."""
    settings = config.checkpoint_settings
    if settings is None:
        return None
    model = {**trained.shape.to_dict(), "sequence_length": trained.seq_len,
             "layers_per_stage": list(trained.layers_per_stage)}
    layout = {"tensor": config.tp, "pipeline": config.pp, "data": config.dp, "context": config.cp,
              "micro_batch_size": config.micro_batch_size, "num_micro_batches": config.num_microbatches}
    identity = Identity(config.job_name, model, layout, config.recipe.name, config.dtype,
                        {**data.identity, "seed": config.seed})
    provenance = {"init_from": str(Path(config.init_from).resolve())} if config.init_from else {}
    return Checkpointer(settings, identity, rank=ctx.rank, world=config.layout.world_size, provenance=provenance)


class _Running:
    """The plan this rank's replica follows now, and what depends on it.

    `base_plan` is the plan the run started with or last rolled out (the objective's point);
    straggler re-selection runs other rows of its frontier (`row`)."""

    def __init__(self, config: TrainConfig, schedule: Schedule, plan, *, simulate: bool, slowdown: float = 0.0) -> None:
        self.config, self.schedule, self.plan, self.base_plan = config, schedule, plan, plan
        self.revision = 0
        self.reason = ""  # why the latest revision: rollout | straggler | recovered
        self.digest: str | None = None  # rank 0 knows the starting plan file's
        self.row: int | None = plan.selected_row if plan is not None else None
        self.rows_run: list[int | None] = []
        self.sms_in_use = schedule.comm_sms_in_use()
        self._simulate = simulate
        self._models: dict[tuple[bool, float | None], object] = {}
        # A simulated straggler's GPU is a physical property: its ceiling makes the *starting*
        # schedule `slowdown` slower and stays the same when plans change.
        self.ceiling_mhz = _straggler_ceiling_mhz(config, schedule, slowdown) if simulate and slowdown else None
        if simulate:
            _check_power_limit(config, plan)

    def resumed(self, ctx: DistContext, resumed: Resumed) -> None:
        """Go on counting plan revisions from the checkpoint's; a plan file that changed since counts as one more."""
        changed = resumed.plan_digest is not None and self.digest is not None and resumed.plan_digest != self.digest
        self.revision = resumed.plan_revision + int(changed)
        self.reason = "rollout" if changed else self.reason
        if ctx.rank == 0:
            log.info("resuming from %s after step %d (plan revision %d%s)", resumed.path, resumed.step,
                     resumed.plan_revision, ", the plan file changed since" if changed else "")

    def simulated(self, slowed: bool = False, power_limit_w: float | None = None):
        """This replica's modelled iteration (`ReplicaIteration`), on the slowed GPU if `slowed`, its
        board limited to `power_limit_w`; None on NVML."""
        if not self._simulate:
            return None
        slowed = slowed and self.ceiling_mhz is not None
        key = (slowed, power_limit_w)
        if key not in self._models:
            ceiling = self.ceiling_mhz if slowed else None
            self._models[key] = _simulated_energy(self.config, self.schedule, ceiling, power_limit_w).replica
        return self._models[key]

    def record_fields(self) -> tuple:
        """plan_revision, predicted time and energy, digest (as `StepRecord` orders them)."""
        self.rows_run.append(self.row)
        predicted = self.plan.predicted if self.plan is not None else None
        return (self.revision, predicted.iteration_time_s if predicted else None,
                predicted.iteration_energy_j if predicted else None, self.digest)

    def straggler_fields(self, straggle: StragglerRuntime, rows: list[int] | None,
                         replica_s: list[float] | None) -> dict:
        """The re-selection state of this step for `StepRecord` (rows: what every replica ran)."""
        return {"plan_revision_reason": self.reason, "plan_frontier_row": self.row, "replica_frontier_rows": rows,
                "replica_time_s": replica_s, "straggler_replica": straggle.straggler,
                "straggler_slowdown": straggle.slowdown}

    def switch(self, ctx: DistContext, step: int, plan, schedule: Schedule, digest: str, executor: StageExecutor,
               outputs: _Outputs, comms: tuple[GroupComm, GroupComm]) -> None:
        """Every rank, same step: follow `schedule` (already checked by every rank) from now on."""
        old = self.plan.predicted if self.plan is not None else None
        self._follow(ctx, plan, schedule, executor, outputs, comms, schedule.comm_sms_in_use())
        self.base_plan, self.row = plan, plan.selected_row
        self.revision, self.digest, self.reason = self.revision + 1, digest, "rollout"
        if ctx.rank == 0:
            was = f"{old.iteration_time_s:.6g} s, {old.iteration_energy_j:.6g} J" if old else "no plan"
            log.info("plan revision %d (sha256 %s…, objective %s) takes effect at step %d: predicted iteration "
                     "%.6g s, %.6g J (was %s)", self.revision, digest[:12], _plan_labels(plan)["objective"], step,
                     plan.predicted.iteration_time_s, plan.predicted.iteration_energy_j, was)

    def reselect(self, ctx: DistContext, decision: Decision, executor: StageExecutor, outputs: _Outputs,
                 comms: tuple[GroupComm, GroupComm]) -> None:
        """Every rank, same step boundary: each replica runs its row of `decision` (rows of the
        base plan's frontier) from the next step on. Every rank adds the communicators of every
        replica's new schedule, so the collective group creation matches on all ranks."""
        plans = {row: plan_at_row(self.base_plan, row) for row in set(decision.rows)}
        schedules = {row: schedule_for_plan(p, self.config, self.config.schedule_mode) for row, p in plans.items()}
        needed = set().union(*(sch.comm_sms_in_use() for sch in schedules.values()))
        mine = decision.rows[ctx.dp_rank]
        if mine != self.row:
            _check(self.config, schedules[mine])
            self._follow(ctx, plans[mine], schedules[mine], executor, outputs, comms, needed)
            self.row = mine
        else:
            self._add_comm_groups(ctx, needed, comms)
        self.revision, self.reason = self.revision + 1, decision.reason
        if ctx.rank == 0:
            rows = ", ".join(f"replica {r}: row {row} ({plans[row].predicted.iteration_time_s:.6g} s, "
                             f"{plans[row].predicted.iteration_energy_j:.6g} J)" for r, row in enumerate(decision.rows))
            why = (f"replica {decision.straggler} is {decision.slowdown:.1%} slower than the others"
                   if decision.reason == "straggler" else "no replica is slower any more")
            log.info("plan revision %d (%s: %s) takes effect at step %d: %s", self.revision, decision.reason, why,
                     decision.step + 1, rows)

    def _follow(self, ctx: DistContext, plan, schedule: Schedule, executor: StageExecutor, outputs: _Outputs,
                comms: tuple[GroupComm, GroupComm], sms: set[int]) -> None:
        executor.switch(schedule.stages[ctx.pp_rank])
        self._add_comm_groups(ctx, sms, comms)
        self.plan, self.schedule = plan, schedule
        self._models.clear()
        outputs.switch(schedule, _plan_labels(plan))

    def _add_comm_groups(self, ctx: DistContext, sms: set[int], comms: tuple[GroupComm, GroupComm]) -> None:
        """CUDA: one communicator per SM count not yet in use (every rank, same order)."""
        new_sms = sms - self.sms_in_use
        self.sms_in_use |= new_sms
        if ctx.device.type != "cuda" or not new_sms:
            return
        tp, cp = comms
        layout = self.config.layout
        for comm, all_ranks, my_ranks in ((tp, layout.tp_groups(), ctx.tp_ranks), (cp, layout.cp_groups(), ctx.cp_ranks)):
            if comm.size > 1:
                comm.groups_by_sms.update(nccl_groups_by_sms(all_ranks, my_ranks, sorted(new_sms), ctx.device))


def _straggler_ceiling_mhz(config: TrainConfig, schedule: Schedule, slowdown: float) -> float:
    """The clock ceiling that makes `schedule` `slowdown` slower on the job's simulated GPU."""
    from kareus.sim import get_gpu
    from kareus.sim.replica import ceiling_for_slowdown

    return ceiling_for_slowdown(lambda c: _simulated_energy(config, schedule, c).replica.time_s,
                                get_gpu(config.gpu_product), slowdown)


def _rollout(ctx: DistContext, config: TrainConfig, executor: StageExecutor) -> PlanRollout:
    """The per-step plan check: rank 0 watches the file; every rank builds and checks its stage."""

    def build(plan) -> Schedule:
        schedule = schedule_for_plan(plan, config, config.schedule_mode)
        _check(config, schedule)
        executor.check_instructions(schedule.stages[ctx.pp_rank])
        return schedule

    return PlanRollout(config.plan_path, config.plan_digest, build, rank=ctx.rank, distributed=ctx.distributed,
                       device=ctx.device)


def _plan_labels(plan) -> dict[str, str]:
    """The `kareus_plan_info` labels of a plan."""
    return {"method": plan.method, "objective": ",".join(sorted(plan.objective))}


def _comms(ctx: DistContext, config: TrainConfig, schedule: Schedule, cuda: bool) -> tuple[GroupComm, GroupComm]:
    """The TP and CP collectives; on CUDA they share one comm stream and get one communicator per
    SM count the schedule uses. The one-GPU stand-in replaces the TP all-reduce."""
    stream = comm_stream() if cuda else None
    sms = schedule.comm_sms_in_use()

    def comm(size: int, group, all_ranks, my_ranks, standin: bool) -> GroupComm:
        by_sms = nccl_groups_by_sms(all_ranks, my_ranks, sms, ctx.device) if cuda and size > 1 else {}
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
    the daemon) controllable GPU number LOCAL_RANK among the pod's own (NVIDIA_VISIBLE_DEVICES, when
    it names UUIDs), so ranks — and pods sharing a node — never fight over a clock."""
    if meter is not None:
        return [meter.uuid]
    if not socket_path:
        return None
    try:
        with open_connection(socket_path) as daemon:
            controllable = [gpu.uuid for gpu in daemon.discover() if gpu.controllable]
    except DaemonError:
        return None  # `connect` reports the same problem and degrades to no clock control
    # The device plugin names the pod's GPUs; on a shared node the daemon lists every GPU.
    visible = [u for u in os.environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u.startswith("GPU-")]
    if visible:
        controllable = [uuid for uuid in visible if uuid in controllable]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return [controllable[local_rank % len(controllable)]] if controllable else None


def _nvml_meter(ctx: DistContext) -> MeasuredEnergy | None:
    """This GPU's NVML energy counter; None (simulated accounting, with a warning) without NVML.
    A counter that would belong to another GPU (or a whole MIG card) is an error, not a fallback."""
    try:
        return MeasuredEnergy(ctx.device.index or 0)
    except EnergyAttributionError:
        raise
    except KareusError as error:
        log.warning("no NVML energy counter (%s); accounting energy on the simulated GPU", error)
        return None


def _check_power_limit(config: TrainConfig, plan) -> None:
    """A simulated run models its GPUs under the plan's power limit, so it must be one the simulated
    board accepts (on real GPUs the node agent checks the board's own range)."""
    from kareus.sim import get_gpu

    if plan is None or plan.power_limit_w is None:
        return
    gpu = get_gpu(config.gpu_product)
    if not gpu.power_limit_min_w <= plan.power_limit_w <= gpu.power_limit_w:
        raise KareusError(f"power_limit_w: the plan's {plan.power_limit_w:g} W is outside the settable range "
                          f"{gpu.power_limit_min_w:g}–{gpu.power_limit_w:g} W of the simulated {gpu.name}")


def _follow_power_limit(clock: ClockClient, plan, current_w: float | None) -> float | None:
    """Ask the node agent for the plan's per-GPU power limit when it differs from `current_w` (None:
    the board's default); returns the limit now asked for."""
    wanted = plan.power_limit_w if plan is not None else None
    if wanted != current_w:
        clock.set_power_limit(wanted)
    return wanted


def _power_limit_in_force(twin: TwinEnergy | None, plan) -> float | None:
    """The board limit this rank's modelled work runs under: on a shared simulated GPU the one the
    node agent set on it (as a real board throttles to whatever limit it has), else the plan's (the
    model follows the plan, as for its clocks)."""
    if twin is not None:
        return twin.device.run_power_limit_w()
    return plan.power_limit_w if plan is not None else None


def _simulated_energy(config: TrainConfig, schedule: Schedule, clock_ceiling_mhz: float | None = None,
                      power_limit_w: float | None = None) -> SimulatedEnergy:
    mbs = config.micro_batch_size + config.micro_batch_size % 2  # the workload counts nanobatch pairs
    workload = build_workload(config.shape, tp=config.tp, cp=config.cp, pp=config.pp, seq_len=config.seq_len,
                              micro_batch_size=mbs,
                              activation_checkpointing=checkpointing_mode(config.activation_checkpointing) != "none",
                              stage_layers=config.layers_per_stage)
    return SimulatedEnergy(workload, config.gpu_product, schedule, config.tp * config.cp * config.dp,
                           clock_ceiling_mhz=clock_ceiling_mhz, calibration=_calibration(config.sim_params),
                           power_limit_w=power_limit_w)


@functools.lru_cache(maxsize=4)
def _calibration(path: str | None):
    """The parameter file read once per process: a straggler's clock ceiling is found by bisection,
    each step of which models the iteration again."""
    from kareus.sim import paramsfile

    return paramsfile.load_or_default(path)


def _sync_gradients(ctx: DistContext, model: StageModel, grads: dict[str, torch.Tensor]) -> None:
    """Sum gradients (the masters': fp32 in bf16 too) over the data- and context-parallel replicas
    (bucket by bucket), the q/k norms' over tensor parallelism, and tied embeddings over the pipeline ends."""
    if ctx.tp_group is not None and model.shape.qk_norm:
        # q/k norms act per head and each TP rank holds only its heads: their gradients are partial sums.
        all_reduce_bucketed([g for n, g in grads.items() if n.endswith(("q_norm", "k_norm"))], ctx.tp_group)
    if ctx.grad_group is not None:
        all_reduce_bucketed(list(grads.values()), ctx.grad_group)
    if ctx.end_group is not None and model.shape.tied_embeddings:
        dist.all_reduce(grads["embedding"], group=ctx.end_group)


CLOCK_CONTROL = ("none", "active", "degraded")


def _reduce_step(ctx: DistContext, local_loss: float, elapsed: float, gpu_j: float,
                 clock: ClockClient) -> tuple[float, float, float, tuple[str, str]]:
    """Whole-job loss (sum of last-stage contributions), time (max over ranks), energy, and clock
    control (degraded if any rank is, with the lowest such rank's reason)."""
    counts_loss = ctx.tp_rank == 0
    code = 2 if clock.degraded else 0 if isinstance(clock, NullClockClient) else 1
    if not ctx.distributed:
        return local_loss, elapsed, gpu_j, _clock_control(code, f"rank 0: {clock.degraded_reason}")
    world = ctx.layout.world_size
    sums = torch.tensor([local_loss if counts_loss else 0.0, gpu_j], dtype=torch.float64)
    # MAX over ranks: the slowest time, the worst clock-control state, the lowest degraded rank
    worst = torch.tensor([elapsed, code, world - ctx.rank if code == 2 else 0, float(stopping.requested())],
                         dtype=torch.float64)
    if ctx.device.type == "cuda":
        sums, worst = sums.to(ctx.device), worst.to(ctx.device)
    dist.all_reduce(sums)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if worst[3] > 0:
        stopping.agreed()  # one rank was asked to stop: every rank stops after this step
    code, reason = int(worst[1]), ""
    if code == 2:
        src = world - int(worst[2])
        mine = clock.degraded_reason.encode() if ctx.rank == src else None
        reason = f"rank {src}: " + (broadcast_bytes(mine, src, ctx.device).decode(errors="replace") or "no reason given")
    return float(sums[0]), float(worst[0]), float(sums[1]), _clock_control(code, reason)


def _clock_control(code: int, reason: str) -> tuple[str, str]:
    return (CLOCK_CONTROL[code], reason if code == 2 else "")


class _Outputs:
    """train.jsonl on rank 0 and the rank-local metrics endpoint."""

    def __init__(self, ctx: DistContext, config: TrainConfig, schedule: Schedule) -> None:
        # A resumed run's file starts at the step after its checkpoint: this run's steps, one line each.
        self.writer = JsonlWriter(Path(config.out_dir) / "train.jsonl") if config.out_dir and ctx.rank == 0 else None
        self.exporter = None
        if config.metrics_port is not None:
            port = config.metrics_port + int(os.environ.get("LOCAL_RANK", ctx.rank)) if config.metrics_port else 0
            plan = {"mode": _mode_summary(schedule), **config.plan_labels}
            self.exporter = MetricsExporter(port, addr=config.metrics_addr, rank=ctx.rank, stage=ctx.pp_rank,
                                            job=config.job_name, plan=plan)
        self.metrics_port = self.exporter.port if self.exporter else None
        self.clock_summary = _clock_summary(schedule)
        self._mode_labels = {k: v for k, v in config.plan_labels.items() if k not in ("method", "objective")}

    def switch(self, schedule: Schedule, plan_labels: dict[str, str]) -> None:
        """A new plan (or frontier row): its clock summary, and its labels on `kareus_plan_info`."""
        self.clock_summary = _clock_summary(schedule)
        if self.exporter:
            self.exporter.set_plan({"mode": _mode_summary(schedule), **self._mode_labels, **plan_labels})

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


def _clock_summary(schedule: Schedule) -> dict[str, float]:
    clocks = [i.clock_mhz for stage in schedule.stages for i in stage if i.clock_mhz]
    return ({"min": float(min(clocks)), "max": float(max(clocks)), "mean": sum(clocks) / len(clocks)}
            if clocks else {})


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
    config = TrainConfig.from_job(job, schedule_mode=schedule_mode, **overrides)
    schedule = build_schedule(job, plan, config, schedule_mode)
    world = config.layout.world_size
    if "WORLD_SIZE" in os.environ or (world == 1 and nproc in (None, 1)):
        ctx = init_distributed(config.layout, device=config.device)
        try:
            result, _ = run_rank(ctx, config, schedule, clock=clock, plan=plan)
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
        # A wrong --init-from is one error here, not one per rank after the spawn.
        _init_source(config, config.trained_model(device == "cuda"), rank=1)
        spawn_local(per_node, _spawned_rank, replace(config, device=device), schedule, plan, tmp, nodes=nodes)
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
    if plan is not None:
        return schedule_for_plan(plan, config, schedule_mode)
    nanobatching = getattr(getattr(job, "spec", job).parallelism, "nanobatching", True)
    schedule = Schedule.uniform(config.pp, config.num_microbatches, mode="partitioned" if nanobatching else "sequential")
    return schedule.as_sequential() if schedule_mode == "sequential" else schedule


def schedule_for_plan(plan, config: TrainConfig, schedule_mode: str = "plan") -> Schedule:
    """The schedule of `plan`, which must be made for this job's layout."""
    _check_plan_matches(plan, config)
    schedule = Schedule.from_plan(plan)
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


def log_to_stderr() -> None:
    """Show the runtime's info lines (plan roll-outs) on stderr, unless logging is set up already."""
    logger = logging.getLogger("kareus")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("kareus: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _spawned_rank(rank: int, store, config: TrainConfig, schedule: Schedule, plan, result_dir: str) -> None:
    log_to_stderr()
    ctx = init_distributed(config.layout, rank=rank, store=store, device=config.device)
    result, _ = run_rank(ctx, config, schedule, plan=plan)
    if int(os.environ["LOCAL_RANK"]) == 0:  # the node's first process reports (losses are global)
        (Path(result_dir) / "result.pkl").write_bytes(pickle.dumps(result))


def export_final(checkpoint_dir: str, export_dir: str, step: int) -> Path:
    """Rank 0's export of the checkpoint after `step` steps into `export_dir`, written into
    `<export_dir>.partial` and renamed into place, so a pod killed midway leaves no half export (the
    next run removes the partial one and writes it again). An export of `step` already there (a run
    resumed after it finished) is kept as it is; one of another step is an error, never overwritten."""
    from kareus.runtime.export import export_checkpoint

    final = Path(export_dir)
    if final.exists():
        written = _export_step(final)
        if written == step:
            log.info("export of step %d already in %s: nothing to do", step, final)
            return final
        held = f"an export of step {written}" if written is not None else "something other than an export"
        raise KareusError(f"--export-dir {final}: holds {held}, not of step {step}; remove it or export elsewhere",
                          exit_code=EXIT_CONFIG)
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # a killed export's leftovers
    partial.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    done = export_checkpoint(checkpoint_dir, partial, step=step)
    os.replace(partial, final)
    log.info("exported step %d as a Hugging Face model: %s (%d files, %.1f MB) in %.1f s", step, final,
             len(done.files), done.total_bytes / 1e6, time.perf_counter() - started)
    return final


def _export_step(directory: Path) -> int | None:
    """The step an export directory was written from (its index's metadata), None when unreadable."""
    try:
        step = json.loads((directory / "model.safetensors.index.json").read_text())["metadata"]["kareus_step"]
        return int(step)
    except (OSError, ValueError, KeyError, TypeError):
        return None
