"""Profiling with the clocks locked by the node daemon, as an authorised pod does on a cluster.

Locking SM clocks through NVML needs privileges a profiling pod must not have (it runs under Pod
Security `restricted`). On a cluster the pod asks `kareus-node` instead: `DaemonLocked` wraps any
backend, locks the pod's own GPUs (those the daemon says it may control) at each candidate's
clock before the wrapped backend measures, and resets them when profiling ends — and the daemon
resets them anyway when the connection drops, so a killed pod leaves no clock locked. The wrapped
backend only measures: an `NvmlBackend` built with `lock_clocks=False` reads the energy counters
(which needs no privilege) while the daemon holds the clock. Only clocks within the bounds the
daemon reports (its policy floor and ceiling) are profiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from kareus.daemon_client import DaemonError, open_connection
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.profiler.backends import ProfilerBackend
from kareus.search.problem import Candidate
from kareus.workload.partitions import PartitionType, StageWorkload


class DaemonLocked(ProfilerBackend):
    """`backend`'s measurements with every clock locked through the daemon at `endpoint`."""

    def __init__(self, backend: ProfilerBackend, endpoint: str, *, job: str | None = None) -> None:
        self.backend = backend
        self.name, self.gpu_name, self.p_static_w = backend.name, backend.gpu_name, backend.p_static_w
        try:
            self.connection = open_connection(endpoint, job=job)
            gpus = self.connection.discover()
        except (DaemonError, OSError) as error:
            raise KareusError(f"the node daemon at {endpoint} cannot lock clocks for profiling: {error}",
                              exit_code=EXIT_CONFIG) from None
        mine = [gpu for gpu in gpus if gpu.controllable]
        self.gpu_uuids = [gpu.uuid for gpu in mine]
        if not self.gpu_uuids:
            reasons = "; ".join(sorted({gpu.reason for gpu in gpus if gpu.reason})) or "it reports no GPU"
            raise KareusError(f"the node daemon lets this pod lock no GPU ({reasons})", exit_code=EXIT_CONFIG)
        # The clocks the daemon lets this pod lock on all of its GPUs: its policy floor and ceiling.
        self.range_mhz = (max(gpu.min_clock_mhz for gpu in mine), min(gpu.max_clock_mhz for gpu in mine))
        self.locked_mhz: int | None = None
        self.locks = 0  # clock changes requested, for the profile's record and the tests

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        """The wrapped backend's clocks within the daemon's bounds, so the profile (and every plan
        made from it) holds only clocks the daemon locks (a floor or ceiling refuses the others)."""
        low, high = self.range_mhz
        clocks = tuple(clock for clock in self.backend.supported_clocks_mhz() if low <= clock <= high)
        if not clocks:
            raise KareusError(f"the node daemon allows {low}–{high} MHz, where the GPU supports no SM clock",
                              exit_code=EXIT_CONFIG)
        return clocks

    def _lock(self, clock_mhz: int) -> None:
        if clock_mhz == self.locked_mhz:
            return
        try:
            self.connection.lock(self.gpu_uuids, clock_mhz, wait=True)
        except (DaemonError, OSError) as error:
            raise KareusError(f"the node daemon refused to lock {clock_mhz} MHz: {error}") from None
        self.locked_mhz = clock_mhz
        self.locks += 1

    def measure_partitions(self, ptype: PartitionType,
                           candidates: Sequence[Candidate]) -> list[tuple[float, float]]:
        """One lock per clock: candidates are measured clock by clock, results in their order."""
        order = sorted(range(len(candidates)), key=lambda i: candidates[i].clock_mhz)
        results: dict[int, tuple[float, float]] = {}
        for clock_mhz, group in groupby(order, key=lambda i: candidates[i].clock_mhz):
            indices = list(group)
            self._lock(clock_mhz)
            measured = self.backend.measure_partitions(ptype, [candidates[i] for i in indices])
            results.update(zip(indices, measured, strict=True))
        return [results[i] for i in range(len(candidates))]

    def measure_work(self, what: str, stage: StageWorkload, direction: str,
                     clock_mhz: int) -> tuple[float, float]:
        self._lock(clock_mhz)
        return self.backend.measure_work(what, stage, direction, clock_mhz)

    def close(self) -> None:
        try:
            if self.locked_mhz is not None:
                self.connection.reset(self.gpu_uuids, wait=True)
        except (DaemonError, OSError):
            pass  # the daemon resets a closed connection's clocks itself
        finally:
            self.locked_mhz = None
            self.connection.close()
            self.backend.close()
