"""Cluster power budget: the allocator (`allocator`) and the twin's comparison with uniform power
limits (`twin`). See `allocator`'s docstring for the rules and `docs/power-budget.md`."""

from kareus.power_budget.allocator import (
    MAX_CELLS,
    MAX_DP_WORK,
    METHODS,
    SHRINK,
    Allocation,
    Allotment,
    BudgetUse,
    PowerJob,
    PowerPoint,
    allocate,
)
from kareus.power_budget.twin import (
    JobRun,
    PolicyRun,
    Twin,
    compare_with_uniform_limit,
    plan_power_limited_points,
    power_limited_points,
)

__all__ = [
    "MAX_CELLS",
    "MAX_DP_WORK",
    "METHODS",
    "SHRINK",
    "Allocation",
    "Allotment",
    "BudgetUse",
    "JobRun",
    "PolicyRun",
    "PowerJob",
    "PowerPoint",
    "Twin",
    "allocate",
    "compare_with_uniform_limit",
    "plan_power_limited_points",
    "power_limited_points",
]

