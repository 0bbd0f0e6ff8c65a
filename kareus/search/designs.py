"""Initial designs: which grid points to measure before any surrogate exists.

- `random_design`: uniformly random distinct grid points (the paper's artifact).
- `stratified_design`: every clock gets the same number of points (±1), and the comm-SM and
  launch-slot axes are Latin-hypercube stratified over the whole design, so neighbouring clocks see
  different configurations. Clock stratification matters twice: composition works per clock and
  drops a clock with no measured point, and the surrogate learns the clock effect from every clock
  instead of extrapolating into an unsampled corner.
- `clock_sweep_design`: every configuration at the middle clock. On a grid with few
  configurations (a single launch slot: ten comm-SM counts) one point per clock at random
  configurations mostly lands off the front, while a sweep shows which configurations win, and the
  transfer pass then carries them to the other clocks, each clock's first point already a likely
  winner. The middle clock is the nearest to all others, which matters because the winner drifts
  with the clock.
"""

from __future__ import annotations

import numpy as np

from kareus.search.problem import SearchSpace


def random_design(space: SearchSpace, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` distinct random grid indices."""
    return rng.choice(space.size, size=min(n, space.size), replace=False)


def stratified_design(space: SearchSpace, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` distinct grid indices, balanced over clocks, Latin-hypercube over comm SMs and slots."""
    n = min(n, space.size)
    n_clocks, n_sms, n_slots = len(space.clocks_mhz), len(space.comm_sms), len(space.launch_slots)
    clock_order = rng.permutation(n_clocks)
    clock_i = clock_order[np.arange(n) % n_clocks]
    sms_i = ((rng.permutation(n) + rng.random(n)) / n * n_sms).astype(int)
    slot_i = rng.permutation(n) % n_slots
    chosen: list[int] = []
    taken: set[int] = set()
    for c, s, k in zip(clock_i, sms_i, slot_i, strict=True):
        index = (int(c) * n_sms + int(s)) * n_slots + int(k)
        if index in taken:  # collision: the nearest free configuration at the same clock
            index = _nearest_free(space, int(c), int(s), int(k), taken)
        chosen.append(index)
        taken.add(index)
    return np.asarray(chosen, dtype=int)


def clock_sweep_design(space: SearchSpace) -> np.ndarray:
    """The grid indices of every configuration at the middle clock (the lower median frequency)."""
    per_clock = space.configurations
    middle = int(np.argsort(space.clocks_mhz)[(len(space.clocks_mhz) - 1) // 2])
    return np.arange(middle * per_clock, (middle + 1) * per_clock)


def _nearest_free(space: SearchSpace, clock_i: int, sms_i: int, slot_i: int, taken: set[int]) -> int:
    n_sms, n_slots = len(space.comm_sms), len(space.launch_slots)
    sms_steps = sorted(range(n_sms), key=lambda s: abs(s - sms_i))
    for c in [clock_i, *sorted(range(len(space.clocks_mhz)), key=lambda c: abs(c - clock_i))]:
        for s in sms_steps:
            for k in [slot_i, *range(n_slots)]:
                index = (c * n_sms + s) * n_slots + k
                if index not in taken:
                    return index
    raise ValueError("design larger than the grid")
