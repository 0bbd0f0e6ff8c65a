"""Simulator parameter files: what `kareus sim calibrate` writes and every simulator command reads
(`--sim-params FILE`).

A file holds global `SimParams` values and, per GPU preset, values of its fittable envelope fields
(`GPU_FITTABLE`); everything it does not name keeps the shipped default. The shipped defaults are
themselves the A100 fit, stored in `kareus/sim/data/a100-sxm4.json`:

    {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusSimParams",
     "params": {"gemm_efficiency": 0.8, ...},
     "gpus": {"A100-SXM4-40GB": {"sm_dynamic_w_at_max": 350.0, ...}},
     "fit": {...}}                                   # what the fit saw and its errors (informative)

Unknown keys, values of the wrong type and GPUs without a preset are refused with one
`KareusError` that names the field and what is allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.sim.gpus import GPU_FITTABLE, GPUS, GPUSpec, get_gpu
from kareus.sim.physics import SimParams

API_VERSION = "kareus.dev/v1alpha1"
KIND = "KareusSimParams"
SHIPPED_PATH = Path(__file__).parent / "data" / "a100-sxm4.json"
_TOP_KEYS = ("apiVersion", "kind", "params", "gpus", "fit")


@dataclass(frozen=True)
class SimCalibration:
    """Parameters for the simulator: global `params` and per-GPU envelope overrides."""

    params: SimParams = field(default_factory=SimParams)
    gpus: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    fit: Mapping[str, Any] = field(default_factory=dict)

    def gpu(self, name: str | GPUSpec) -> GPUSpec:
        """The preset `name` with this file's overrides applied."""
        spec = get_gpu(name) if isinstance(name, str) else name
        overrides = self.gpus.get(spec.name, {})
        return replace(spec, **overrides) if overrides else spec

    def simulator(self, gpu: str | GPUSpec, *, noise_std: float = 0.0, seed: int | None = None):
        from kareus.sim.simulator import Simulator

        return Simulator(self.gpu(gpu), noise_std=noise_std, seed=seed, params=self.params)

    def to_dict(self) -> dict[str, Any]:
        params = {f.name: getattr(self.params, f.name) for f in fields(SimParams)}
        return {"apiVersion": API_VERSION, "kind": KIND, "params": params,
                "gpus": {name: dict(values) for name, values in self.gpus.items()}, "fit": dict(self.fit)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _number(value: Any, where: str, kind: type) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KareusError(f"{where}: must be a number, got {value!r}")
    if kind is int:
        if float(value) != int(value):
            raise KareusError(f"{where}: must be an integer, got {value!r}")
        return int(value)
    return float(value)


def from_dict(data: Any, source: str = "sim params") -> SimCalibration:
    """Validate and read a parameter document (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise KareusError(f"{source}: expected a JSON object with {', '.join(_TOP_KEYS)}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise KareusError(f"{source}: unknown field {unknown[0]!r}; allowed: {', '.join(_TOP_KEYS)}")
    if data.get("kind", KIND) != KIND or data.get("apiVersion", API_VERSION) != API_VERSION:
        raise KareusError(f"{source}: kind/apiVersion must be {KIND} / {API_VERSION}, "
                          f"got {data.get('kind')!r} / {data.get('apiVersion')!r}")
    raw_params = data.get("params", {})
    if not isinstance(raw_params, Mapping):
        raise KareusError(f"{source}: params must be an object of SimParams fields")
    kinds = {f.name: (int if f.type in ("int", int) else float) for f in fields(SimParams)}
    values = {}
    for key, value in raw_params.items():
        if key not in kinds:
            raise KareusError(f"{source}: params.{key} is not a simulator parameter; allowed: {', '.join(kinds)}")
        values[key] = _number(value, f"{source}: params.{key}", kinds[key])
    raw_gpus = data.get("gpus", {})
    if not isinstance(raw_gpus, Mapping):
        raise KareusError(f"{source}: gpus must map GPU presets to objects")
    gpus: dict[str, dict[str, float]] = {}
    for name, overrides in raw_gpus.items():
        if name not in GPUS:
            raise KareusError(f"{source}: gpus.{name} is not a GPU preset; allowed: {', '.join(GPUS)}")
        if not isinstance(overrides, Mapping):
            raise KareusError(f"{source}: gpus.{name} must be an object of GPU fields")
        for key, value in overrides.items():
            if key not in GPU_FITTABLE:
                raise KareusError(f"{source}: gpus.{name}.{key} is not a calibrated GPU field; allowed: "
                                  f"{', '.join(GPU_FITTABLE)}")
            gpus.setdefault(name, {})[key] = float(_number(value, f"{source}: gpus.{name}.{key}", float))
    fit = data.get("fit", {})
    return SimCalibration(replace(SimParams(), **values), gpus, fit if isinstance(fit, Mapping) else {})


def load(path: str | Path) -> SimCalibration:
    """Read a parameter file; a `KareusError` naming the file and field when it is not one."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise KareusError(f"--sim-params: cannot read {path}: {error.strerror or error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise KareusError(f"--sim-params: {path} is not JSON ({error.msg} at line {error.lineno})") from None
    return from_dict(data, str(path))


def shipped() -> SimCalibration:
    """The calibration the presets carry (defaults of `SimParams` and the GPU presets)."""
    return SimCalibration()


def load_or_default(path: str | Path | None) -> SimCalibration:
    return load(path) if path else shipped()


def add_argument(parser: Any) -> None:
    """The `--sim-params FILE` flag shared by every command that runs the simulated GPU."""
    parser.add_argument("--sim-params", metavar="FILE", default=None,
                        help="simulator parameters written by `kareus sim calibrate` (default: the shipped presets)")
