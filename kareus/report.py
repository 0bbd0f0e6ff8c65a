"""The one-page HTML report of a local run: what Kareus chose, what it saves, how training went.

`kareus run` writes `report.html` beside its JSON outputs. The page is self-contained (images are
embedded as data URIs, styles inline) so it can be mailed or attached to a ticket as one file. It
shows the methods' iteration frontiers, a per-stage timeline of the chosen plan coloured by clock,
the partition configurations the plan uses, and the training curve (loss and energy per step).
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kareus.plan import Plan

# Matplotlib is imported lazily: the core stays importable without a display or a font cache.


@dataclass(frozen=True)
class TimelineBar:
    """One instruction on the plan's pipeline timeline."""

    stage: int
    kind: str
    microbatch: int
    clock_mhz: int
    start_s: float
    time_s: float


def plan_timeline(plan: Plan) -> list[TimelineBar]:
    """Start times of every instruction of the selected plan under synchronous 1F1B.

    A stage runs its instructions in order; forward m on stage s waits for forward m on s-1,
    backward m on stage s waits for backward m on s+1 (pipeline P2P time is not modelled, as in
    the optimizer's DAG). Durations are the chosen options' microbatch times.
    """
    row = plan.frontier.rows[plan.selected_row]
    num_stages = len(plan.stages)
    durations: dict[tuple[int, str, int], float] = {}
    for s, (fwd, bwd) in enumerate(row.choice):
        for kind, picks in (("forward", fwd), ("backward", bwd)):
            for m, option_index in enumerate(picks):
                durations[s, kind, m] = plan.frontier.options[s].of(kind)[option_index].time_s
    end: dict[tuple[int, str, int], float] = {}
    bars: list[TimelineBar] = []
    cursor = [0] * num_stages
    stage_free = [0.0] * num_stages
    remaining = sum(len(st.instructions) for st in plan.stages)
    while remaining:
        progressed = False
        for s, stage in enumerate(plan.stages):
            while cursor[s] < len(stage.instructions):
                instr = stage.instructions[cursor[s]]
                dep = (s - 1, "forward", instr.microbatch) if instr.kind == "forward" \
                    else (s + 1, "backward", instr.microbatch)
                if 0 <= dep[0] < num_stages and dep not in end:
                    break
                start = max(stage_free[s], end.get(dep, 0.0))
                time_s = durations[s, instr.kind, instr.microbatch]
                end[s, instr.kind, instr.microbatch] = stage_free[s] = start + time_s
                bars.append(TimelineBar(s, instr.kind, instr.microbatch, instr.clock_mhz, start, time_s))
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("plan instructions do not form a valid 1F1B order")
    return bars


def config_usage(plan: Plan) -> list[tuple[str, str, str, int]]:
    """(direction, partition type, "slot / SMs", instructions using it), most used first."""
    usage: Counter[tuple[str, str, str]] = Counter()
    for stage in plan.stages:
        for instr in stage.instructions:
            if instr.mode == "sequential":
                usage[instr.kind, "(whole microbatch)", "sequential"] += 1
                continue
            for group, configs in (("", instr.configs), ("recompute ", instr.recompute_configs)):
                for ptype, cfg in configs.items():
                    usage[instr.kind, f"{group}{ptype}", f"{cfg.launch_slot} / {cfg.comm_sms} SMs"] += 1
    rows = [(kind, ptype, cfg, n) for (kind, ptype, cfg), n in usage.items()]
    return sorted(rows, key=lambda r: (r[0] != "forward", r[1], -r[3]))


def timeline_png(plan: Plan) -> bytes:
    """A Gantt chart of the selected plan, one row per stage, bars coloured by SM clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    bars = plan_timeline(plan)
    clocks = [b.clock_mhz for b in bars]
    norm = Normalize(vmin=min(clocks) - 1, vmax=max(clocks) + 1)
    cmap = colormaps["plasma"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(plan.stages)))
    for bar in bars:
        ax.barh(bar.stage, bar.time_s * 1e3, left=bar.start_s * 1e3, height=0.7,
                color=cmap(norm(bar.clock_mhz)), edgecolor="black", linewidth=0.4,
                hatch="" if bar.kind == "forward" else "//")
        ax.text((bar.start_s + bar.time_s / 2) * 1e3, bar.stage, f"{bar.kind[0].upper()}{bar.microbatch}",
                ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(plan.stages)), [f"stage {s}" for s in range(len(plan.stages))])
    ax.invert_yaxis()
    ax.set_xlabel("time in iteration (ms)")
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="SM clock (MHz)")
    ax.set_title("Chosen plan: per-stage instructions (F forward, B backward, hatched = backward)")
    fig.tight_layout()
    return _png(fig)


def training_png(records: Sequence[Mapping]) -> bytes:
    """Loss and energy per step, from `train.jsonl` records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(steps, [r["loss"] for r in records], color="tab:blue", marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    energy_ax = ax.twinx()
    energy_ax.plot(steps, [r["energy_j"] / 1e3 for r in records], color="tab:red", marker=".")
    energy_ax.set_ylabel("energy per step (kJ)", color="tab:red")
    ax.set_title("Training")
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:0}.sub{color:#666;margin-top:.2em}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .7em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}
"""


def render_report(*, title: str, summary: Mapping, plan: Plan, frontier_png: bytes,
                  train_records: Sequence[Mapping] = ()) -> str:
    """The whole report page as one HTML string.

    `summary` is the `summary.json` document of `kareus run`: `methods` (per method the
    max-throughput `time_s`/`energy_j`), `metrics` and `plan` (predicted and measured).
    """
    metric_keys = ("max_throughput_time_reduction", "max_throughput_energy_reduction",
                   "iso_time_energy_reduction", "iso_energy_time_reduction")
    method_rows = [(m.get("label", name), f"{m['time_s']:.4g}", f"{m['energy_j'] / 1e3:.4g}",
                    *(_percent(m.get(key)) for key in metric_keys))
                   for name, m in summary.get("methods", {}).items()]
    plan_rows = [(k, _fmt(v)) for k, v in summary.get("plan", {}).items()]
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">profile {html.escape(plan.provenance.profile_key)} · objective '
        f"{html.escape(str(dict(plan.objective)))}</p>",
        "<h2>Iteration frontiers</h2>",
        _img(frontier_png, "frontier.png"),
        "<h2>Methods side by side</h2>",
        '<p class="sub">Max-throughput iteration of each method (energy of all GPUs, static included) and '
        "reductions: max-throughput time and energy vs Megatron-LM, iso-time energy and iso-energy time vs "
        "Megatron+Perseus (positive = less; − = no plan meets the constraint).</p>",
        _table(("method", "iteration time (s)", "iteration energy (kJ)", "time vs Megatron",
                "energy vs Megatron", "iso-time energy", "iso-energy time"), method_rows),
        "<h2>Chosen plan</h2>",
        _table(("quantity", "value"), plan_rows),
        _img(timeline_png(plan), "plan timeline"),
        "<h2>Partition configurations</h2>",
        _table(("instruction", "partition type", "launch slot / comm SMs", "instructions"),
               config_usage(plan)),
    ]
    if train_records:
        sections += ["<h2>Training</h2>", _img(training_png(train_records), "training curve")]
    body = "\n".join(sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def _percent(value: float | None) -> str:
    return "−" if value is None else f"{100 * value:.1f} %"


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)
