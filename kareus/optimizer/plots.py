"""Frontier plots: every method's iteration frontier in one time–energy chart.

Axes are the iteration time in seconds and the iteration energy over all GPUs in kJ (static
energy included). The chosen plan is marked. Rendering uses matplotlib's Agg backend, so no
display is needed; `kareus frontier`, `kareus compare --png` and `kareus run` call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kareus.errors import KareusError
from kareus.plan import Plan

STYLE = {  # method → (label, colour, marker); the baselines of the paper's Fig. 9 order
    "megatron": ("Megatron-LM", "#7f7f7f", "s"),
    "megatron_perseus": ("Megatron+Perseus", "#1f77b4", "o"),
    "nanobatch": ("Nanobatching", "#bcbd22", "D"),
    "nanobatch_perseus": ("Nanobatching+Perseus", "#ff7f0e", "^"),
    "kareus": ("Kareus", "#d62728", "*"),
    "kareus_exhaustive": ("Kareus (exhaustive)", "#9467bd", "x"),
}


def plan_frontiers(plan: Plan) -> dict[str, list[tuple[float, float]]]:
    """Every method's frontier stored in a plan, Kareus' own included."""
    out = {name: list(mf.points) for name, mf in plan.baselines.items()}
    out[plan.method] = plan.frontier.points()
    return out


def plot_frontiers(frontiers: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *,
                   chosen: tuple[float, float] | None = None, title: str = "") -> Path:
    """Draw the frontiers (time_s, energy_j points per method) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not frontiers:
        raise KareusError("nothing to plot: no frontier given")
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    try:
        for name, points in frontiers.items():
            label, colour, marker = STYLE.get(name, (name, None, "."))
            pts = sorted(points)
            ax.plot([t for t, _ in pts], [e / 1e3 for _, e in pts], marker=marker, markersize=4,
                    linewidth=1.2, color=colour, label=label)
        if chosen is not None:
            ax.plot([chosen[0]], [chosen[1] / 1e3], marker="o", markersize=12, markerfacecolor="none",
                    markeredgecolor="black", markeredgewidth=1.5, linestyle="none", label="chosen plan")
        ax.set_xlabel("iteration time (s)")
        ax.set_ylabel("iteration energy, all GPUs (kJ)")
        ax.set_title(title or "Iteration time–energy frontiers")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        try:
            fig.savefig(path, format="png")
        except OSError as error:
            raise KareusError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        plt.close(fig)
    return path


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """Every method's frontier stored in the plan, with the plan's own choice marked."""
    chosen = (plan.predicted.iteration_time_s, plan.predicted.iteration_energy_j)
    title = f"{plan.job.name or plan.job.model.name}: {plan.job.model.name}, TP{plan.job.tensor} " \
            f"CP{plan.job.context} PP{plan.job.pipeline}, {plan.job.num_micro_batches} microbatches"
    return plot_frontiers(plan_frontiers(plan), path, chosen=chosen, title=title)
