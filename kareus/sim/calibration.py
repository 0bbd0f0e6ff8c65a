"""Calibrating the simulated GPU: measurement targets, what the simulator predicts for them, and a
bounded least-squares fit of a documented subset of its parameters.

A `Target` is one measured (or published) number and what it is a number *of*: a probe (time,
energy, power or clock of a piece of work; a ratio between two clocks; a study-level figure such as
"the best overlapped schedule's energy reduction over sequential execution") on a workload (model
preset and layout), a GPU preset and optionally a board power limit. `predict` evaluates a target
on a `SimCalibration`; `fit` moves the chosen parameters within their physical bounds
(`FITTABLE`, `GPU_FITTABLE`) with `scipy.optimize.least_squares` to minimise the scaled errors of
the *fit* targets, and reports the errors of the fit and the *held-out* targets separately.

The calibration is pre-registered: every row of a target file names its split, and a row whose
split is not the one it was registered with (`registered`) needs a `# label-change:` line in the
file giving the date and the reason (`read_target_file`); a row registered held-out is never
fitted, whatever its label says now (`check_preregistration`; `fit` itself refuses it, `refuse_held_out`). `# model-choice:`
lines record the other decisions taken after results were seen (a parameter left out, a target
that also appears as a result).

Targets come from a CSV of published points (`read_csv`: one row per target, the `Target` field
names as columns), the device-check JSON (`read_device_check`: its `profiler` section, emulated
partitions at whatever clock the GPU ran, and its `interference` section's NVML energy windows, an
op alone, beside a copy on K SMs and the copy alone on K SMs, which settle what exposed
communication draws) or an NVML profile store with its job
(`from_profile_store`). Errors: relative for absolute quantities (time, energy, power, clock,
throughput, ratios between clocks), absolute (in fraction points) for reductions and excesses.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from kareus.errors import KareusError
from kareus.sim.gpus import GPU_FITTABLE, get_gpu
from kareus.sim.measurement import Measurement
from kareus.sim.paramsfile import SimCalibration
from kareus.sim.physics import FITTABLE, Physics
from kareus.sim.simulator import Simulator
from kareus.workload.models import get_shape
from kareus.workload.ops import BYTES_PER_ELEMENT, CommOp, ComputeOp, LayerDims, layer_sequential_forward
from kareus.workload.partitions import PartitionType, Workload, build_workload, slot_names

SPLITS = ("fit", "holdout")
SHIPPED_TARGETS = Path(__file__).parent / "data" / "a100-targets.csv"  # the A100 fit's pre-registered points
STUDY_SMS = tuple(range(1, 31))  # the paper's single-layer study: 1..30 comm SMs

# probe → (unit, error kind, default tolerance). Tolerance scales a residual: an error of one
# tolerance counts as 1 in the least-squares sum.
PROBES: dict[str, tuple[str, str, float]] = {
    "time_s": ("s", "relative", 0.03),
    "energy_j": ("J", "relative", 0.03),
    "avg_power_w": ("W", "relative", 0.03),
    "avg_clock_mhz": ("MHz", "relative", 0.01),
    "time_ratio": ("ratio", "relative", 0.01),
    "energy_ratio": ("ratio", "relative", 0.01),
    "energy_min_clock_mhz": ("MHz", "relative", 0.03),
    "best_vs_sequential_energy_reduction": ("fraction", "absolute", 0.02),
    "best_vs_sequential_time_reduction": ("fraction", "absolute", 0.02),
    "best_vs_nanobatching_energy_reduction": ("fraction", "absolute", 0.02),
    "best_vs_nanobatching_time_reduction": ("fraction", "absolute", 0.02),
    "schedule_energy_spread": ("ratio", "relative", 0.05),
    "slot_energy_excess": ("fraction", "absolute", 0.005),
    "sms_energy_excess": ("fraction", "absolute", 0.005),
    "megatron_tflops_per_gpu": ("TFLOP/s", "relative", 0.05),
    "nanobatching_time_ratio": ("ratio", "relative", 0.02),
}
WORKS = ("partition", "sequential:layers", "sequential:partition", "instruction", "device_window")


@dataclass(frozen=True)
class Target:
    """One number to reproduce, and what it is a number of (see the module docstring).

    `work` says what a time/energy/power/clock probe measures: `partition` (one partition of type
    `partition` at `launch_slot`, `comm_sms`), `sequential:partition` (that type's work run
    Megatron-style, per nanobatch), `sequential:layers` (`layers` layers' forward passes of a
    microbatch, Megatron-style), `instruction` (stage `stage`'s `direction` instruction,
    Megatron-style) or `device_window` (one iteration of an NVML energy window of
    `bench/device_check.py`'s interference section: `op_count` × `op`, alone when `comm_sms` is 0,
    else beside one local copy on `comm_sms` blocks that lasts `copy_s` alone, both started
    together; with no op (`op` "", `op_count` 0) that copy alone, every other SM idle — the
    exposed phase itself; see `device_window_measurement`). Study probes use `partition` and `clock_mhz`; ratio
    probes `ref_clock_mhz`; `energy_min_clock_mhz` the clocks in `clocks_mhz`."""

    name: str
    probe: str
    value: float
    unit: str
    split: str = "fit"
    gpu: str = "A100-SXM4-40GB"
    power_limit_w: float | None = None
    model: str = "llama3.2-3b"
    tp: int = 1
    cp: int = 1
    pp: int = 1
    seq_len: int = 4096
    micro_batch_size: int = 2
    layers: int = 1
    work: str = "partition"
    partition: str = ""
    launch_slot: str = ""
    comm_sms: int = 0
    stage: int = 0
    direction: str = "forward"
    clock_mhz: int = 1410
    ref_clock_mhz: int = 0
    clocks_mhz: tuple[int, ...] = ()
    tolerance: float = 0.0
    source: str = ""
    registered: str = ""  # the split at pre-registration; empty: the same as `split`
    op: str = ""  # work `device_window`: the device check's foreground op (`DEVICE_CHECK_OPS`; "": none)
    op_count: int = 0  # work `device_window`: ops per iteration of the window (0: the copy alone)
    copy_s: float = 0.0  # work `device_window`: the copy run's measured time alone on `comm_sms` blocks

    @property
    def registered_split(self) -> str:
        return self.registered or self.split

    @property
    def error_kind(self) -> str:
        return PROBES[self.probe][1]

    @property
    def scale(self) -> float:
        return self.tolerance or PROBES[self.probe][2]

    def error(self, predicted: float) -> float:
        """Signed error: relative ((predicted − value)/value) or absolute (predicted − value)."""
        if self.error_kind == "relative":
            return (predicted - self.value) / abs(self.value)
        return predicted - self.value


_FIELD_TYPES = {f.name: f.type for f in fields(Target)}


def make_target(row: Mapping[str, Any], where: str) -> Target:
    """A `Target` from a mapping of field names to (string or typed) values; one `KareusError`
    naming the field otherwise."""
    if None in row:
        raise KareusError(f"{where}: more cells than header columns (quote cells that contain commas)")
    unknown = [key for key in row if key not in _FIELD_TYPES]
    if unknown:
        raise KareusError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(_FIELD_TYPES)}")
    values: dict[str, Any] = {}
    for key, raw in row.items():
        if raw is None or raw == "":
            continue
        kind = _FIELD_TYPES[key]
        try:
            if kind == "int":
                values[key] = int(float(raw))
            elif kind in ("float", "float | None"):
                values[key] = float(raw)
            elif kind == "tuple[int, ...]":
                values[key] = tuple(int(x) for x in (raw.split(";") if isinstance(raw, str) else raw))
            else:
                values[key] = str(raw)
        except (TypeError, ValueError):
            raise KareusError(f"{where}: {key} must be a {kind}, got {raw!r}") from None
    for required in ("name", "probe", "value", "unit"):
        if required not in values:
            raise KareusError(f"{where}: missing field {required!r}")
    target = Target(**values)
    if target.probe not in PROBES:
        raise KareusError(f"{where}: probe {target.probe!r} unknown; allowed: {', '.join(PROBES)}")
    unit = PROBES[target.probe][0]
    if target.unit != unit:
        raise KareusError(f"{where}: unit of probe {target.probe} must be {unit!r}, got {target.unit!r}")
    if target.split not in SPLITS:
        raise KareusError(f"{where}: split must be one of {', '.join(SPLITS)}, got {target.split!r}")
    if target.registered not in ("", *SPLITS):
        raise KareusError(f"{where}: registered must be one of {', '.join(SPLITS)} (or empty: the split), "
                          f"got {target.registered!r}")
    if target.work not in WORKS:
        raise KareusError(f"{where}: work must be one of {', '.join(WORKS)}, got {target.work!r}")
    if not math.isfinite(target.value) or (target.error_kind == "relative" and target.value == 0):
        raise KareusError(f"{where}: value must be a finite number (non-zero for a relative probe), "
                          f"got {target.value!r}")
    if target.work == "device_window":
        if target.op not in DEVICE_CHECK_OPS and target.op != "":
            raise KareusError(f"{where}: op must be one of {', '.join(DEVICE_CHECK_OPS)}, or empty for the copy "
                              f"alone, for work device_window, got {target.op!r}")
        if target.op == "":
            if target.op_count != 0 or target.comm_sms < 1 or target.copy_s <= 0:
                raise KareusError(f"{where}: a device_window without an op (the copy alone) needs op_count 0, "
                                  "comm_sms >= 1 and copy_s > 0")
        elif target.op_count < 1 or target.comm_sms < 0 or (target.comm_sms > 0) != (target.copy_s > 0):
            raise KareusError(f"{where}: a device_window needs op_count >= 1, and comm_sms >= 1 with copy_s > 0 "
                              "(a copy beside the op) or both 0 (the op alone)")
    get_gpu(target.gpu)
    get_shape(target.model)
    return target


LABEL_CHANGE = "# label-change:"
MODEL_CHOICE = "# model-choice:"


@dataclass(frozen=True)
class LabelChange:
    """A row's split changed after its registration: when, from what to what, and why."""

    date: str
    row: str
    from_split: str
    to_split: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"date": self.date, "row": self.row, "from": self.from_split, "to": self.to_split,
                "reason": self.reason}


@dataclass(frozen=True)
class ModelChoice:
    """A decision about the model or the fit taken after results were seen (not a row's label)."""

    date: str
    subject: str
    choice: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"date": self.date, "subject": self.subject, "choice": self.choice, "reason": self.reason}


@dataclass(frozen=True)
class TargetFile:
    """A target file: its rows and the history of its labels and of the choices results informed."""

    targets: tuple[Target, ...]
    label_changes: tuple[LabelChange, ...] = ()
    model_choices: tuple[ModelChoice, ...] = ()

    def history(self) -> dict[str, list[dict[str, str]]]:
        return {"label_changes": [c.to_dict() for c in self.label_changes],
                "model_choices": [c.to_dict() for c in self.model_choices]}


def _history_fields(line: str, prefix: str, where: str, count: int) -> list[str]:
    parts = [part.strip() for part in line[len(prefix):].split(" | ")]
    if len(parts) != count or not all(parts):
        raise KareusError(f"{where}: a {prefix[2:-1]} line is 'DATE | ' followed by {count - 1} non-empty "
                          f"fields separated by ' | ', got {line!r}")
    try:
        datetime.date.fromisoformat(parts[0])
    except ValueError:
        raise KareusError(f"{where}: date must be YYYY-MM-DD, got {parts[0]!r}") from None
    return parts


def _label_change(line: str, where: str) -> LabelChange:
    date, row, change, reason = _history_fields(line, LABEL_CHANGE, where, 4)
    labels = [label.strip() for label in change.split("->")]
    if len(labels) != 2 or not all(label in SPLITS for label in labels) or labels[0] == labels[1]:
        raise KareusError(f"{where}: a label change is 'FROM -> TO' with two different splits of "
                          f"{', '.join(SPLITS)}, got {change!r}")
    return LabelChange(date, row, labels[0], labels[1], reason)


def read_target_file(path: str | Path) -> TargetFile:
    """A CSV with the `Target` field names as header (`#` lines are comments, except the history
    lines `# label-change: DATE | ROW | FROM -> TO | REASON` and `# model-choice: DATE | SUBJECT |
    CHOICE | REASON`); every row must name its split, and the labels must be as registered
    (`check_preregistration`)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise KareusError(f"{path}: cannot read ({error.strerror or error})") from None
    lines, numbers, changes, choices = [], [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(LABEL_CHANGE):
            changes.append(_label_change(line, f"{path}:{number}"))
        elif line.startswith(MODEL_CHOICE):
            choices.append(ModelChoice(*_history_fields(line, MODEL_CHOICE, f"{path}:{number}", 4)))
        elif line.strip() and not line.startswith("#"):
            lines.append(line)
            numbers.append(number)
    rows = list(csv.DictReader(lines))
    targets = []
    for row, number in zip(rows, numbers[1:], strict=True):
        where = f"{path}:{number}"
        target = make_target(row, where)
        if not row.get("split"):
            raise KareusError(f"{where}: row {target.name!r} has no split; label every row "
                              f"{' or '.join(SPLITS)} before fitting (pre-registration)")
        targets.append(target)
    check_preregistration(targets, changes, str(path))
    return TargetFile(tuple(targets), tuple(changes), tuple(choices))


def read_csv(path: str | Path) -> list[Target]:
    """The targets of `read_target_file(path)`."""
    return list(read_target_file(path).targets)


def refuse_held_out(targets: Sequence[Target], where: str = "calibrate") -> None:
    """One `KareusError` naming the first row registered held-out that is labelled fit."""
    for t in targets:
        if t.registered_split == "holdout" and t.split == "fit":
            raise KareusError(f"{where}: row {t.name!r} is registered held-out; calibrate does not fit on "
                              "held-out rows (its result has been seen): label it split=holdout")


def check_preregistration(targets: Sequence[Target], changes: Sequence[LabelChange] = (), where: str = "calibrate"
                          ) -> None:
    """Refuse a fit on held-out rows: a row registered held-out is never fitted; a row whose label
    is not its registered one needs a recorded change from that label to this one; a recorded
    change must name a row of the file. One `KareusError` naming the row."""
    names = {t.name for t in targets}
    for change in changes:
        if change.row not in names:
            raise KareusError(f"{where}: label change of {change.row!r} ({change.date}) names no row of the file")
    refuse_held_out(targets, where)
    for t in targets:
        if t.split != t.registered_split and not any(
                c.row == t.name and c.from_split == t.registered_split and c.to_split == t.split for c in changes):
            raise KareusError(f"{where}: row {t.name!r} was registered {t.registered_split} and is now {t.split}; "
                              f"record the change as '{LABEL_CHANGE} DATE | {t.name} | "
                              f"{t.registered_split} -> {t.split} | REASON'")


# -- what the simulator predicts -----------------------------------------------------------------
class Predictor:
    """Evaluates targets on one calibration, sharing simulators and workloads between them."""

    def __init__(self, calibration: SimCalibration) -> None:
        self.calibration = calibration
        self._simulators: dict[tuple, Simulator] = {}  # (GPU, limit), or ("local copy", GPU, limit)
        self._workloads: dict[tuple, Workload] = {}

    def simulator(self, target: Target) -> Simulator:
        key = (target.gpu, target.power_limit_w)
        if key not in self._simulators:
            self._simulators[key] = Simulator(self.calibration.gpu(target.gpu), params=self.calibration.params,
                                              power_limit_w=target.power_limit_w)
        return self._simulators[key]

    def local_copy_simulator(self, target: Target) -> Simulator:
        """The twin for a copy between two buffers of one GPU (the device check's copy kernel): the
        collective's copy kernel with no link — no NVLink cap on its rate (HBM contention bounds it)
        and no NVLink energy — everything else (its SMs' power, HBM traffic, interference) as is."""
        key = ("local copy", target.gpu, target.power_limit_w)
        if key not in self._simulators:
            spec = replace(self.calibration.gpu(target.gpu), nvlink_gb_per_s=math.inf)
            self._simulators[key] = Simulator(spec, params=replace(self.calibration.params, link_pj_per_byte=0.0),
                                              power_limit_w=target.power_limit_w)
        return self._simulators[key]

    def workload(self, t: Target) -> Workload:
        key = (t.model, t.tp, t.cp, t.pp, t.seq_len, t.micro_batch_size)
        if key not in self._workloads:
            self._workloads[key] = build_workload(get_shape(t.model), tp=t.tp, cp=t.cp, pp=t.pp, seq_len=t.seq_len,
                                                  micro_batch_size=t.micro_batch_size)
        return self._workloads[key]

    def ptype(self, t: Target) -> PartitionType:
        return self.workload(t).partition_type(t.partition)

    def measure(self, t: Target, clock_mhz: int) -> Measurement:
        sim = self.simulator(t)
        if t.work == "sequential:layers":
            dims = LayerDims(get_shape(t.model), t.tp, t.cp, t.micro_batch_size, t.seq_len // t.cp)
            return sim.sequential(layer_sequential_forward(dims) * t.layers, clock_mhz)
        if t.work == "instruction":
            stages = self.workload(t).stages
            if not 0 <= t.stage < len(stages):
                raise KareusError(f"target {t.name}: stage {t.stage} outside 0..{len(stages) - 1}")
            return sim.instruction(stages[t.stage], t.direction, clock_mhz, None)
        if t.work == "sequential:partition":
            return sim.sequential_partition(self.ptype(t), clock_mhz)
        if t.work == "device_window":
            return device_window_measurement(sim if t.comm_sms == 0 else self.local_copy_simulator(t), t, clock_mhz)
        return sim.partition(self.ptype(t), clock_mhz, t.comm_sms, t.launch_slot)

    def study(self, t: Target, clock_mhz: int) -> dict[tuple[str, int], Measurement]:
        ptype, sim = self.ptype(t), self.simulator(t)
        return {(slot, sms): sim.partition(ptype, clock_mhz, sms, slot)
                for slot in ptype.launch_slots for sms in STUDY_SMS}

    def predict(self, t: Target) -> float:
        probe = t.probe
        if probe in ("time_s", "energy_j", "avg_power_w", "avg_clock_mhz"):
            return float(getattr(self.measure(t, t.clock_mhz), probe))
        if probe in ("time_ratio", "energy_ratio"):
            attr = "time_s" if probe == "time_ratio" else "energy_j"
            return getattr(self.measure(t, t.clock_mhz), attr) / getattr(self.measure(t, t.ref_clock_mhz), attr)
        if probe == "energy_min_clock_mhz":
            clocks = t.clocks_mhz or tuple(c for c in get_gpu(t.gpu).search_clocks_mhz)
            return float(min(clocks, key=lambda c: self.measure(t, c).energy_j))
        if probe == "megatron_tflops_per_gpu":
            return self.megatron_tflops(t)
        if probe == "nanobatching_time_ratio":
            return self.nanobatching_time_ratio(t)
        grid = self.study(t, t.clock_mhz)
        best = min(grid.values(), key=lambda m: m.energy_j)
        if probe.startswith("best_vs_"):
            sim = self.simulator(t)
            ptype = self.ptype(t)
            if "sequential" in probe:
                other = sim.sequential_partition(ptype, t.clock_mhz)
            else:
                default = ptype.default_config()
                other = sim.partition(ptype, t.clock_mhz, default.comm_sms, default.launch_slot)
            attr = "energy_j" if "energy" in probe else "time_s"
            return 1.0 - getattr(best, attr) / getattr(other, attr)
        if probe == "schedule_energy_spread":
            return max(m.energy_j for m in grid.values()) / best.energy_j
        if probe == "slot_energy_excess":
            at_slot = min(m.energy_j for (slot, _), m in grid.items() if slot == t.launch_slot)
            return at_slot / best.energy_j - 1.0
        if probe == "sms_energy_excess":
            at_slot = min(m.energy_j for (slot, _), m in grid.items() if slot == t.launch_slot)
            return grid[(t.launch_slot, t.comm_sms)].energy_j / at_slot - 1.0
        raise KareusError(f"target {t.name}: probe {probe!r} unknown; allowed: {', '.join(PROBES)}")

    def nanobatching_time_ratio(self, t: Target) -> float:
        """Forward + backward time of stage `stage` under plain nanobatching (every partition at
        its default launch and SMs) over the same instructions run Megatron-style."""
        workload, sim = self.workload(t), self.simulator(t)
        stage = workload.stages[t.stage]
        configs = {name: ptype.default_config() for name, ptype in workload.partition_types.items()}
        split = sum(sim.instruction(stage, d, t.clock_mhz, configs).time_s for d in ("forward", "backward"))
        whole = sum(sim.instruction(stage, d, t.clock_mhz, None).time_s for d in ("forward", "backward"))
        return split / whole

    def megatron_tflops(self, t: Target) -> float:
        """Model FLOPs per second per GPU of Megatron-style 1F1B in steady state (bubble excluded):
        the slowest stage's forward + backward (with recompute) per microbatch."""
        shape = get_shape(t.model)
        workload = self.workload(t)
        sim = self.simulator(t)
        tokens = t.micro_batch_size * t.seq_len
        h = shape.hidden_size
        layer = h * (shape.q_size + 2 * shape.kv_size) + shape.q_size * h + 3 * h * shape.ffn_hidden_size
        attention = 2 * 2 * tokens * t.seq_len / 2 * shape.q_size * shape.num_layers
        model_flops = 6 * layer * shape.num_layers * tokens + 6 * h * shape.vocab_size * tokens + 3 * attention
        stage_s = max(sim.instruction(stage, "forward", t.clock_mhz, None).time_s
                      + sim.instruction(stage, "backward", t.clock_mhz, None).time_s for stage in workload.stages)
        return model_flops / stage_s / (t.tp * t.cp * t.pp) / 1e12


def predict_all(calibration: SimCalibration, targets: Sequence[Target]) -> list[float]:
    predictor = Predictor(calibration)
    return [predictor.predict(t) for t in targets]


# -- the fit ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One target after the fit."""

    target: Target
    predicted: float
    error: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.target.name, "split": self.target.split, "probe": self.target.probe,
                "unit": self.target.unit, "target": self.target.value, "value": self.predicted,
                "error": self.error, "error_kind": self.target.error_kind, "source": self.target.source,
                "registered": self.target.registered_split}


@dataclass(frozen=True)
class FitResult:
    """The fitted calibration, the parameters it moved, and every target's error."""

    calibration: SimCalibration
    fitted: dict[str, float]
    rows: tuple[Row, ...]
    evaluations: int
    history: Mapping[str, Any] = field(default_factory=dict)  # the target file's (`TargetFile.history`)

    def errors(self, split: str, kind: str) -> list[float]:
        return [r.error for r in self.rows if r.target.split == split and r.target.error_kind == kind]

    def summary(self) -> dict[str, Any]:
        """Root-mean-square error per split and error kind (relative errors and fraction points)."""
        out: dict[str, Any] = {}
        for split in SPLITS:
            for kind in ("relative", "absolute"):
                errors = self.errors(split, kind)
                if errors:
                    out[f"{split}_{kind}_rms"] = math.sqrt(statistics.fmean(e * e for e in errors))
                    out[f"{split}_{kind}_max"] = max(abs(e) for e in errors)
        return out

    def to_fit_record(self) -> dict[str, Any]:
        return {"fitted": self.fitted, "evaluations": self.evaluations, **self.summary(),
                "targets": [r.to_dict() for r in self.rows], **({"history": dict(self.history)} if self.history else {})}


def parameter_bounds(name: str) -> tuple[float, float]:
    """Bounds of a fittable parameter: `NAME` (SimParams) or `gpu.FIELD` (the targets' GPUs)."""
    if name.startswith("gpu."):
        field_name = name[4:]
        if field_name not in GPU_FITTABLE:
            raise KareusError(f"--fit: {name!r} is not a fittable GPU field; allowed: "
                              f"{', '.join('gpu.' + f for f in GPU_FITTABLE)}")
        return GPU_FITTABLE[field_name]
    if name not in FITTABLE:
        raise KareusError(f"--fit: {name!r} is not a fittable parameter; allowed: "
                          f"{', '.join([*FITTABLE, *('gpu.' + f for f in GPU_FITTABLE)])}")
    return FITTABLE[name]


def with_values(base: SimCalibration, names: Sequence[str], values: Iterable[float],
                gpus: Sequence[str]) -> SimCalibration:
    """`base` with the named parameters set (GPU fields on every GPU in `gpus`)."""
    params: dict[str, float] = {}
    gpu_values: dict[str, float] = {}
    for name, value in zip(names, values, strict=True):
        if name.startswith("gpu."):
            gpu_values[name[4:]] = float(value)
        else:
            params[name] = float(value)
    merged = {gpu: {**base.gpus.get(gpu, {}), **gpu_values} for gpu in {*base.gpus, *gpus}}
    return replace(base, params=replace(base.params, **params), gpus=merged)


def current_value(calibration: SimCalibration, name: str, gpu: str) -> float:
    if name.startswith("gpu."):
        return float(getattr(calibration.gpu(gpu), name[4:]))
    return float(getattr(calibration.params, name))


def fit(targets: Sequence[Target], names: Sequence[str], start: SimCalibration | None = None, *,
        max_evaluations: int = 400, on_evaluation: Callable[[int, float], None] | None = None,
        history: Mapping[str, Any] | None = None) -> FitResult:
    """Least squares with bounds over `names`, on the fit targets (never a row registered held-out);
    every target is reported, and `history` (the target file's) goes into the fit record."""
    from scipy.optimize import least_squares

    start = start or SimCalibration()
    refuse_held_out(targets)
    fit_set = [t for t in targets if t.split == "fit"]
    holdout = [t for t in targets if t.split == "holdout"]
    if not fit_set:
        raise KareusError("calibrate: the fit set is empty (every target has split=holdout); "
                          "mark some targets split=fit")
    if not holdout:
        raise KareusError("calibrate: the held-out set is empty (every target has split=fit); "
                          "mark some targets split=holdout so the fit can be judged")
    if not names:
        raise KareusError("--fit: name at least one parameter to fit")
    duplicates = {n for n in names if list(names).count(n) > 1}
    if duplicates:
        raise KareusError(f"--fit: {sorted(duplicates)[0]!r} named twice")
    bounds = [parameter_bounds(name) for name in names]
    gpus = sorted({get_gpu(t.gpu).name for t in targets})
    x0 = []
    for name, (low, high) in zip(names, bounds, strict=True):
        value = current_value(start, name, gpus[0])
        x0.append(min(max((value - low) / (high - low), 0.0), 1.0))
    evaluations = 0

    def residuals(x: np.ndarray) -> np.ndarray:
        nonlocal evaluations
        evaluations += 1
        calibration = with_values(start, names, _denormalise(x, bounds), gpus)
        predicted = predict_all(calibration, fit_set)
        out = np.array([t.error(p) / t.scale for t, p in zip(fit_set, predicted, strict=True)])
        if on_evaluation is not None:
            on_evaluation(evaluations, float(np.sum(out * out)))
        return out

    solution = least_squares(residuals, np.array(x0), bounds=(0.0, 1.0), diff_step=1e-3, x_scale=1.0,
                             max_nfev=max_evaluations, method="trf")
    values = _denormalise(solution.x, bounds)
    calibration = with_values(start, names, values, gpus)
    predicted = predict_all(calibration, targets)
    rows = tuple(Row(t, p, t.error(p)) for t, p in zip(targets, predicted, strict=True))
    fitted = {name: float(v) for name, v in zip(names, values, strict=True)}
    result = FitResult(calibration, fitted, rows, evaluations, history or {})
    return replace(result, calibration=replace(calibration, fit=result.to_fit_record()))


def evaluate(calibration: SimCalibration, targets: Sequence[Target],
             history: Mapping[str, Any] | None = None) -> FitResult:
    """Every target's error under `calibration`, nothing fitted."""
    predicted = predict_all(calibration, targets)
    rows = tuple(Row(t, p, t.error(p)) for t, p in zip(targets, predicted, strict=True))
    return FitResult(calibration, {}, rows, 1, history or {})


def _denormalise(x: Sequence[float], bounds: Sequence[tuple[float, float]]) -> list[float]:
    return [low + float(v) * (high - low) for v, (low, high) in zip(x, bounds, strict=True)]


# -- measurement sources ---------------------------------------------------------------------------
# The device check's profiler section measures one GPU's share of this layout (bench/device_check.py).
DEVICE_CHECK_LAYOUT = {"tp": 2, "cp": 1, "pp": 1, "seq_len": 4096, "micro_batch_size": 2}
DEVICE_CHECK_SECTIONS = ("profiler", "interference")
# The interference section's foreground ops (bench/device_check.py, `CudaTimer.ops`) as the twin's
# kernels: `a @ a` on one 8192 × 8192 bf16 matrix (reads it twice, writes the product) and
# `torch.add(x, y, out=z)` on 2^26 bf16 elements (two reads and one write per element).
_GEMM_N = 8192
_ADD_ELEMENTS = 1 << 26
DEVICE_CHECK_OPS: dict[str, ComputeOp] = {
    "gemm_bf16_8192": ComputeOp("gemm_bf16_8192", "gemm", 2.0 * _GEMM_N ** 3, 3.0 * _GEMM_N ** 2 * BYTES_PER_ELEMENT,
                                "linear", rows=_GEMM_N, cols=_GEMM_N, depth=_GEMM_N),
    "add_bf16_64M": ComputeOp("add_bf16_64M", "memory", float(_ADD_ELEMENTS), 3.0 * _ADD_ELEMENTS * BYTES_PER_ELEMENT,
                              "activation"),
}
# `energy.per_iteration` of the interference section: an op+copyK iteration runs this many op
# windows (`op_reps` ops each) beside one copy run; an op-alone iteration runs one.
DEVICE_CHECK_OP_WINDOWS_BESIDE_COPY = 4


def local_copy(physics: Physics, blocks: int, alone_s: float) -> CommOp:
    """The device check's copy kernel as the twin's copy: a ring step that reads and writes HBM
    (an all-gather's 2 HBM bytes per byte, i.e. read source, write destination) on `blocks` SMs,
    sized so that alone it lasts the measured `alone_s` (`Physics.comm_rate`, `comm_duration_s`,
    `contention`, as the timeline plays it)."""
    rate = physics.comm_rate(blocks)
    slowdown = physics.contention(physics.params.comm_hbm_bytes_per_ring_byte("all_gather") * rate)
    ring_bytes = max(alone_s / slowdown - physics.params.comm_step_latency_s, 0.0) * rate
    return CommOp("device check copy", "all_gather", "tp", 2, 2.0 * ring_bytes)  # ring bytes = payload/2


def device_window_measurement(sim: Simulator, t: Target, clock_mhz: float) -> Measurement:
    """One iteration of a device-check energy window on the twin: `op_count` × `op` back to back
    (Megatron-style kernels), or beside a copy on `comm_sms` blocks launched with the first op, each
    op on the SMs the copy leaves until the copy ends, then a join — the twin's partition timeline
    with the copy as its collective (`sim` a `Predictor.local_copy_simulator`). With no op the
    same timeline has nothing to overlap: the copy runs exposed on its `comm_sms` SMs (their
    `activity_comm`, its HBM traffic; the other SMs idle, P_static only) at the clock, then the join."""
    ops = (DEVICE_CHECK_OPS[t.op],) * t.op_count if t.op else ()
    if t.comm_sms == 0:
        return sim.sequential(ops, clock_mhz)
    copy = local_copy(sim.physics, t.comm_sms, t.copy_s)
    if not ops:
        return sim.exposed(copy, clock_mhz, t.comm_sms)
    ptype = PartitionType(f"{t.op}+copy{t.comm_sms}", "forward", ops, copy, (slot_names(ops)[0],), (t.comm_sms,),
                          "small")
    return sim.partition(ptype, clock_mhz, t.comm_sms, ptype.launch_slots[0])


@dataclass(frozen=True)
class DeviceCheckTargets:
    """The targets of a device-check report, and a note for each wanted section that gave none."""

    targets: tuple[Target, ...]
    notes: tuple[str, ...] = ()


def read_device_check(path: str | Path, holdout_every: int = 3,
                      sections: Sequence[str] = DEVICE_CHECK_SECTIONS) -> DeviceCheckTargets:
    """Targets from `bench/device_check.py`'s JSON, section by section (`sections`, in order):

    - `profiler`: each emulated partition with an NVML energy window gives a time target (CUDA
      events) and an energy target (the window's energy per run) at the median SM clock read inside
      the window;
    - `interference`: each NVML energy window (`op` alone, `op+copyK`, `copyK`) gives a time and an
      average power target per iteration at the median SM clock read inside it (`device_window`
      targets; the copy's time alone on K blocks comes from the matrix row of that copy). The
      op-alone windows pin the op's own power; beside the copy the difference is the copy's K SMs
      (`activity_comm`) and its HBM traffic, but the op outlasts the copy there, so the copy-alone
      windows (`copyK`: op "", op_count 0) are the exposed phase proper — K SMs at `activity_comm`,
      the copy's HBM traffic and every other SM idle at the working clock — what an exposed
      collective draws (docs/simulator.md, "Exposed communication"). The spinner-alone windows
      (`spinK`) are a note, not targets (`SPINNER_NOT_A_TARGET`).

    Every `holdout_every`-th measurement over all of them is held out (`assign_splits`). A section
    that did not run, or gave no usable window, is a note; when none of `sections` gives a target,
    one `KareusError` names each one's reason."""
    unknown = [name for name in sections if name not in DEVICE_CHECK_SECTIONS]
    if unknown or not sections:
        raise KareusError(f"--device-check-sections: {unknown[0] if unknown else 'nothing'!r} is not a section "
                          f"calibrate reads; allowed: {', '.join(DEVICE_CHECK_SECTIONS)}")
    data = _json(path)
    if data.get("schema") != "kareus.device_check":
        raise KareusError(f"{path}: not a device-check report (schema {data.get('schema')!r}, "
                          "expected 'kareus.device_check')")
    readers = {"profiler": _profiler_targets, "interference": _interference_targets}
    targets: list[Target] = []
    notes: list[str] = []
    for name in sections:
        section = data.get("sections", {}).get(name, {})
        if section.get("status") != "ok":
            notes.append(f"its {name} section did not run ({section.get('status', 'missing')}: "
                         f"{section.get('reason') or section.get('error') or 'no result'})")
            continue
        found, why = readers[name](path, data, section["result"])
        targets.extend(found)
        if why:
            notes.append(why)
    if not targets:
        raise KareusError(f"{path}: {'; '.join(notes)}; nothing to fit")
    return DeviceCheckTargets(tuple(assign_splits(targets, holdout_every)), tuple(notes))


def from_device_check(path: str | Path, holdout_every: int = 3,
                      sections: Sequence[str] = DEVICE_CHECK_SECTIONS) -> list[Target]:
    """The targets of `read_device_check` (its notes dropped)."""
    return list(read_device_check(path, holdout_every, sections).targets)


def _profiler_targets(path: str | Path, data: Mapping[str, Any], result: Mapping[str, Any]
                      ) -> tuple[list[Target], str | None]:
    gpu = _device_gpu(data, result)
    targets: list[Target] = []
    for row in result.get("rows", []):
        window = row.get("window") or {}
        clocks = window.get("sm_clock_mhz_inside") or []
        if "time_s" not in row or "energy_j" not in window or not clocks:
            continue
        clock = int(statistics.median(clocks))
        base = {"gpu": gpu, "model": result.get("preset", "llama3.1-8b"), "work": "partition",
                "partition": row["type"], "launch_slot": row["launch_slot"], "comm_sms": row["comm_sms"],
                "clock_mhz": clock, "source": f"device check {Path(path).name}", **DEVICE_CHECK_LAYOUT}
        name = f"{row['type']}@{row['launch_slot']}/{row['comm_sms']} {clock} MHz"
        targets.append(make_target({**base, "name": f"{name} time", "probe": "time_s", "value": row["time_s"],
                                    "unit": "s"}, str(path)))
        targets.append(make_target({**base, "name": f"{name} energy", "probe": "energy_j",
                                    "value": window["energy_j"], "unit": "J"}, str(path)))
    why = None if targets else "its profiler section has no rows with an energy window and clock readings"
    return targets, why


def _interference_targets(path: str | Path, data: Mapping[str, Any], result: Mapping[str, Any]
                          ) -> tuple[list[Target], str | None]:
    gpu = get_gpu(str(data.get("cuda_device_0", ""))).name
    limit_w = _device_power_limit(data, gpu)
    energy = result.get("energy") or {}
    reps = result.get("op_reps") or {}
    rows = [row for row in result.get("rows", []) if row.get("background") == "copy"]
    copy_alone_s = {(row.get("op"), row.get("blocks")): row.get("background_s") for row in rows}
    for row in rows:  # the copy's time alone on K blocks is measured once per K (every op's row has it)
        copy_alone_s.setdefault(("", row.get("blocks")), row.get("background_s"))
    targets: list[Target] = []
    skipped: list[str] = []
    not_targets: list[str] = []
    for name, window in energy.items():
        if not isinstance(window, Mapping):
            continue  # per_iteration, truncated, error: text
        op, blocks, predicted = _device_window_name(name)
        if op is None:  # a spinner alone (or an unknown name): measured, but not the twin's to predict
            (not_targets if predicted == "spin" else skipped).append(
                name if predicted == "spin" else f"{name} (not a window the twin predicts)")
            continue
        clocks = window.get("sm_clock_mhz_inside") or []
        alone_s = copy_alone_s.get((op, blocks)) if blocks else 0.0
        power_w = window.get("power_w")
        if op and not reps.get(op):
            skipped.append(f"{name} (not a window the twin predicts)")
            continue
        if "error" in window or not clocks or not window.get("time_s") or not power_w or (blocks and not alone_s):
            skipped.append(f"{name} ({window.get('error') or 'no clock, time, power or copy time alone'})")
            continue
        clock = int(statistics.median(clocks))
        count = int(reps[op]) * (DEVICE_CHECK_OP_WINDOWS_BESIDE_COPY if blocks else 1) if op else 0
        base = {"gpu": gpu, "power_limit_w": limit_w, "work": "device_window", "op": op, "op_count": count,
                "comm_sms": blocks, "copy_s": alone_s or 0.0, "clock_mhz": clock,
                "source": f"device check {Path(path).name}: interference energy window {name}"}
        label = f"{name} window {clock} MHz"
        targets.append(make_target({**base, "name": f"{label} time", "probe": "time_s", "value": window["time_s"],
                                    "unit": "s"}, str(path)))
        targets.append(make_target({**base, "name": f"{label} power", "probe": "avg_power_w", "value": power_w,
                                    "unit": "W"}, str(path)))
    why = None
    if skipped or not_targets or not targets:
        why = (f"its interference section's energy windows: {len(targets) // 2} read"
               + (f", skipped {', '.join(skipped)}" if skipped else "")
               + (f"; not a twin target: {', '.join(not_targets)} ({SPINNER_NOT_A_TARGET})" if not_targets else "")
               + ("" if energy else " (no energy windows)")
               + (f"; {energy['error']}" if isinstance(energy.get("error"), str) else "")
               + (f"; {energy['truncated']}" if isinstance(energy.get("truncated"), str) else ""))
    return targets, why


# Why the interference section's spinner-alone windows (`spinK`) are measured but not fitted.
SPINNER_NOT_A_TARGET = ("the spinner is an arithmetic-only loop on K blocks, and the twin has no kernel of that kind "
                        "(its compute kernels run on all SMs or beside a collective, its memory kernels move bytes); "
                        "spinK − P_static over K is what K SMs draw at the working clock, read by hand against "
                        "copyK")


def _device_window_name(name: str) -> tuple[str | None, int, str]:
    """(op, K, kind) of an interference energy window's name: `op` (op alone, K 0), `op+copyK`,
    `copyK` (op "": the copy alone); op None for what the twin does not predict (`spinK`: kind
    "spin"; anything else: kind "")."""
    op, plus, background = name.partition("+")
    if not plus:
        op, background = "", name
        if name in DEVICE_CHECK_OPS:
            return name, 0, ""
    kind = background.rstrip("0123456789")
    digits = background[len(kind):]
    if not digits or int(digits) < 1 or (op and op not in DEVICE_CHECK_OPS):
        return None, 0, ""
    if kind == "copy":
        return op, int(digits), kind
    return None, int(digits), "spin" if kind == "spin" and not op else ""


def _device_power_limit(data: Mapping[str, Any], gpu: str) -> float | None:
    """cuda:0's enforced power limit from the nvml section when it is not the preset's (None:
    the preset's, or not read)."""
    found = (data.get("sections", {}).get("nvml") or {}).get("result") or {}
    index = found.get("cuda_device_0_nvml_index")
    for entry in found.get("gpus", []):
        limit = entry.get("power_limit_w")
        if entry.get("nvml_index") == index and isinstance(limit, int | float) and not isinstance(limit, bool):
            return None if float(limit) == get_gpu(gpu).power_limit_w else float(limit)
    return None


def _device_gpu(data: Mapping[str, Any], result: Mapping[str, Any]) -> str:
    for row in result.get("rows", []):
        simulated = row.get("simulated") or {}
        if isinstance(simulated, Mapping) and simulated.get("gpu"):
            return get_gpu(simulated["gpu"]).name
    return get_gpu(str(data.get("cuda_device_0", ""))).name


def from_profile_store(path: str | Path, job: Any, holdout_every: int = 3) -> list[Target]:
    """Targets from an NVML profile store (`kareus profile --store DIR`, one `<key>.jsonl`) of
    `job` (a `KareusJob`): partition measurements and Megatron-style instructions, time and energy."""
    from kareus.workload.models import CALIBRATION_PRESETS, PRESETS

    spec = getattr(job, "spec", job)
    shape = spec.model_shape()
    if shape.name not in PRESETS and shape.name not in CALIBRATION_PRESETS:
        raise KareusError(f"--job: model {shape.name!r} is not a preset; calibrate against a preset model "
                          f"(allowed: {', '.join(sorted(PRESETS))})")
    par = spec.parallelism
    layout = {"gpu": get_gpu(spec.gpu_product).name, "model": shape.name, "tp": int(par.tensor),
              "cp": int(par.context), "pp": int(par.pipeline), "seq_len": int(spec.sequence_length),
              "micro_batch_size": int(par.micro_batch_size)}
    targets: list[Target] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise KareusError(f"{path}: cannot read ({error.strerror or error})") from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        kind = record.get("kind")
        if kind == "partition":
            base = {**layout, "work": "partition", "partition": record["type"], "launch_slot": record["launch_slot"],
                    "comm_sms": record["comm_sms"], "clock_mhz": record["clock_mhz"]}
            name = f"{record['type']}@{record['launch_slot']}/{record['comm_sms']} {record['clock_mhz']} MHz"
        elif kind == "work" and record.get("what") == "sequential":
            base = {**layout, "work": "instruction", "stage": record["stage"], "direction": record["direction"],
                    "clock_mhz": record["clock_mhz"]}
            name = f"stage {record['stage']} {record['direction']} {record['clock_mhz']} MHz"
        else:
            continue
        base["source"] = f"profile store {Path(path).name}:{number}"
        targets.append(make_target({**base, "name": f"{name} time", "probe": "time_s",
                                    "value": record["time_s"], "unit": "s"}, f"{path}:{number}"))
        targets.append(make_target({**base, "name": f"{name} energy", "probe": "energy_j",
                                    "value": record["energy_j"], "unit": "J"}, f"{path}:{number}"))
    if not targets:
        raise KareusError(f"{path}: no partition or sequential measurements in the store")
    return assign_splits(targets, holdout_every)


def assign_splits(targets: Sequence[Target], holdout_every: int) -> list[Target]:
    """Every `holdout_every`-th measurement (time and energy together) is held out."""
    if holdout_every < 2:
        raise KareusError(f"--holdout-every: must be >= 2, got {holdout_every}")
    out = []
    for index, target in enumerate(targets):
        pair = index // 2
        out.append(replace(target, split="holdout" if pair % holdout_every == holdout_every - 1 else "fit"))
    return out


def _json(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise KareusError(f"{path}: cannot read ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise KareusError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise KareusError(f"{path}: expected a JSON object")
    return data
