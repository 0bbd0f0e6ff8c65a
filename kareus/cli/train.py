"""`kareus train JOB.yaml [--plan PLAN.json]`: train a job following its plan.

What the training pods run. Under `torchrun` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in
the environment) this process is one rank. Otherwise it starts this node's `--nproc` processes
itself (one GPU each when enough are visible, else CPU with gloo); with NNODES/NODE_RANK/MASTER_ADDR/
MASTER_PORT in the environment (as the operator's training pods have) the nodes rendezvous at the
master like torchrun's. Rank 0 writes `OUT/train.jsonl` and prints a summary. The plan file is
watched: when it changes (the operator re-selected a plan), all ranks switch at the next step
boundary; an invalid new plan is logged and ignored. The node daemon's address (or socket) and the
metrics port also come from the environment (`KAREUS_DAEMON_ADDRESS` with `KAREUS_DAEMON_TOKEN_FILE`,
or `KAREUS_DAEMON_SOCKET`; `KAREUS_METRICS_PORT`, `KAREUS_METRICS_ADDR`), so a pod spec sets them
once for every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kareus.errors import EXIT_CONFIG, KareusError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a job following its plan (what training pods run)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", metavar="JOB.yaml", help="the KareusJob manifest")
    parser.add_argument("--plan", metavar="PLAN.json", help="plan to follow (default: every microbatch "
                        "partitioned at default configs and default clocks); a new plan written to this "
                        "file takes effect at the next step boundary on every rank")
    parser.add_argument("--steps", type=int, help="iterations to run (default: spec.training.steps)")
    parser.add_argument("--data", metavar="PATH", help="token file, e.g. a `kareus data prepare` PREFIX (default: the built-in byte corpus, "
                        "only for a byte-level model (vocabulary 256) or the CPU proxy; any other model needs data); its format "
                        "from --data-format, else from the name: .npy, a Megatron PREFIX(.bin/.idx) pair, another "
                        ".bin (flat token ids), anything else read as bytes (byte-level tokenizer)")
    parser.add_argument("--data-format", metavar="npy|bin|megatron|bytes", help="npy: NumPy token ids; bin: flat little-endian "
                        "uint16/uint32 ids (memory-mapped); megatron: Megatron-LM indexed dataset (.bin + .idx); "
                        "bytes: byte-level tokenizer")
    parser.add_argument("--data-dtype", metavar="uint16|uint32", help="token type of a bin file (default: "
                        "uint16 when the model's vocabulary fits, else uint32)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (sharded, one part per "
                        "rank) and resume from the newest complete one of this job; shared by every node")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="save after every N steps (default 0: only when SIGTERM stops the run)")
    parser.add_argument("--checkpoint-keep", type=int, default=2, metavar="K",
                        help="keep the last K complete checkpoints (default 2)")
    parser.add_argument("--init-from", metavar="DIR", help="start from these weights: a Hugging Face model "
                        "directory (config.json + safetensors) or a Kareus checkpoint of any layout (model weights "
                        "only, a new optimizer); its config is checked against the job's model first; ignored when "
                        "--checkpoint-dir holds a checkpoint of this run")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default 0)")
    parser.add_argument("--out", metavar="DIR", help="write DIR/train.jsonl (rank 0)")
    parser.add_argument("--export-dir", metavar="DIR", help="after the final step, save a checkpoint of it (if "
                        "there is none) and write it as a Hugging Face model directory into DIR (via DIR.partial, "
                        "renamed when complete; an export already there is kept); needs --checkpoint-dir")
    parser.add_argument("--nproc", type=int, help="processes to start on this node (default: all); with "
                        "NNODES nodes, nproc × NNODES must equal tensor×context×pipeline×data")
    parser.add_argument("--schedule", choices=("plan", "sequential"), default="plan",
                        help="'sequential' keeps the plan's clocks but runs every microbatch un-nanobatched")
    parser.add_argument("--daemon-socket", default=os.environ.get("KAREUS_DAEMON_SOCKET"),
                        help="node daemon socket for clock requests (env KAREUS_DAEMON_SOCKET; none: no clock control)")
    parser.add_argument("--daemon-address", metavar="HOST:PORT", default=os.environ.get("KAREUS_DAEMON_ADDRESS"),
                        help="node daemon TCP address for clock requests, authenticated with the token in "
                             "KAREUS_DAEMON_TOKEN_FILE (env KAREUS_DAEMON_ADDRESS; wins over --daemon-socket)")
    parser.add_argument("--metrics-port", type=int, default=_env_int("KAREUS_METRICS_PORT"),
                        help="Prometheus port of local rank 0, +1 per local rank; 0 picks free ports "
                             "(env KAREUS_METRICS_PORT; default: no endpoint)")
    parser.add_argument("--metrics-addr", default=os.environ.get("KAREUS_METRICS_ADDR", "0.0.0.0"),
                        help="address the metrics endpoint binds (env KAREUS_METRICS_ADDR; default 0.0.0.0)")
    recipe = parser.add_argument_group("training recipe", "each flag overrides spec.training.optimizer's field "
                                       "(defaults: Llama pre-training's, docs/runtime.md 'Training recipe')")
    recipe.add_argument("--optimizer", choices=("adamw", "sgd"), help="default adamw")
    recipe.add_argument("--lr", type=float, help="peak learning rate (default by model size: 1e-2 under 10M "
                        "parameters, 3e-4 up to 20B, 1.5e-4 up to 150B, else 8e-5)")
    recipe.add_argument("--min-lr", type=float, help="the rate the schedule decays to (default lr / 10)")
    recipe.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 2000, at most a tenth of "
                        "the decay steps)")
    recipe.add_argument("--lr-schedule", choices=("constant", "linear", "cosine", "wsd"),
                        help="after warmup (default cosine)")
    recipe.add_argument("--decay-steps", type=int, help="step at which the rate reaches --min-lr, counted from "
                        "step 0 (default: the job's steps)")
    recipe.add_argument("--wsd-decay-fraction", type=float, help="share of the post-warmup steps wsd decays over "
                        "(default 0.2)")
    recipe.add_argument("--weight-decay", type=float, help="decoupled weight decay on weight matrices (default 0.1)")
    recipe.add_argument("--no-embedding-decay", dest="decay_embeddings", action="store_const", const=False,
                        help="no weight decay on the embedding table")
    recipe.add_argument("--beta1", type=float, help="AdamW beta1 (default 0.9)")
    recipe.add_argument("--beta2", type=float, help="AdamW beta2 (default 0.95)")
    recipe.add_argument("--eps", type=float, help="AdamW epsilon (default 1e-8)")
    recipe.add_argument("--clip-grad-norm", type=float, help="clip the global gradient norm to this; 0: off "
                        "(default 1.0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA with NCCL when a GPU is visible, else CPU with gloo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="compute type; bfloat16 keeps fp32 master weights, gradients and optimizer state "
                             "(default: spec.training.precision, else float32)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="TF32 for fp32 matmuls on GPU (default: spec.training.tf32, else on)")
    parser.add_argument("--comm-standin", action="store_true",
                        help="one GPU, tensor 1: run an exact no-op kernel on the comm stream where an "
                             "all-reduce would be, to exercise the overlap machinery")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    from kareus.sim import paramsfile

    paramsfile.add_argument(parser)  # the simulated GPU's accounting on CPU, as profiling used
    parser.set_defaults(func=run)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise KareusError(f"environment {name}: must be an integer port, got {value!r}") from None


def run(args: argparse.Namespace) -> int:
    from kareus.daemon_client import daemon_endpoint
    from kareus.runtime import train
    from kareus.runtime.reload import read_plan
    from kareus.runtime.trainer import log_to_stderr
    from kareus.spec import load_job

    _check_args(args)
    log_to_stderr()
    job = load_job(args.job)
    if args.sim_params:
        from kareus.sim import paramsfile

        paramsfile.load(args.sim_params)  # one clear error here, not one per rank at its first step
    plan, digest = read_plan(args.plan) if args.plan else (None, None)
    overrides = {"seed": args.seed, "data_path": args.data, "data_format": args.data_format,
                 "data_dtype": args.data_dtype, "checkpoint_dir": args.checkpoint_dir,
                 "checkpoint_every": args.checkpoint_every, "checkpoint_keep": args.checkpoint_keep,
                 "init_from": args.init_from, "out_dir": args.out, "recipe": _recipe(job, args),
                 # the endpoint: a socket path or tcp://HOST:PORT (kareus.daemon_client connects to either)
                 "daemon_socket": daemon_endpoint(args.daemon_socket, args.daemon_address),
                 "metrics_port": args.metrics_port, "metrics_addr": args.metrics_addr, "device": args.device,
                 "comm_standin": args.comm_standin,
                 "job_name": job.name, "plan_path": args.plan, "plan_digest": digest, "sim_params": args.sim_params}
    if args.export_dir:
        overrides["export_dir"] = args.export_dir
    for name in ("steps", "dtype", "tf32"):  # else the job spec's
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if plan is not None:
        overrides["plan_labels"] = {"method": plan.method, "objective": ",".join(sorted(plan.objective))}
    from kareus.runtime import stopping

    if "WORLD_SIZE" in os.environ:  # one rank of torchrun's: SIGTERM stops it after its step, with its peers
        stopping.on_sigterm()
    result = train(job, plan, schedule_mode=args.schedule, nproc=args.nproc, **overrides)
    if int(os.environ.get("RANK", "0")) == 0:
        _print_summary(result, args.json)
        if result.exported and not args.json:
            print(f"export: {result.exported} (a Hugging Face model directory)")
    if result.stopped_early:
        kept = (f"; checkpoint after step {result.checkpoint_step} saved" if result.checkpoint_step is not None
                else "; no checkpoint kept (no --checkpoint-dir)")
        print(f"kareus train: stopped by SIGTERM after {result.first_step + len(result.losses)} of the job's "
              f"steps{kept}", file=sys.stderr)
        return stopping.EXIT_CODE  # retryable: the pod failure policy counts it, never fails the job on it
    return 0


def _check_args(args: argparse.Namespace) -> None:
    for name, low in (("steps", 0), ("nproc", 1), ("metrics_port", 0), ("checkpoint_every", 0),
                      ("checkpoint_keep", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise KareusError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.metrics_port is not None and args.metrics_port > 65535:
        raise KareusError(f"--metrics-port must be <= 65535, got {args.metrics_port}")
    for name, low, high, low_open, high_open in RECIPE_FLAG_BOUNDS:
        value = getattr(args, name)
        if value is None:
            continue
        if not ((value > low if low_open else value >= low) and (value < high if high_open else value <= high)):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise KareusError(f"--{name.replace('_', '-')} must be in {interval}, got {value}")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise KareusError("--checkpoint-every needs --checkpoint-dir")
    if args.export_dir and not args.checkpoint_dir:
        raise KareusError("--export-dir needs --checkpoint-dir: the export is written from the final step's checkpoint",
                          exit_code=EXIT_CONFIG)


# (flag, low, high, low open, high open): the spec's bounds of the same fields, except that the command
# line takes --lr 0: a frozen run (a weights round trip, the loss of a model as it is).
RECIPE_FLAG_BOUNDS = (
    ("lr", 0, 10, False, False), ("min_lr", 0, 10, False, False), ("warmup_steps", 0, 10**9, False, False),
    ("decay_steps", 1, 10**9, False, False), ("wsd_decay_fraction", 0, 1, True, False),
    ("weight_decay", 0, 1, False, False), ("beta1", 0, 1, False, True), ("beta2", 0, 1, False, True),
    ("eps", 0, 1, True, False), ("clip_grad_norm", 0, 1e6, False, False),
)


def _recipe(job, args: argparse.Namespace):
    """spec.training.optimizer with the flags given on the command line on top."""
    from kareus.runtime.optimizer_recipe import OptimizerRecipe

    recipe = OptimizerRecipe.from_spec(job.spec.training.optimizer)
    return recipe.with_overrides(name=args.optimizer, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                                 schedule_kind=args.lr_schedule, decay_steps=args.decay_steps,
                                 wsd_decay_fraction=args.wsd_decay_fraction, weight_decay=args.weight_decay,
                                 decay_embeddings=args.decay_embeddings, beta1=args.beta1, beta2=args.beta2,
                                 eps=args.eps, clip_grad_norm=args.clip_grad_norm)


def _print_summary(result, as_json: bool) -> None:
    steps = len(result.losses)
    summary = {
        "steps": steps,
        "first_step": result.first_step,
        "first_loss": result.losses[0] if steps else None,
        "final_loss": result.losses[-1] if steps else None,
        "mean_iteration_time_s": sum(result.iteration_time_s) / steps if steps else None,
        "energy_j_per_iteration": sum(result.energy_j) / steps if steps else None,
        "energy_source": result.energy_source,
        "modelled_iteration_time_s": result.modelled_time_s,
        "tokens_per_step": result.tokens_per_step,
        "out_dir": result.out_dir,
        "exported": result.exported,
    }
    if as_json:
        print(json.dumps(summary))
        return
    if not steps:
        print("kareus train: 0 steps run", file=sys.stdout)
        return
    print(f"kareus train: {steps} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
          f"{summary['mean_iteration_time_s'] * 1e3:.1f} ms/iteration, "
          f"{summary['energy_j_per_iteration']:.3g} J/iteration ({result.energy_source})")
    if result.out_dir:
        print(f"progress: {os.path.join(result.out_dir, 'train.jsonl')}")
