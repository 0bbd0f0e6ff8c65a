"""The one-page HTML report of a local run: what Kareus chose, what it saves, how training went.

`kareus run` writes `report.html` beside its JSON outputs. The page is self-contained (images are
embedded as data URIs, styles inline) so it can be mailed or attached to a ticket as one file. It
shows the methods' iteration frontiers, a per-stage timeline of the chosen plan coloured by clock,
the partition configurations the plan uses, and the training curve (loss and energy per step).

With a Prometheus that scrapes Kareus (`kareus dev-cluster` runs one), `job_energy_series` reads a
KareusJob's GPU power and energy over time from the node agents' series — the same series the
dashboards and alerts use — and `energy_png` draws them; `kareus report --prometheus URL JOB`
writes that as a page of its own (`render_job_report`), and `render_report(energy=...)` adds it to
a run's report. Quantities are shown in the unit their magnitude calls for (794 mJ, not
0.000794 kJ).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kareus.errors import KareusError
from kareus.plan import Plan

# Matplotlib is imported lazily: the core stays importable without a display or a font cache.

# A colour bar narrower than this says nothing: one clock would read as a 1409–1411 MHz scale.
MIN_CLOCK_SPAN_MHZ = 200.0
_PREFIXES = ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"))


def scaled(value: float, unit: str) -> tuple[float, str]:
    """`value` (in `unit`) rescaled by the SI prefix that puts it in [1, 1000):
    0.794 J is 794 mJ (not 0.000794 kJ), 16380 J is 16.38 kJ."""
    magnitude = abs(value)
    for factor, prefix in _PREFIXES:
        if magnitude >= factor:
            return value / factor, prefix + unit
    return (value / _PREFIXES[-1][0], _PREFIXES[-1][1] + unit) if magnitude else (0.0, unit)


def quantity(value: float | None, unit: str) -> str:
    """`value` (in the base unit) as text with the prefix its magnitude calls for, e.g. "794 mJ"."""
    if value is None or not math.isfinite(value):
        return "—"
    number, label = scaled(value, unit)
    return f"{number:.4g} {label}"


def _axis_scale(values: Sequence[float], unit: str) -> tuple[float, str]:
    """(divisor, prefixed unit) for plotting `values` on one axis, chosen by the largest of them."""
    peak = max(values, key=abs, default=0.0)
    number, label = scaled(peak, unit)
    return (peak / number if number else 1.0), label


def clock_range_mhz(clocks: Sequence[float]) -> tuple[float, float]:
    """The colour scale for these clocks: their range, widened (centred) to `MIN_CLOCK_SPAN_MHZ`."""
    low, high = min(clocks), max(clocks)
    if high - low < MIN_CLOCK_SPAN_MHZ:
        middle = (low + high) / 2
        low, high = middle - MIN_CLOCK_SPAN_MHZ / 2, middle + MIN_CLOCK_SPAN_MHZ / 2
    return low, high


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
    norm = Normalize(*clock_range_mhz(clocks))
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
    energies_j = [r["energy_j"] for r in records]
    factor, unit = _axis_scale(energies_j, "J")
    energy_ax.plot(steps, [e / factor for e in energies_j], color="tab:red", marker=".")
    energy_ax.set_ylabel(f"energy per step ({unit})", color="tab:red")
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
.lead{font-size:1.15em;font-weight:600;margin:.6em 0}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .7em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}
"""


def headline_text(summary: Mapping) -> str:
    """One sentence of the headline, or "" when a method is missing (an NVML run has no
    nanobatching baselines but always Megatron+Perseus)."""
    line = summary.get("headline", {})
    iso_time = line.get("iso_time_energy_reduction_vs_megatron_perseus")
    if iso_time is None:
        return ""
    text = (f"Kareus uses {percent(iso_time)} less energy than Megatron+Perseus at the same iteration time "
            f"(iso-time)")
    faster = line.get("max_throughput_time_reduction_vs_megatron")
    if faster is not None:
        text += (f"; its fastest plan is {percent(faster)} faster than Megatron-LM with "
                 f"{percent(line.get('max_throughput_energy_reduction_vs_megatron'))} less energy")
    training = summary.get("training")
    if training and training["cpu_proxy"]:
        text += (f". Trained here: a CPU proxy of {training['model']} ({training['trained_layers']} layers of hidden "
                 f"{training['trained_hidden']}, {training['trained_sequence_length']} tokens) in real processes "
                 f"following the plan; time and energy are {training['model']}'s on the simulated GPU")
    return text + "."


def render_report(*, title: str, summary: Mapping, plan: Plan, frontier_png: bytes,
                  train_records: Sequence[Mapping] = (), energy: JobEnergySeries | None = None) -> str:
    """The whole report page as one HTML string.

    `summary` is the `summary.json` document of `kareus run`: `methods` (per method the
    max-throughput `time_s`/`energy_j`), `metrics` and `plan` (predicted and measured). `energy`
    (from `job_energy_series`) adds the measured power and energy over time.
    """
    metric_keys = ("max_throughput_time_reduction", "max_throughput_energy_reduction",
                   "iso_time_energy_reduction", "iso_energy_time_reduction")
    method_rows = [(m.get("label", name), quantity(m["time_s"], "s"), quantity(m["energy_j"], "J"),
                    *(percent(m.get(key)) for key in metric_keys))
                   for name, m in summary.get("methods", {}).items()]
    plan_rows = [(k, format_value(v, k)) for k, v in summary.get("plan", {}).items()]
    lead = headline_text(summary)
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        *([f'<p class="lead">{html.escape(lead)}</p>'] if lead else []),
        f'<p class="sub">profile {html.escape(plan.provenance.profile_key)} · objective '
        f"{html.escape(str(dict(plan.objective)))}</p>",
        "<h2>Iteration frontiers</h2>",
        _img(frontier_png, "frontier.png"),
        "<h2>Methods side by side</h2>",
        '<p class="sub">Max-throughput iteration of each method (energy of all GPUs, static included) and '
        "reductions: max-throughput time and energy vs Megatron-LM, iso-time energy and iso-energy time vs "
        "Megatron+Perseus (positive = less; − = no plan meets the constraint).</p>",
        _table(("method", "iteration time", "iteration energy", "time vs Megatron",
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
    if energy is not None:
        sections += energy_section(energy)
    return _page(title, sections)


def _page(title: str, sections: Sequence[str]) -> str:
    body = "\n".join(sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def percent(value: float | None) -> str:
    """A fraction as a percentage with one decimal (never "-0.0 %"); "−" for no value."""
    return "−" if value is None else f"{100 * value + 0.0:.1f} %"


def format_value(value: object, key: str = "") -> str:
    """A summary value; a key ending in a unit (`_j`, `_s`, `_w`) says which prefix it needs."""
    units = {"_j": "J", "_s": "s", "_w": "W"}
    unit = next((u for suffix, u in units.items() if key.endswith(suffix)), None)
    if isinstance(value, int | float) and not isinstance(value, bool) and unit:
        return quantity(float(value), unit)
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


# ---------------------------------------------------------------- power and energy from Prometheus


@dataclass(frozen=True)
class JobEnergySeries:
    """A KareusJob's GPUs over time, as the node agents measured them (Prometheus range queries).

    `time_s` are Unix times; `power_w` is the sum over the job's GPUs; `energy_j` the energy since
    the first sample (the rise of every owned GPU's energy counter, summed); `gpus` how many GPUs
    the job held.
    """

    namespace: str
    job: str
    prometheus: str
    time_s: tuple[float, ...]
    power_w: tuple[float, ...]
    energy_j: tuple[float, ...]
    gpus: int

    @property
    def total_energy_j(self) -> float:
        return self.energy_j[-1] if self.energy_j else 0.0

    @property
    def duration_s(self) -> float:
        return self.time_s[-1] - self.time_s[0] if self.time_s else 0.0


def prometheus_query(url: str, path: str, **params: object) -> object:
    """GET `<url>/api/v1/<path>`; the `data` of a success, a KareusError with Prometheus' message."""
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/{path}?{query}", timeout=30) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as error:
        body = json.loads(error.read() or b"{}")
    except (OSError, ValueError) as error:
        raise KareusError(f"cannot query Prometheus at {url}: {error}") from None
    if body.get("status") != "success":
        raise KareusError(f"Prometheus {path}: {body.get('error', 'no answer')}")
    return body["data"]


def job_energy_series(url: str, namespace: str, job: str, *, start_s: float, end_s: float,
                      step_s: float = 2.0) -> JobEnergySeries:
    """Power and energy of the job's GPUs between `start_s` and `end_s` (Unix times), trimmed to
    when the job held GPUs; a KareusError when it held none then."""
    owned = f'namespace="{namespace}",kareusjob="{job}"'

    def matrix(expr: str) -> list[dict]:
        return prometheus_query(url, "query_range", query=expr, start=start_s, end=end_s, step=step_s)["result"]

    power = matrix(f"sum(kareus_gpu_power_watts{{{owned}}})")
    counters = matrix(f"kareus_gpu_energy_joules_total{{{owned}}}")
    if not power or not counters:
        raise KareusError(f"Prometheus at {url} has no GPU series of KareusJob {namespace}/{job} between "
                          f"{start_s:.0f} and {end_s:.0f}")
    times = [float(t) for t, _ in power[0]["values"]]
    # Each owned GPU's counter rises from its first sample; the job's energy at t is the sum of
    # those rises up to t (a GPU not yet owned adds nothing).
    rises: dict[float, float] = dict.fromkeys(times, 0.0)
    for series in counters:
        points = [(float(t), float(v)) for t, v in series["values"]]
        first = points[0][1]
        last_rise, i = 0.0, 0
        for t in times:
            while i < len(points) and points[i][0] <= t:
                last_rise = points[i][1] - first
                i += 1
            rises[t] += last_rise
    return JobEnergySeries(namespace, job, url, tuple(times), tuple(float(v) for _, v in power[0]["values"]),
                           tuple(rises[t] for t in times), len({s["metric"].get("gpu_uuid") for s in counters}))


def energy_png(series: JobEnergySeries) -> bytes:
    """GPU power and cumulative energy of the job over time (seconds since its first sample)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = series.time_s[0]
    elapsed = [t - t0 for t in series.time_s]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(elapsed, series.power_w, color="tab:orange")
    ax.set_xlabel("time since the job first held a GPU (s)")
    ax.set_ylabel(f"GPU power, {series.gpus} GPUs (W)", color="tab:orange")
    ax.set_ylim(bottom=0)
    energy_ax = ax.twinx()
    factor, unit = _axis_scale(series.energy_j, "J")
    energy_ax.plot(elapsed, [e / factor for e in series.energy_j], color="tab:red")
    energy_ax.set_ylabel(f"energy ({unit})", color="tab:red")
    energy_ax.set_ylim(bottom=0)
    ax.set_title(f"{series.namespace}/{series.job}: measured by the node agents")
    fig.tight_layout()
    return _png(fig)


def energy_section(series: JobEnergySeries) -> list[str]:
    mean_w = sum(series.power_w) / len(series.power_w) if series.power_w else None
    rows = [("GPUs", series.gpus), ("time holding GPUs", quantity(series.duration_s, "s")),
            ("energy", quantity(series.total_energy_j, "J")), ("mean power", quantity(mean_w, "W")),
            ("source", f"{series.prometheus}: kareus_gpu_energy_joules_total, kareus_gpu_power_watts")]
    return ["<h2>Power and energy over time</h2>", _table(("quantity", "value"), rows),
            _img(energy_png(series), "power and energy over time")]


def render_job_report(series: JobEnergySeries, *, title: str | None = None) -> str:
    """A page of its own for a cluster job: its GPUs' power and energy over time."""
    return _page(title or f"Kareus job: {series.namespace}/{series.job}", [
        f"<h1>{html.escape(title or f'Kareus job: {series.namespace}/{series.job}')}</h1>",
        *energy_section(series)])
