"""The operator's Prometheus metrics: jobs per phase, time spent per phase, profile cache hits.

One `OperatorMetrics` object owns its own registry (no module-level collectors), so tests and a
restarted operator never share counters. Phase durations are measured from the moment this operator
process saw a job enter a phase; a restart starts the clock anew (a shorter, never a longer, sample).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kareus import metric_names
from kareus_operator.conditions import PHASES

_PHASE_BUCKETS_S = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class OperatorMetrics:
    """Tracks the last phase of every job by uid and exports the three operator metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge(metric_names.JOBS, "KareusJobs by phase", ["phase"], registry=self.registry)
        self.phase_seconds = Histogram(metric_names.PHASE_SECONDS, "Time a KareusJob spent in a phase",
                                       ["phase"], buckets=_PHASE_BUCKETS_S, registry=self.registry)
        self.cache_hits = Counter(metric_names.PROFILE_CACHE_HITS_TOTAL.removesuffix("_total"),
                                  "Profiles reused from the cache instead of measured", registry=self.registry)
        self._phase: dict[str, tuple[str, float]] = {}  # uid -> (phase, monotonic time entered)
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)

    def observe(self, uid: str, phase: str) -> None:
        """Record the job's current phase; a change closes the previous phase's duration."""
        now = time.monotonic()
        previous = self._phase.get(uid)
        if previous is not None and previous[0] == phase:
            return
        if previous is not None:
            self.jobs.labels(phase=previous[0]).dec()
            self.phase_seconds.labels(phase=previous[0]).observe(now - previous[1])
        self.jobs.labels(phase=phase).inc()
        self._phase[uid] = (phase, now)

    def forget(self, uid: str) -> None:
        previous = self._phase.pop(uid, None)
        if previous is not None:
            self.jobs.labels(phase=previous[0]).dec()

    def profile_cache_hit(self) -> None:
        self.cache_hits.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
