"""Closed-form test problems, as pymoo ships ZDT: cheap grids with a known shape.

`overlap_problem` mimics one partition: computation whose speed follows the clock, a collective
whose rate grows with its SM count up to the link limit while stealing those SMs from the
computation, and launch slots that hide more or less of it (an earlier slot hides more but
contends for memory bandwidth with memory-bound ops). Dynamic power grows ~f³ above a voltage
knee. It is not the simulator; it lets the search algorithms be tested without one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kareus.search.problem import Candidate, Problem, SearchSpace


def overlap_problem(*, clocks_mhz: Sequence[int] = tuple(range(900, 1411, 30)),
                    comm_sms: Sequence[int] = tuple(range(3, 31, 3)),
                    slots: Sequence[str] = ("norm_0", "linear_0", "rope_0", "attn_0"),
                    noise_std: float = 0.0, seed: int = 0, size_class: str = "large",
                    name: str = "overlap") -> Problem:
    """A partition-like problem on the given grid; `noise_std` is relative Gaussian noise."""
    space = SearchSpace(tuple(clocks_mhz), tuple(comm_sms), tuple(slots))
    rng = np.random.default_rng(seed)
    hide = np.linspace(0.95, 0.35, len(slots))  # share of the compute the comm can hide under
    contention = np.linspace(0.25, 0.0, len(slots))  # HBM contention of early slots
    p_static_w = 85.0

    def measure(candidates: Sequence[Candidate]) -> list[tuple[float, float]]:
        results = []
        for c in candidates:
            f = c.clock_mhz / max(clocks_mhz)
            slot = slots.index(c.launch_slot)
            compute_s = 1e-3 / f * (1 + 0.012 * c.comm_sms)  # comm SMs are taken from compute
            comm_s = 0.6e-3 / min(c.comm_sms, 12) * 4 * (1 + contention[slot])
            time_s = compute_s + max(0.0, comm_s - hide[slot] * compute_s)
            volts = max(0.75, f)  # flat below the knee
            dynamic_w = 330 * f * volts**2 + 8 * c.comm_sms
            energy_j = p_static_w * time_s + dynamic_w * compute_s + 20 * comm_s
            scale = 1 + noise_std * rng.standard_normal(2) if noise_std else np.ones(2)
            results.append((time_s * scale[0], energy_j * scale[1]))
        return results

    return Problem(name, space, measure, p_static_w, size_class)
