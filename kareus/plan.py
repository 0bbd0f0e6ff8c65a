"""The training plan: what every pipeline stage runs, at which clock, with which overlap settings.

A plan is a versioned JSON document (`apiVersion: kareus.dev/v1alpha1`, `kind: KareusPlan`,
JSON Schema in `plan_schema.json`). Per pipeline stage it lists the instructions in 1F1B issue
order; each instruction (forward or backward of one microbatch) has one SM clock and is either
`sequential` (Megatron-style, no nanobatching) or `partitioned`, with one `PartitionConfig`
(launch slot, comm SMs) per partition type — and, for backward under activation checkpointing,
one per recomputed forward partition type.

The plan also keeps the whole iteration frontier the optimizer found, as ONE table: per stage
and direction an option table (the microbatch frontier points: clock, mode, configs, time and
energy per GPU), and one row per frontier plan (iteration time, iteration energy over all GPUs
with static energy, and which option each instruction uses, run-length encoded per stage and
direction in microbatch order). `reselect(plan, objective)` rebuilds the plan for another
objective from that table without re-profiling; the operator calls it when `spec.objective`
changes. Other methods' frontiers (the baselines) ride along for plotting.

`power_limit_w` (optional, absent in older plans: none) is a per-GPU board power limit to run the
plan under — what the power-budget allocator gives a job whose point lies below its frontier's low
end (`kareus.power_budget`, `Allotment.power_limit_w`). The runtime asks the node agent for it and
restores the board's default when it exits.

`power_limited_points` (optional, absent in older plans: none) are a few frontier rows predicted
under per-GPU power limits (`PowerLimitedPoint`: row, limit, time, energy), computed by
`kareus optimize` on the simulated GPU (`kareus.power_budget.twin.plan_power_limited_points`), so
the operator's power allocator can reach below the frontier's low end without a simulator of its
own. They are the frontier's, not the selected row's: `reselect` and `plan_at_row` keep them.

Validation is two-layered: the JSON Schema (shape and types) and semantic checks against the
job's `Workload` (known partition types, launch slots and SM counts, 1F1B order, clocks in the
GPU's list). Every error carries its field path.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path

from kareus.compressed import MAX_PLAN_BYTES, DecompressError, gunzip
from kareus.errors import KareusError
from kareus.job import PlanJob
from kareus.objective import parse_objective, select_point
from kareus.workload.partitions import PartitionConfig, Workload

API_VERSION = "kareus.dev/v1alpha1"
KIND = "KareusPlan"
DIRECTIONS = ("forward", "backward")
MODES = ("partitioned", "sequential")
GZIP_MAGIC = b"\x1f\x8b"


class PlanError(KareusError):
    """An invalid plan; `errors` lists every problem as `field.path: message`."""

    def __init__(self, errors: Sequence[str], source: str = "plan") -> None:
        self.errors = list(errors)
        shown = "\n  ".join(self.errors[:20])
        more = f"\n  … and {len(self.errors) - 20} more" if len(self.errors) > 20 else ""
        super().__init__(f"invalid {source}:\n  {shown}{more}")


# ---------------------------------------------------------------------------------------------
# Value objects


@dataclass(frozen=True)
class Prediction:
    """The plan's predicted iteration: time, and energy over all GPUs of the job incl. static."""

    iteration_time_s: float
    iteration_energy_j: float


@dataclass(frozen=True)
class Provenance:
    """Where the plan came from: the profile it was composed from and the solver settings."""

    profile_key: str = ""
    method: str = "kareus"
    solver: Mapping[str, object] = field(default_factory=dict)
    created: str = ""
    software_version: str = ""

    def to_dict(self) -> dict:
        return {"profile_key": self.profile_key, "method": self.method, "solver": dict(self.solver),
                "created": self.created, "software_version": self.software_version}

    @classmethod
    def from_dict(cls, data: Mapping) -> Provenance:
        return cls(profile_key=data.get("profile_key", ""), method=data.get("method", "kareus"),
                   solver=dict(data.get("solver", {})), created=data.get("created", ""),
                   software_version=data.get("software_version", ""))


ConfigMap = Mapping[str, PartitionConfig]


@dataclass(frozen=True)
class Instruction:
    """One pipeline instruction: forward or backward of one microbatch on one stage."""

    kind: str
    microbatch: int
    clock_mhz: int
    mode: str = "partitioned"
    configs: ConfigMap = field(default_factory=dict)
    recompute_configs: ConfigMap = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "microbatch": self.microbatch, "clock_mhz": self.clock_mhz,
                "mode": self.mode, "configs": _configs_to_dict(self.configs),
                "recompute_configs": _configs_to_dict(self.recompute_configs)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Instruction:
        return cls(kind=data["kind"], microbatch=data["microbatch"], clock_mhz=data["clock_mhz"],
                   mode=data["mode"], configs=_configs_from_dict(data.get("configs", {})),
                   recompute_configs=_configs_from_dict(data.get("recompute_configs", {})))


@dataclass(frozen=True)
class StagePlan:
    """The instructions of one pipeline stage, in issue (1F1B) order."""

    stage: int
    instructions: tuple[Instruction, ...]


@dataclass(frozen=True)
class InstructionOption:
    """One way to run a stage's forward or backward: a microbatch frontier point (per GPU)."""

    clock_mhz: int
    mode: str
    time_s: float
    energy_j: float
    configs: ConfigMap = field(default_factory=dict)
    recompute_configs: ConfigMap = field(default_factory=dict)

    def effective_energy_j(self, p_static_w: float) -> float:
        return self.energy_j - p_static_w * self.time_s

    def instruction(self, kind: str, microbatch: int) -> Instruction:
        return Instruction(kind=kind, microbatch=microbatch, clock_mhz=self.clock_mhz, mode=self.mode,
                           configs=self.configs, recompute_configs=self.recompute_configs)

    def to_dict(self) -> dict:
        return {"clock_mhz": self.clock_mhz, "mode": self.mode, "time_s": self.time_s,
                "energy_j": self.energy_j, "configs": _configs_to_dict(self.configs),
                "recompute_configs": _configs_to_dict(self.recompute_configs)}

    @classmethod
    def from_dict(cls, data: Mapping) -> InstructionOption:
        return cls(clock_mhz=data["clock_mhz"], mode=data["mode"], time_s=float(data["time_s"]),
                   energy_j=float(data["energy_j"]), configs=_configs_from_dict(data.get("configs", {})),
                   recompute_configs=_configs_from_dict(data.get("recompute_configs", {})))


@dataclass(frozen=True)
class StageOptions:
    """The option tables of one stage: its forward and backward microbatch frontiers."""

    forward: tuple[InstructionOption, ...]
    backward: tuple[InstructionOption, ...]

    def of(self, kind: str) -> tuple[InstructionOption, ...]:
        return self.forward if kind == "forward" else self.backward


@dataclass(frozen=True)
class FrontierRow:
    """One frontier plan: iteration time and energy (all GPUs, static included) and its choices.

    `choice[stage]` is `(forward option per microbatch, backward option per microbatch)`.
    """

    time_s: float
    energy_j: float
    choice: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "energy_j": self.energy_j,
                "choice": [[run_length_encode(f), run_length_encode(b)] for f, b in self.choice]}

    @classmethod
    def from_dict(cls, data: Mapping) -> FrontierRow:
        choice = tuple((tuple(run_length_decode(f)), tuple(run_length_decode(b)))
                       for f, b in data["choice"])
        return cls(time_s=float(data["time_s"]), energy_j=float(data["energy_j"]), choice=choice)


@dataclass(frozen=True)
class FrontierTable:
    """The whole iteration frontier: option tables per stage and one row per plan, fastest first."""

    options: tuple[StageOptions, ...]
    rows: tuple[FrontierRow, ...]

    def points(self) -> list[tuple[float, float]]:
        return [(row.time_s, row.energy_j) for row in self.rows]

    def stages_for(self, row_index: int) -> tuple[StagePlan, ...]:
        """The per-stage instruction lists (1F1B order) of one frontier row."""
        row = self.rows[row_index]
        num_stages = len(self.options)
        stages = []
        for s, (fwd, bwd) in enumerate(row.choice):
            picks = {"forward": fwd, "backward": bwd}
            order = one_f_one_b(num_stages, len(fwd), s)
            stages.append(StagePlan(s, tuple(
                self.options[s].of(kind)[picks[kind][m]].instruction(kind, m) for kind, m in order)))
        return tuple(stages)

    def to_dict(self) -> dict:
        return {
            "options": [{"forward": [o.to_dict() for o in st.forward],
                         "backward": [o.to_dict() for o in st.backward]} for st in self.options],
            "rows": [row.to_dict() for row in self.rows],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> FrontierTable:
        options = tuple(StageOptions(tuple(InstructionOption.from_dict(o) for o in st["forward"]),
                                     tuple(InstructionOption.from_dict(o) for o in st["backward"]))
                        for st in data["options"])
        return cls(options=options, rows=tuple(FrontierRow.from_dict(r) for r in data["rows"]))


@dataclass(frozen=True)
class MethodFrontier:
    """Another method's iteration frontier (time_s, energy_j over all GPUs), for comparison."""

    points: tuple[tuple[float, float], ...]

    def to_dict(self) -> dict:
        return {"frontier": [{"time_s": t, "energy_j": e} for t, e in self.points]}

    @classmethod
    def from_dict(cls, data: Mapping) -> MethodFrontier:
        return cls(tuple((float(p["time_s"]), float(p["energy_j"])) for p in data["frontier"]))


@dataclass(frozen=True)
class PowerLimitedPoint:
    """Frontier row `row` run with every GPU's board power limit at `power_limit_w`: its predicted
    iteration time and energy (all GPUs, static included), slower than the row alone."""

    row: int
    power_limit_w: float
    time_s: float
    energy_j: float

    def to_dict(self) -> dict:
        return {"row": self.row, "power_limit_w": self.power_limit_w, "time_s": self.time_s,
                "energy_j": self.energy_j}

    @classmethod
    def from_dict(cls, data: Mapping) -> PowerLimitedPoint:
        return cls(row=int(data["row"]), power_limit_w=float(data["power_limit_w"]), time_s=float(data["time_s"]),
                   energy_j=float(data["energy_j"]))


MAX_POWER_LIMITED_POINTS = 64  # the schema's bound: 3 rows × 16 limits fit, a plan stays small


@dataclass(frozen=True)
class Plan:
    """A training plan; see the module docstring. `selected_row` indexes `frontier.rows`."""

    job: PlanJob
    objective: Mapping[str, object]
    predicted: Prediction
    provenance: Provenance
    stages: tuple[StagePlan, ...]
    frontier: FrontierTable
    selected_row: int = 0
    baselines: Mapping[str, MethodFrontier] = field(default_factory=dict)
    power_limit_w: float | None = None  # per GPU; None: the board's default
    power_limited_points: tuple[PowerLimitedPoint, ...] = ()

    @property
    def method(self) -> str:
        return self.provenance.method

    def to_dict(self) -> dict:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "job": self.job.to_dict(),
            "objective": dict(self.objective),
            "predicted": {"iteration_time_s": self.predicted.iteration_time_s,
                          "iteration_energy_j": self.predicted.iteration_energy_j},
            "provenance": self.provenance.to_dict(),
            "selected_row": self.selected_row,
            "stages": [{"stage": st.stage, "instructions": [i.to_dict() for i in st.instructions]}
                       for st in self.stages],
            "frontier": self.frontier.to_dict(),
            "baselines": {name: mf.to_dict() for name, mf in self.baselines.items()},
            **({} if self.power_limit_w is None else {"power_limit_w": self.power_limit_w}),
            **({"power_limited_points": [p.to_dict() for p in self.power_limited_points]}
               if self.power_limited_points else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping, *, validate: bool = True, source: str = "plan") -> Plan:
        """Parse a plan; with `validate` (the default) every schema and semantic error is raised."""
        if validate:
            errors = validate_plan(data)
            if errors:
                raise PlanError(errors, source)
        return cls(
            job=PlanJob.from_dict(data["job"]),
            objective=dict(data["objective"]),
            predicted=Prediction(float(data["predicted"]["iteration_time_s"]),
                                 float(data["predicted"]["iteration_energy_j"])),
            provenance=Provenance.from_dict(data["provenance"]),
            stages=tuple(StagePlan(st["stage"], tuple(Instruction.from_dict(i) for i in st["instructions"]))
                         for st in data["stages"]),
            frontier=FrontierTable.from_dict(data["frontier"]),
            selected_row=data.get("selected_row", 0),
            baselines={k: MethodFrontier.from_dict(v) for k, v in data.get("baselines", {}).items()},
            power_limit_w=None if data.get("power_limit_w") is None else float(data["power_limit_w"]),
            power_limited_points=tuple(PowerLimitedPoint.from_dict(p) for p in data.get("power_limited_points") or ()),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_gzip(self) -> bytes:
        """The JSON, gzip-compressed: a 70B/128-microbatch plan shrinks from ~1 MB to ~25 KB
        (instructions repeat), small enough for a ConfigMap's `binaryData`."""
        return gzip.compress((self.to_json() + "\n").encode(), mtime=0)

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename), so a reader never sees half a plan; a path
        ending in `.gz` is written gzip-compressed."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if path.suffix == ".gz":
            tmp.write_bytes(self.to_gzip())
        else:
            tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)

    @classmethod
    def loads(cls, text: str | bytes, *, source: str = "plan") -> Plan:
        """Parse and validate a plan from JSON text or bytes, plain or gzip-compressed."""
        if isinstance(text, bytes) and text[:2] == GZIP_MAGIC:
            try:
                text = gunzip(text, max_bytes=MAX_PLAN_BYTES, what="(document)")
            except DecompressError as error:
                raise PlanError([str(error)], source) from None
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise PlanError([f"(document): not valid JSON: {error}"], source) from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as error:
            raise KareusError(f"cannot read plan {path}: {error.strerror or error}") from None
        return cls.loads(raw, source=f"plan {path}")


# ---------------------------------------------------------------------------------------------
# Building and reselecting


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The synchronous 1F1B issue order of one stage: warm-up forwards, steady F/B pairs, cool-down.

    Identical to `lowtime.perseus.schedule.Synchronous1F1B` (tested).
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("forward", m) for m in range(warmup)]
    for m in range(num_microbatches - warmup):
        order += [("forward", m + warmup), ("backward", m)]
    order += [("backward", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def plan_from_frontier(job: PlanJob, frontier: FrontierTable, objective: object, *,
                       provenance: Provenance,
                       baselines: Mapping[str, MethodFrontier] | None = None,
                       now: datetime | None = None) -> Plan:
    """The plan the objective picks from `frontier` (raises `KareusError` if none fits)."""
    chosen = parse_objective(objective)
    index = select_point(frontier.points(), chosen, steps=job.steps, now=now)
    row = frontier.rows[index]
    return Plan(job=job, objective=chosen.to_dict(), predicted=Prediction(row.time_s, row.energy_j),
                provenance=provenance, stages=frontier.stages_for(index), frontier=frontier,
                selected_row=index, baselines=dict(baselines or {}))


def reselect(plan: Plan, objective: object, *, steps: int | None = None,
             now: datetime | None = None) -> Plan:
    """The same frontier, another objective: no re-profiling, no re-solving.

    `steps` (remaining training steps) overrides the job's for whole-job budgets.
    """
    job = plan.job if steps is None else replace(plan.job, steps=steps)
    provenance = replace(plan.provenance, created=_now_text())
    return replace(plan_from_frontier(job, plan.frontier, objective, provenance=provenance,
                                      baselines=plan.baselines, now=now), job=plan.job,
                   power_limited_points=plan.power_limited_points)


def plan_at_row(plan: Plan, row: int) -> Plan:
    """The same plan (frontier, objective) running frontier row `row`: how a straggler or the
    cluster power budget moves a running job along its frontier."""
    chosen = plan.frontier.rows[row]
    return replace(plan, stages=plan.frontier.stages_for(row), selected_row=row,
                   predicted=Prediction(chosen.time_s, chosen.energy_j))


def _now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_length_encode(values: Sequence[int]) -> list[int]:
    """`[v0, n0, v1, n1, …]`: value and repeat count; 1F1B choices repeat a lot."""
    out: list[int] = []
    for v in values:
        if out and out[-2] == v:
            out[-1] += 1
        else:
            out += [v, 1]
    return out


def run_length_decode(encoded: Sequence[int]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(encoded) - 1, 2):
        out += [encoded[i]] * encoded[i + 1]
    return out


def _configs_to_dict(configs: ConfigMap) -> dict:
    return {name: {"launch_slot": c.launch_slot, "comm_sms": c.comm_sms} for name, c in sorted(configs.items())}


def _configs_from_dict(data: Mapping) -> dict[str, PartitionConfig]:
    return {name: PartitionConfig(c["launch_slot"], c["comm_sms"]) for name, c in data.items()}


# ---------------------------------------------------------------------------------------------
# Validation


@cache
def plan_schema() -> dict:
    """The plan's JSON Schema (draft 2020-12)."""
    return json.loads(resources.files("kareus").joinpath("plan_schema.json").read_text())


def validate_plan(data: object) -> list[str]:
    """Every problem of a plan document as `field.path: message`; empty when the plan is valid."""
    import jsonschema  # imported here: only validation needs it, not plan readers in hot loops

    validator = jsonschema.Draft202012Validator(plan_schema())
    errors = [f"{_json_path(e.absolute_path)}: {e.message}"
              for e in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))]
    if errors:
        return errors
    return list(_semantic_errors(data))


def _json_path(parts: Sequence[object]) -> str:
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text or "(document)"


def _semantic_errors(data: Mapping) -> Iterator[str]:
    try:
        job = PlanJob.from_dict(data["job"])
        workload = job.workload()
    except (KareusError, TypeError, ValueError) as error:
        yield f"job: does not describe a buildable workload: {error}"
        return
    if len(job.stage_layers) != job.pipeline or len(workload.stages) != job.pipeline:
        yield f"job.stage_layers: needs one entry per pipeline stage ({job.pipeline})"
        return
    clocks = set(job.clocks_mhz)
    yield from _stage_errors(data["stages"], job, workload, clocks)
    yield from _frontier_errors(data["frontier"], job, workload, clocks)
    if data.get("selected_row", 0) >= len(data["frontier"]["rows"]):
        yield f"selected_row: must index frontier.rows (0..{len(data['frontier']['rows']) - 1})"
    for k, point in enumerate(data.get("power_limited_points") or ()):
        if point["row"] >= len(data["frontier"]["rows"]):
            yield f"power_limited_points[{k}].row: must index frontier.rows (0..{len(data['frontier']['rows']) - 1})"
    try:
        parse_objective(data["objective"])
    except KareusError as error:
        yield str(error)


def _stage_errors(stages: Sequence[Mapping], job: PlanJob, workload: Workload,
                  clocks: set[int]) -> Iterator[str]:
    if len(stages) != job.pipeline:
        yield f"stages: needs {job.pipeline} entries (one per pipeline stage), got {len(stages)}"
        return
    for s, stage in enumerate(stages):
        path = f"stages[{s}]"
        if stage["stage"] != s:
            yield f"{path}.stage: must be {s}"
        expected = one_f_one_b(job.pipeline, job.num_micro_batches, s)
        got = [(i["kind"], i["microbatch"]) for i in stage["instructions"]]
        if got != expected:
            yield (f"{path}.instructions: must follow the 1F1B order "
                   f"{_order_text(expected)}, got {_order_text(got)}")
        for k, instr in enumerate(stage["instructions"]):
            yield from _option_errors(instr, f"{path}.instructions[{k}]", instr["kind"],
                                      workload.stages[s], workload, clocks)


def _order_text(order: Sequence[tuple[str, int]]) -> str:
    text = " ".join(f"{kind[0].upper()}{m}" for kind, m in order[:12])
    return text + (" …" if len(order) > 12 else "")


def _frontier_errors(frontier: Mapping, job: PlanJob, workload: Workload, clocks: set[int]) -> Iterator[str]:
    options = frontier["options"]
    if len(options) != job.pipeline:
        yield f"frontier.options: needs {job.pipeline} entries (one per pipeline stage), got {len(options)}"
        return
    for s, stage in enumerate(options):
        for kind in DIRECTIONS:
            for k, option in enumerate(stage[kind]):
                yield from _option_errors(option, f"frontier.options[{s}].{kind}[{k}]", kind,
                                          workload.stages[s], workload, clocks)
    for r, row in enumerate(frontier["rows"]):
        path = f"frontier.rows[{r}].choice"
        if len(row["choice"]) != job.pipeline:
            yield f"{path}: needs {job.pipeline} entries (one per stage), got {len(row['choice'])}"
            continue
        for s, pair in enumerate(row["choice"]):
            for d, kind in enumerate(DIRECTIONS):
                yield from _choice_errors(pair[d], f"{path}[{s}][{d}]", len(options[s][kind]),
                                          job.num_micro_batches)


def _choice_errors(encoded: Sequence[int], path: str, num_options: int, num_microbatches: int) -> Iterator[str]:
    if len(encoded) % 2:
        yield f"{path}: run-length list must have an even length ([option, count, …])"
        return
    values, counts = encoded[0::2], encoded[1::2]
    if any(v >= num_options for v in values):
        yield f"{path}: option index out of range (0..{num_options - 1})"
    if any(c < 1 for c in counts) or sum(counts) != num_microbatches:
        yield f"{path}: counts must be >= 1 and sum to num_micro_batches ({num_microbatches})"


def _option_errors(item: Mapping, path: str, kind: str, stage, workload: Workload,
                   clocks: set[int]) -> Iterator[str]:
    """Clock in the GPU's list; partitioned configs cover exactly the stage's partition types."""
    if item["clock_mhz"] not in clocks:
        yield f"{path}.clock_mhz: {item['clock_mhz']} is not a supported clock of the GPU"
    if item["mode"] == "sequential":
        for key in ("configs", "recompute_configs"):
            if item.get(key):
                yield f"{path}.{key}: must be empty for a sequential instruction"
        return
    instances = stage.forward_instances if kind == "forward" else stage.backward_instances
    ptypes = workload.partition_types
    yield from _config_errors(item.get("configs", {}), f"{path}.configs", instances, ptypes)
    recompute = stage.recompute_instances if kind == "backward" else {}
    yield from _config_errors(item.get("recompute_configs", {}), f"{path}.recompute_configs", recompute,
                              ptypes)


def _config_errors(configs: Mapping, path: str, instances: Mapping[str, int],
                   ptypes: Mapping) -> Iterator[str]:
    wanted = {name for name, count in instances.items() if count > 0}
    for name in sorted(wanted - set(configs)):
        yield f"{path}.{name}: missing; every partition type of the stage needs a config"
    for name, config in sorted(configs.items()):
        if name not in wanted:
            allowed = ", ".join(sorted(wanted)) or "none"
            yield f"{path}.{name}: unknown partition type here; allowed: {allowed}"
            continue
        yield from _partition_config_errors(config, f"{path}.{name}", ptypes[name])


def _partition_config_errors(config: Mapping, path: str, ptype) -> Iterator[str]:
    name = ptype.name
    if config["launch_slot"] not in ptype.launch_slots:
        yield (f"{path}.launch_slot: {config['launch_slot']!r} is not a launch slot of {name}; "
               f"allowed: {', '.join(ptype.launch_slots)}")
    if config["comm_sms"] not in ptype.comm_sms_grid:
        grid = list(ptype.comm_sms_grid)
        yield f"{path}.comm_sms: {config['comm_sms']} is not in the SM grid of {name} ({grid[0]}..{grid[-1]})"
