"""Cluster policy: what a platform team allows KareusJobs to ask for.

A platform team governs Kareus through Helm values; the chart renders `values.policy` into a
ConfigMap (key `policy.yaml`) that the operator reads with `load_policy`. The policy says

- which objectives a job may choose (`maxThroughput`, `timeBudget`, `energyBudget`) and which one
  a job gets when it names none;
- how much slower than the fastest plan a time budget may make a job (`maxSlowdownPercent`), so a
  team cannot trade the cluster's throughput for its own energy bill without limit;
- the SM clock floor and ceiling per GPU model (a default plus overrides keyed by the node-label
  spelling, e.g. `NVIDIA-A100-SXM4-40GB`): plans stay inside them, the node daemon refuses
  anything outside; a model without a floor gets `DEFAULT_FLOOR_FRACTION` of its top clock;
- per-namespace energy budgets in kilowatt-hours, for the lifetime or per UTC month, week or day
  (`{kwh, period}`), counted in the operator's ledger (`kareus.energy_ledger`);
- whether profiles may be reused across jobs with the same profile key;
- which namespaces may run KareusJobs at all (empty means every namespace);
- what a job's `podTemplateOverrides` may add to its pods (`podTemplateOverrides`, see
  `kareus.override_policy`: Pod Security `restricted`'s volume types by default, no system-*
  PriorityClass, no toleration of every taint, no `LD_PRELOAD`/`PYTHONPATH`/`KAREUS_*` env);
- a cluster power budget (`powerBudget`): watts for the whole cluster and/or per GPU product or
  node pool, within which the operator gives every running job a frontier point
  (`kareus.power_budget`).

Every key is optional; an absent key takes the permissive default. A typo is an error naming the
key, because a silently ignored policy is worse than none. `check_job` compares one job with the
policy and returns every violation at once, so the operator can report them in one condition.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kareus.energy_ledger import PERIODS, BudgetStanding
from kareus.errors import KareusError
from kareus.override_policy import OverridePolicy, OverridePolicyError, load_override_policy

if TYPE_CHECKING:
    from kareus.spec import JobSpec

POLICY_CONFIGMAP_KEY = "policy.yaml"
OBJECTIVES: tuple[str, ...] = ("maxThroughput", "timeBudget", "energyBudget")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_TOP_KEYS = frozenset({
    "allowedObjectives", "defaultObjective", "maxSlowdownPercent", "clockBounds",
    "namespaceEnergyBudgets", "profileReuse", "allowedNamespaces", "powerBudget", "podTemplateOverrides",
})
_BOUNDS_KEYS = frozenset({"floorMHz", "ceilingMHz"})
_CLOCK_KEYS = frozenset({"default", "gpuModels"})
_POWER_KEYS = frozenset({"watts", "gpuProducts", "nodePools", "nodePoolLabel", "method", "resolutionWatts"})
POWER_METHODS: tuple[str, ...] = ("exact", "greedy")
DEFAULT_NODE_POOL_LABEL = "kareus.dev/node-pool"
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class PolicyError(KareusError):
    """The cluster policy document is malformed; the message names the field."""


# The floor of a GPU model the policy sets no floor for, as a share of its top SM clock. It bounds
# what a stolen or replayed node-agent token can do to a pod's GPU (slow it by at most 1/0.6 ≈ 1.67×)
# and costs the method nothing: below ~900 of the A100's 1410 MHz energy no longer drops (paper,
# Appendix C), so the profiler's grid stops at 900/1410 of the top clock, less half a 30 MHz step
# (`kareus.profiler.profile.clock_grid`: 885 MHz on an A100, 1260 MHz on an H100/H200), above this
# floor (846 and 1188 MHz) on every GPU whose top clock is at least 392 MHz; the optimizer and the runtime
# use only profiled clocks. `clock_grid` also never goes below it.
DEFAULT_FLOOR_FRACTION = 0.6


def default_floor_mhz(top_mhz: float, fraction: float = DEFAULT_FLOOR_FRACTION) -> int:
    """The default floor of a GPU whose top clock is `top_mhz` (0 with `fraction` 0: none)."""
    return math.ceil(fraction * top_mhz)


@dataclass(frozen=True)
class ClockBounds:
    """SM clock limits in MHz; None on a side means that side is not limited."""

    floor_mhz: int | None = None
    ceiling_mhz: int | None = None

    def allows(self, clock_mhz: float) -> bool:
        above_floor = self.floor_mhz is None or clock_mhz >= self.floor_mhz
        below_ceiling = self.ceiling_mhz is None or clock_mhz <= self.ceiling_mhz
        return above_floor and below_ceiling

    def clamp(self, clock_mhz: int) -> int:
        if self.floor_mhz is not None:
            clock_mhz = max(clock_mhz, self.floor_mhz)
        if self.ceiling_mhz is not None:
            clock_mhz = min(clock_mhz, self.ceiling_mhz)
        return clock_mhz

    def merged_over(self, base: ClockBounds) -> ClockBounds:
        """These bounds with any unset side taken from `base` (a model override over the default)."""
        return ClockBounds(
            self.floor_mhz if self.floor_mhz is not None else base.floor_mhz,
            self.ceiling_mhz if self.ceiling_mhz is not None else base.ceiling_mhz,
        )

    def range_mhz(self, supported_mhz: Collection[int], *,
                  default_floor_fraction: float = DEFAULT_FLOOR_FRACTION) -> tuple[int, int]:
        """The lowest and highest clock a GPU that supports `supported_mhz` may be locked at: these
        bounds within what it supports, and without a floor `default_floor_fraction` of its top
        clock (`default_floor_mhz`) as the floor."""
        top = max(supported_mhz)
        floor = self.floor_mhz if self.floor_mhz is not None else default_floor_mhz(top, default_floor_fraction)
        return max(min(supported_mhz), floor), min(top, self.ceiling_mhz or top)


@dataclass(frozen=True)
class PowerBudget:
    """Cluster power budget in watts (predicted average power of the jobs' frontier points).

    `cluster_w` bounds every job together; `gpu_products_w` the jobs on one GPU product (keys in
    any spelling `gpu_model_key` normalises) and `node_pools_w` the jobs in one node pool (the
    value of label `node_pool_label` on their nodes). None/empty: no bound at that level. `method`
    is the allocator (`exact` DP or `greedy` on the convex hulls), `resolution_w` the exact DP's
    power step (None: chosen from the budgets, see `kareus.power_budget`).
    """

    cluster_w: float | None = None
    gpu_products_w: Mapping[str, float] = field(default_factory=dict)
    node_pools_w: Mapping[str, float] = field(default_factory=dict)
    node_pool_label: str = DEFAULT_NODE_POOL_LABEL
    method: str = "exact"
    resolution_w: float | None = None

    @property
    def enabled(self) -> bool:
        """Whether any level is bounded (otherwise the operator allocates nothing)."""
        return self.cluster_w is not None or bool(self.gpu_products_w) or bool(self.node_pools_w)

    def product_w(self, gpu_product: str | None) -> float | None:
        """The budget of a GPU product, in node-label or plain spelling, or None."""
        if not gpu_product:
            return None
        wanted = gpu_model_key(gpu_product)
        return next((w for name, w in self.gpu_products_w.items() if gpu_model_key(name) == wanted), None)


@dataclass(frozen=True)
class ClusterPolicy:
    """The typed policy; the defaults allow everything (what an absent ConfigMap means)."""

    allowed_objectives: frozenset[str] = frozenset(OBJECTIVES)
    default_objective: str = "maxThroughput"
    max_slowdown_percent: float | None = None
    default_clock_bounds: ClockBounds = ClockBounds()
    gpu_clock_bounds: Mapping[str, ClockBounds] = field(default_factory=dict)
    namespace_energy_budgets_kwh: Mapping[str, float] = field(default_factory=dict)
    # The period of each namespace budget (`kareus.energy_ledger.PERIODS`); absent: lifetime.
    namespace_energy_periods: Mapping[str, str] = field(default_factory=dict)
    profile_reuse: bool = True
    allowed_namespaces: frozenset[str] = frozenset()
    power_budget: PowerBudget = PowerBudget()
    pod_overrides: OverridePolicy = field(default_factory=OverridePolicy)

    def namespace_allowed(self, namespace: str) -> bool:
        return not self.allowed_namespaces or namespace in self.allowed_namespaces

    def clock_bounds_for(self, gpu_product: str | None) -> ClockBounds:
        """Bounds for a GPU model, accepting the node-label (`NVIDIA-A100-SXM4-40GB`) and plain spellings."""
        if gpu_product:
            wanted = gpu_model_key(gpu_product)
            for model, bounds in self.gpu_clock_bounds.items():
                if gpu_model_key(model) == wanted:
                    return bounds.merged_over(self.default_clock_bounds)
        return self.default_clock_bounds

    def energy_budget_kwh(self, namespace: str) -> float | None:
        return self.namespace_energy_budgets_kwh.get(namespace)

    def energy_period(self, namespace: str) -> str:
        """The period the namespace's budget resets on (`lifetime`: never)."""
        return self.namespace_energy_periods.get(namespace, "lifetime")

    def reuse_profiles(self, job_wants_reuse: bool) -> bool:
        """A job reuses a stored profile only when both it and the cluster allow it."""
        return self.profile_reuse and job_wants_reuse


@dataclass(frozen=True)
class Violation:
    """One way a job breaks the policy: `rule` is the policy key, `message` says what to change."""

    rule: str
    message: str


def gpu_model_key(name: str) -> str:
    """Normalise a GPU model name so `NVIDIA-A100-SXM4-40GB`, `nvidia a100-sxm4-40gb` and `A100-SXM4-40GB` match."""
    key = re.sub(r"[\s_]+", "-", name.strip().upper())
    return key.removeprefix("NVIDIA-")


# ---------------------------------------------------------------- loading


def load_policy(source: str | Mapping[str, Any] | None) -> ClusterPolicy:
    """Parse a policy from YAML text or an already-parsed mapping; None or empty text gives the defaults."""
    raw = _parse_text(source) if isinstance(source, str) or source is None else source
    if not isinstance(raw, Mapping):
        raise PolicyError(f"policy: must be a mapping of policy keys, got {type(raw).__name__}")
    _reject_unknown(raw, _TOP_KEYS, "policy")
    allowed = _objectives(raw.get("allowedObjectives", list(OBJECTIVES)))
    # Without an explicit default, the first allowed objective in OBJECTIVES order is the default.
    default = raw.get("defaultObjective", next(o for o in OBJECTIVES if o in allowed))
    if default not in OBJECTIVES:
        raise PolicyError(f"policy.defaultObjective: must be one of {', '.join(OBJECTIVES)}, got {default!r}")
    if default not in allowed:
        raise PolicyError(
            f"policy.defaultObjective: {default!r} must be one of policy.allowedObjectives "
            f"({', '.join(sorted(allowed))})"
        )
    default_bounds, gpu_bounds = _clock_bounds(raw.get("clockBounds", {}))
    budgets_kwh, periods = _energy_budgets(raw.get("namespaceEnergyBudgets", {}))
    return ClusterPolicy(
        allowed_objectives=allowed,
        default_objective=default,
        max_slowdown_percent=_optional_positive(raw.get("maxSlowdownPercent"), "policy.maxSlowdownPercent"),
        default_clock_bounds=default_bounds,
        gpu_clock_bounds=gpu_bounds,
        namespace_energy_budgets_kwh=budgets_kwh,
        namespace_energy_periods=periods,
        profile_reuse=_boolean(raw.get("profileReuse", True), "policy.profileReuse"),
        allowed_namespaces=_namespaces(raw.get("allowedNamespaces", [])),
        power_budget=_power_budget(raw.get("powerBudget", {})),
        pod_overrides=_override_policy(raw.get("podTemplateOverrides")),
    )


def _override_policy(raw: Any) -> OverridePolicy:
    try:
        return load_override_policy(raw)
    except OverridePolicyError as error:
        raise PolicyError(str(error)) from None


def load_policy_file(path: str | Path) -> ClusterPolicy:
    """Read the policy the operator was given (`--policy-file`, the mounted ConfigMap key)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"policy file {path}: cannot be read ({exc.strerror or exc})") from exc
    return load_policy(text)


def _parse_text(text: str | None) -> Any:
    if text is None or not text.strip():
        return {}
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"policy: not valid YAML ({exc})") from exc
    return {} if parsed is None else parsed


def _reject_unknown(raw: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise PolicyError(
            f"{where}.{unknown[0]}: unknown key; allowed keys are {', '.join(sorted(allowed))}"
        )


def _objectives(value: Any) -> frozenset[str]:
    where = "policy.allowedObjectives"
    if not isinstance(value, list) or not value:
        raise PolicyError(f"{where}: must be a non-empty list drawn from {', '.join(OBJECTIVES)}")
    for i, item in enumerate(value):
        if item not in OBJECTIVES:
            raise PolicyError(f"{where}[{i}]: must be one of {', '.join(OBJECTIVES)}, got {item!r}")
    return frozenset(value)


def _number(value: Any, where: str) -> float:
    # bool is an int subclass; `true` as a number is a typo, not 1.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PolicyError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _optional_positive(value: Any, where: str) -> float | None:
    if value is None:
        return None
    number = _number(value, where)
    if number <= 0:
        raise PolicyError(f"{where}: must be > 0, got {value!r}")
    return number


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: must be true or false, got {value!r}")
    return value


def _clock_mhz(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PolicyError(f"{where}: must be a whole number of MHz > 0, got {value!r}")
    return value


def _bounds(raw: Any, where: str) -> ClockBounds:
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must be a mapping with floorMHz and/or ceilingMHz")
    _reject_unknown(raw, _BOUNDS_KEYS, where)
    bounds = ClockBounds(
        _clock_mhz(raw.get("floorMHz"), f"{where}.floorMHz"),
        _clock_mhz(raw.get("ceilingMHz"), f"{where}.ceilingMHz"),
    )
    if bounds.floor_mhz is not None and bounds.ceiling_mhz is not None and bounds.floor_mhz > bounds.ceiling_mhz:
        raise PolicyError(
            f"{where}.floorMHz: {bounds.floor_mhz} must not exceed ceilingMHz {bounds.ceiling_mhz}"
        )
    return bounds


def _clock_bounds(raw: Any) -> tuple[ClockBounds, dict[str, ClockBounds]]:
    where = "policy.clockBounds"
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must be a mapping with 'default' and/or 'gpuModels'")
    _reject_unknown(raw, _CLOCK_KEYS, where)
    default = _bounds(raw.get("default") or {}, f"{where}.default")
    models = raw.get("gpuModels") or {}
    if not isinstance(models, Mapping):
        raise PolicyError(f"{where}.gpuModels: must map GPU model names to floorMHz/ceilingMHz")
    per_model = {str(m): _bounds(b, f"{where}.gpuModels.{m}") for m, b in models.items()}
    for model, bounds in per_model.items():
        merged = bounds.merged_over(default)
        if merged.floor_mhz is not None and merged.ceiling_mhz is not None and merged.floor_mhz > merged.ceiling_mhz:
            raise PolicyError(
                f"{where}.gpuModels.{model}: floor {merged.floor_mhz} MHz exceeds ceiling "
                f"{merged.ceiling_mhz} MHz once the default bounds fill the unset side"
            )
    return default, per_model


def _energy_budgets(raw: Any) -> tuple[dict[str, float], dict[str, str]]:
    """kWh per namespace, and the period of each that is not a lifetime budget. An entry is a
    number (a lifetime budget) or `{kwh, period}`."""
    where = "policy.namespaceEnergyBudgets"
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must map namespace names to kilowatt-hours or {{kwh, period}}")
    budgets, periods = {}, {}
    for namespace, entry in raw.items():
        at = f"{where}.{namespace}"
        _check_namespace(namespace, at)
        period = "lifetime"
        if isinstance(entry, Mapping):
            _reject_unknown(entry, frozenset(("kwh", "period")), at)
            period = entry.get("period", "lifetime")
            if period not in PERIODS:
                raise PolicyError(f"{at}.period: must be one of {', '.join(PERIODS)}, got {period!r}")
            entry, at = entry.get("kwh"), f"{at}.kwh"
        budget = _optional_positive(entry, at)
        if budget is None:
            raise PolicyError(f"{at}: must be a number of kilowatt-hours > 0")
        budgets[namespace] = budget
        if period != "lifetime":
            periods[namespace] = period
    return budgets, periods


def _watts(value: Any, where: str) -> float:
    number = _optional_positive(value, where)
    if number is None:
        raise PolicyError(f"{where}: must be a number of watts > 0")
    return number


def _watts_by_name(raw: Any, where: str, what: str) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must map {what} names to watts")
    budgets: dict[str, float] = {}
    for name, watts in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise PolicyError(f"{where}: {name!r} is not a {what} name")
        budgets[name] = _watts(watts, f"{where}.{name}")
    return budgets


def _power_budget(raw: Any) -> PowerBudget:
    where = "policy.powerBudget"
    if raw is None:
        return PowerBudget()
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must be a mapping with watts, gpuProducts and/or nodePools")
    _reject_unknown(raw, _POWER_KEYS, where)
    cluster = raw.get("watts")
    products = _watts_by_name(raw.get("gpuProducts") or {}, f"{where}.gpuProducts", "GPU product")
    keys = [gpu_model_key(name) for name in products]
    if len(set(keys)) != len(keys):
        raise PolicyError(f"{where}.gpuProducts: two keys name the same GPU product ({', '.join(products)})")
    label = raw.get("nodePoolLabel", DEFAULT_NODE_POOL_LABEL)
    if not isinstance(label, str) or not _LABEL_KEY.match(label):
        raise PolicyError(f"{where}.nodePoolLabel: {label!r} is not a Kubernetes label key")
    method = raw.get("method", "exact")
    if method not in POWER_METHODS:
        raise PolicyError(f"{where}.method: must be one of {', '.join(POWER_METHODS)}, got {method!r}")
    return PowerBudget(
        cluster_w=None if cluster is None else _watts(cluster, f"{where}.watts"),
        gpu_products_w=products,
        node_pools_w=_watts_by_name(raw.get("nodePools") or {}, f"{where}.nodePools", "node pool"),
        node_pool_label=label,
        method=method,
        resolution_w=_optional_positive(raw.get("resolutionWatts"), f"{where}.resolutionWatts"),
    )


def _namespaces(raw: Any) -> frozenset[str]:
    where = "policy.allowedNamespaces"
    if not isinstance(raw, list):
        raise PolicyError(f"{where}: must be a list of namespace names (empty allows every namespace)")
    for i, namespace in enumerate(raw):
        _check_namespace(namespace, f"{where}[{i}]")
    return frozenset(raw)


def _check_namespace(name: Any, where: str) -> None:
    if not isinstance(name, str) or not _DNS_LABEL.match(name):
        raise PolicyError(f"{where}: {name!r} is not a namespace name (lowercase DNS label, at most 63 characters)")


# ---------------------------------------------------------------- checking a job


def check_job(
    policy: ClusterPolicy, namespace: str, spec: JobSpec, *, namespace_used_kwh: float = 0.0,
    energy: BudgetStanding | None = None, check_energy: bool = True,
) -> list[Violation]:
    """Every way the job `spec` (a `kareus.spec.JobSpec`) in `namespace` breaks `policy`.

    The namespace's energy budget is checked against `energy` (its standing in the operator's
    ledger, `kareus.energy_ledger`) or, without one, against `namespace_used_kwh` as a lifetime
    budget. A job is refused when the budget is used up or when its own total-energy budget is
    larger than what is left. `check_energy=False` leaves the energy budget out, for a job whose
    queue enforces it (the Kueue admission check `kareus.dev/energy-budget`).
    """
    violations = []
    if not policy.namespace_allowed(namespace):
        violations.append(Violation(
            "allowedNamespaces",
            f"namespace {namespace!r} may not run KareusJobs; allowed: {', '.join(sorted(policy.allowed_namespaces))}",
        ))
    objective = job_objective(policy, spec)
    if objective.kind not in policy.allowed_objectives:
        violations.append(Violation(
            "allowedObjectives",
            f"spec.objective.{objective.kind} is not allowed on this cluster; "
            f"allowed: {', '.join(o for o in OBJECTIVES if o in policy.allowed_objectives)}",
        ))
    limit = policy.max_slowdown_percent
    if limit is not None and objective.max_slowdown_percent is not None and objective.max_slowdown_percent > limit:
        violations.append(Violation(
            "maxSlowdownPercent",
            f"spec.objective.timeBudget.maxSlowdownPercent: {objective.max_slowdown_percent:g} exceeds the "
            f"cluster limit of {limit:g}",
        ))
    budget_kwh = policy.energy_budget_kwh(namespace)
    if energy is None and budget_kwh is not None:
        energy = BudgetStanding(namespace, budget_kwh, "lifetime", namespace_used_kwh, 0.0, None)
    if energy is not None and check_energy:
        violations.extend(_energy_violations(energy, objective))
    return violations


@dataclass(frozen=True)
class JobObjective:
    """The part of a job's objective the policy looks at."""

    kind: str
    max_slowdown_percent: float | None = None
    total_kwh: float | None = None


def job_objective(policy: ClusterPolicy, spec: JobSpec) -> JobObjective:
    """The job's objective, or the policy's default objective when the job names none."""
    objective = getattr(spec, "objective", None)
    if objective is None:
        return JobObjective(policy.default_objective)
    return JobObjective(
        kind=objective.kind,
        max_slowdown_percent=getattr(objective, "max_slowdown_percent", None),
        total_kwh=getattr(objective, "total_kilowatt_hours", None),
    )


def _energy_violations(energy: BudgetStanding, objective: JobObjective) -> list[Violation]:
    if energy.remaining_kwh <= 0:
        return [Violation("namespaceEnergyBudgets", energy.text())]
    if objective.total_kwh is not None and objective.total_kwh > energy.remaining_kwh:
        return [Violation(
            "namespaceEnergyBudgets",
            f"spec.objective.energyBudget.totalKilowattHours: {objective.total_kwh:g} is more than the "
            f"{energy.remaining_kwh:.4g} kWh left: {energy.text()}",
        )]
    return []
