"""Progress and metrics of a training run.

`StepRecord` is one iteration as rank 0 writes it to `DIR/train.jsonl` (one JSON object per line:
step, loss, iteration_time_s, energy_j, tokens, tokens_per_joule, clock summary, plan revision,
clock-control state, gradient norm and learning rate, …; the first record also the data source).
`MetricsExporter` is the rank-local Prometheus endpoint with the worker metrics of
`kareus.metric_names`, served from its own registry (no global state), labelled with the rank and
stage. Port 0 picks a free port (`exporter.port` says which); no port, no endpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from kareus import metric_names


@dataclass(frozen=True)
class StepRecord:
    """One iteration of the whole job (energy summed over all GPUs)."""

    step: int
    loss: float
    iteration_time_s: float
    energy_j: float
    tokens: int
    tokens_per_joule: float
    modelled_time_s: float | None
    energy_source: str
    clock_mhz: dict[str, float] = field(default_factory=dict)
    # Which plan ran this step: 0 is the plan the run started with, +1 at every roll-out.
    plan_revision: int = 0
    plan_predicted_iteration_time_s: float | None = None
    plan_predicted_iteration_energy_j: float | None = None
    plan_sha256: str | None = None
    # "active" (a daemon sets the clocks), "none" (no daemon configured) or "degraded" (clock
    # control unavailable or refused on some rank; the reason names the rank). The operator sets
    # its ClockControlDegraded condition from "degraded".
    clock_control: str = "none"
    clock_control_reason: str = ""
    # Straggler-aware re-selection: why the latest revision happened ("rollout", "straggler",
    # "recovered"; "" for the starting plan), the frontier row this rank's replica ran, every
    # replica's row and own time (before the gradient all-reduce), and the slowest replica's
    # slowdown over the next (its index when beyond the threshold).
    plan_revision_reason: str = ""
    plan_frontier_row: int | None = None
    replica_frontier_rows: list[int] | None = None
    replica_time_s: list[float] | None = None
    straggler_replica: int | None = None
    straggler_slowdown: float | None = None
    # The run's first record names its token stream: the --data path as given, or "builtin-corpus".
    data_source: str | None = None
    # The optimizer step: the global gradient norm before clipping (every TP shard and pipeline
    # stage counted once, kareus.runtime.grad_norm) and the learning rate the step used.
    grad_norm: float | None = None
    lr: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class JsonlWriter:
    """Appends `StepRecord`s to a file, one line each, flushed per step (a reader can follow it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("w")

    def write(self, record: StepRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MetricsExporter:
    """Rank-local Prometheus endpoint for the worker metrics."""

    def __init__(self, port: int, *, addr: str = "0.0.0.0", rank: int = 0, stage: int = 0,
                 job: str = "", plan: dict[str, str] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        labels = {"rank": str(rank), "stage": str(stage), "kareusjob": job}
        names = list(labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*names, *extra], registry=self.registry)

        self._time = gauge(metric_names.ITERATION_SECONDS, "Wall time of the last training iteration.").labels(**labels)
        self._energy = gauge(metric_names.ITERATION_ENERGY_JOULES,
                             "Energy of the last iteration: this rank's GPU (scope=gpu) and the whole job (scope=job).",
                             ("scope",))
        self._energy_gpu = self._energy.labels(**labels, scope="gpu")
        self._energy_job = self._energy.labels(**labels, scope="job")
        self._tpj = gauge(metric_names.TOKENS_PER_JOULE, "Tokens trained per joule in the last iteration.").labels(**labels)
        self._row = gauge(metric_names.PLAN_FRONTIER_ROW,
                          "Frontier row of the plan this rank's replica runs (straggler re-selection).").labels(**labels)
        self._slowdown = gauge(metric_names.REPLICA_SLOWDOWN_RATIO,
                               "How much slower the slowest data-parallel replica was than the next (fraction).",
                               ).labels(**labels)
        self._grad_norm = gauge(metric_names.GRAD_NORM, "Global gradient norm of the last step, before clipping."
                                ).labels(**labels)
        self._lr = gauge(metric_names.LEARNING_RATE, "Learning rate of the last optimizer step.").labels(**labels)
        self._reselections = Counter(metric_names.STRAGGLER_RESELECTIONS_TOTAL,
                                     "Straggler re-selections (reason=straggler) and returns (reason=recovered).",
                                     [*names, "reason"], registry=self.registry)
        self._revision_seen = 0
        self._labels = labels
        self._plan_info: Gauge | None = None
        self._gauge = gauge
        self.set_plan(plan or {})
        self.server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self.server.server_port)

    def set_plan(self, plan: dict[str, str]) -> None:
        """Label `kareus_plan_info` with the plan now followed (after a roll-out the old series goes)."""
        if self._plan_info is not None:
            self.registry.unregister(self._plan_info)
        self._plan_info = self._gauge(metric_names.PLAN_INFO, "The plan this worker follows (value 1).", tuple(plan))
        self._plan_info.labels(**self._labels, **plan).set(1)

    def observe(self, record: StepRecord, gpu_energy_j: float) -> None:
        self._time.set(record.iteration_time_s)
        self._energy_gpu.set(gpu_energy_j)
        self._energy_job.set(record.energy_j)
        self._tpj.set(record.tokens_per_joule)
        if record.grad_norm is not None:
            self._grad_norm.set(record.grad_norm)
        if record.lr is not None:
            self._lr.set(record.lr)
        if record.plan_frontier_row is not None:
            self._row.set(record.plan_frontier_row)
        if record.straggler_slowdown is not None:
            self._slowdown.set(record.straggler_slowdown)
        if record.plan_revision > self._revision_seen and record.plan_revision_reason in ("straggler", "recovered"):
            self._reselections.labels(**self._labels, reason=record.plan_revision_reason).inc()
        self._revision_seen = record.plan_revision

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
