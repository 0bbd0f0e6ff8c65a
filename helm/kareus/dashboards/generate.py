"""The Grafana dashboards Kareus ships, written as data and rendered to the JSON files beside this script.

Three dashboards: **cluster energy** (GPU power, energy per namespace and per KareusJob, SM clocks,
clock changes, node-agent refusals), **job view** (iteration time, energy per iteration, tokens per
joule, predicted vs measured, the plan in use) and **operator health** (jobs per phase, phase
durations, profile reuse). Every panel queries Prometheus through a `datasource` variable, so the
dashboards work with whichever Prometheus a cluster has; every metric name comes from
`kareus.metric_names` (a test re-checks the rendered PromQL against `all_metric_names()`).

Run `python helm/kareus/dashboards/generate.py` after editing; a test fails when the JSON files and
this script disagree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kareus import metric_names as m

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
KWH_PER_J = "3.6e6"
RATE = "[$__rate_interval]"
GRID_W = 24


# ---------------------------------------------------------------- building blocks


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, table: bool = False) -> dict:
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto", "refId": ref}
    if instant:
        t["instant"], t["range"] = True, False
    if table:
        t["format"] = "table"
    return t


def panel(kind: str, title: str, targets: list[dict], unit: str, w: int, h: int, description: str,
          **options: Any) -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "targets": targets, "gridPos": {"w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": options}


def stat(title: str, expr: str, unit: str, description: str, w: int = 6) -> dict:
    return panel("stat", title, [target(expr, instant=True)], unit, w, 4, description,
                 reduceOptions={"calcs": ["lastNotNull"]}, colorMode="value")


def timeseries(title: str, targets: list[dict], unit: str, description: str, w: int = 12) -> dict:
    return panel("timeseries", title, targets, unit, w, 8, description,
                 legend={"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                 tooltip={"mode": "multi"})


def bars(title: str, expr: str, legend: str, unit: str, description: str, w: int = 12) -> dict:
    return panel("bargauge", title, [target(expr, legend, instant=True)], unit, w, 8, description,
                 orientation="horizontal", displayMode="basic",
                 reduceOptions={"calcs": ["lastNotNull"], "values": False})


def table(title: str, targets: list[dict], description: str, w: int = GRID_W) -> dict:
    tbl = panel("table", title, targets, "none", w, 7, description, showHeader=True)
    tbl["transformations"] = [{"id": "merge", "options": {}},
                              {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True}}}]
    return tbl


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"w": GRID_W, "h": 1}, "panels": []}


def query_variable(name: str, label: str, query: str, *, multi: bool = True) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
            "refresh": 2, "sort": 1, "multi": multi, "includeAll": multi,
            "allValue": ".*" if multi else None, "current": {}, "hide": 0}


def datasource_variable() -> dict:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": ""}


def layout(panels: list[dict]) -> list[dict]:
    """Give panels ids and flow them left to right, top to bottom on Grafana's 24-column grid."""
    x = y = row_h = 0
    for number, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > GRID_W or p["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        p["id"] = number
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x, row_h = x + w, max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return panels


def dashboard(uid: str, title: str, description: str, variables: list[dict], panels: list[dict]) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["kareus", "energy", "gpu"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timezone": "browser", "fiscalYearStartMonth": 0,
        "annotations": {"list": []}, "links": [{"title": "Kareus dashboards", "type": "dashboards",
                                                "tags": ["kareus"], "asDropdown": True}],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout(panels),
    }


# ---------------------------------------------------------------- the dashboards

NODE = 'node=~"$node"'


def cluster_energy() -> dict:
    owned = 'kareusjob!=""'
    return dashboard(
        "kareus-cluster-energy", "Kareus / Cluster energy",
        "GPU power, energy per namespace and KareusJob, SM clocks and node-agent decisions (node agents).",
        [query_variable("node", "Node", f"label_values({m.GPU_POWER_WATTS}, node)")],
        [
            row("Power and energy"),
            stat("GPU power now", f"sum({m.GPU_POWER_WATTS}{{{NODE}}})", "watt",
                 "Power drawn by every GPU the node agents see."),
            stat("GPU energy in range", f"sum(increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE}}}[$__range])) / {KWH_PER_J}",
                 "kwatth", "Energy of every GPU over the dashboard's time range."),
            stat("Energy of KareusJobs in range",
                 f"sum(increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE},{owned}}}[$__range])) / {KWH_PER_J}",
                 "kwatth", "Energy of GPUs while a KareusJob pod held them."),
            stat("GPUs with a locked clock", f"count({m.GPU_LOCKED_CLOCK_HERTZ}{{{NODE}}} > 0)", "none",
                 "GPUs whose SM clock a training pod has locked through the node agent."),
            timeseries("GPU power per node", [target(f"sum by (node) ({m.GPU_POWER_WATTS}{{{NODE}}})", "{{node}}")],
                       "watt", "Sum of GPU power per node."),
            timeseries("GPU power per KareusJob",
                       [target(f"sum by (namespace, kareusjob) ({m.GPU_POWER_WATTS}{{{NODE},{owned}}})",
                               "{{namespace}}/{{kareusjob}}")],
                       "watt", "Power of the GPUs each KareusJob holds."),
            bars("Energy per namespace",
                 f"sum by (namespace) (increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE},namespace!=\"\"}}[$__range])) "
                 f"/ {KWH_PER_J}", "{{namespace}}", "kwatth",
                 "GPU energy per namespace over the time range; compare with policy.namespaceEnergyBudgets."),
            bars("Energy per KareusJob",
                 f"sum by (namespace, kareusjob) (increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE},{owned}}}[$__range])) "
                 f"/ {KWH_PER_J}", "{{namespace}}/{{kareusjob}}", "kwatth",
                 "GPU energy per KareusJob over the time range."),
            row("Clocks"),
            timeseries("SM clock per GPU",
                       [target(f"{m.GPU_SM_CLOCK_HERTZ}{{{NODE}}}", "{{node}} {{gpu_uuid}}", "A"),
                        target(f"{m.GPU_LOCKED_CLOCK_HERTZ}{{{NODE}}} > 0", "locked {{node}} {{gpu_uuid}}", "B")],
                       "hertz", "Measured SM clock and, where set, the locked clock the plan asked for."),
            timeseries("Clock changes",
                       [target(f"sum by (node) (rate({m.GPU_CLOCK_CHANGES_TOTAL}{{{NODE}}}{RATE}))", "{{node}}")],
                       "ops", "Clock locks and resets applied per second (a plan switches per instruction)."),
            row("Node agents"),
            timeseries("Refused clock requests",
                       [target(f'sum by (node, result) (rate({m.DAEMON_REQUESTS_TOTAL}{{{NODE},result!="ok"}}{RATE}))',
                               "{{node}} {{result}}")],
                       "reqps", "Requests the node agent refused or failed (another pod's GPU, outside the "
                                "clock bounds, shared or MIG GPU, dry run)."),
            timeseries("Node agent request latency",
                       [target(f"histogram_quantile(0.5, sum by (le) (rate({m.DAEMON_REQUEST_SECONDS}_bucket{{{NODE}}}"
                               f"{RATE})))", "p50", "A"),
                        target(f"histogram_quantile(0.99, sum by (le) (rate({m.DAEMON_REQUEST_SECONDS}_bucket{{{NODE}}}"
                               f"{RATE})))", "p99", "B")],
                       "s", "Time the node agent takes to answer a request."),
        ],
    )


def job_view() -> dict:
    job = 'namespace=~"$namespace",kareusjob=~"$kareusjob"'
    per_job = "namespace, kareusjob"
    # Workers report the last iteration as gauges per rank; the job's value is the slowest rank's
    # time and the job-scope energy (every rank reports the same sum over all GPUs).
    iteration_s = f"max by ({per_job}) ({m.ITERATION_SECONDS}{{{job}}})"
    iteration_j = f'max by ({per_job}) ({m.ITERATION_ENERGY_JOULES}{{{job},scope="job"}})'
    return dashboard(
        "kareus-job", "Kareus / Job",
        "One KareusJob: iteration time and energy, tokens per joule, the plan in use and its predictions.",
        [query_variable("namespace", "Namespace", f"label_values({m.PLAN_INFO}, namespace)"),
         query_variable("kareusjob", "KareusJob", f'label_values({m.PLAN_INFO}{{namespace=~"$namespace"}}, kareusjob)')],
        [
            row("Training"),
            stat("Iteration time", iteration_s, "s", "Wall time of the last iteration (slowest rank)."),
            stat("Energy per iteration", iteration_j, "joule",
                 "Energy of the last iteration, all GPUs of the job together."),
            stat("Tokens per joule", f"max by ({per_job}) ({m.TOKENS_PER_JOULE}{{{job}}})", "none",
                 "Training tokens per joule of GPU energy."),
            stat("Job GPU power", f"sum({m.GPU_POWER_WATTS}{{{job}}})", "watt",
                 "Power of the job's GPUs, measured by the node agents."),
            timeseries("Iteration time", [target(iteration_s, "{{namespace}}/{{kareusjob}}")],
                       "s", "Wall time of each iteration (slowest rank)."),
            timeseries("Energy per iteration",
                       [target(iteration_j, "reported {{kareusjob}}", "A"),
                        target(f"sum by ({per_job}) (rate({m.GPU_ENERGY_JOULES_TOTAL}{{{job}}}{RATE})) * {iteration_s}",
                               "node agents {{kareusjob}}", "B")],
                       "joule", "Energy per iteration as the workers report it and as the node agents measure "
                                "it (job GPU power × iteration time); they should agree."),
            timeseries("Tokens per joule", [target(f"max by ({per_job}) ({m.TOKENS_PER_JOULE}{{{job}}})",
                                                   "{{namespace}}/{{kareusjob}}")],
                       "none", "Higher is better."),
            timeseries("Energy per iteration per GPU",
                       [target(f'{m.ITERATION_ENERGY_JOULES}{{{job},scope="gpu"}}', "rank {{rank}} stage {{stage}}")],
                       "joule", "Each rank's own GPU: pipeline stages off the critical path run at lower clocks."),
            timeseries("SM clocks of the job's GPUs",
                       [target(f"{m.GPU_SM_CLOCK_HERTZ}{{{job}}}", "{{node}} {{gpu_uuid}}")],
                       "hertz", "The clocks the plan switches between, per instruction.", w=GRID_W),
            row("Plan"),
            table("Plan in use: predicted vs measured",
                  [target(f'{m.PLAN_INFO}{{{job},rank="0"}}', ref="A", instant=True, table=True),
                   target(iteration_s, ref="B", instant=True, table=True),
                   target(iteration_j, ref="C", instant=True, table=True)],
                  "The plan each job runs (the labels of kareus_plan_info: schedule mode, objective and the "
                  "plan's predicted iteration time and energy) beside the measured last iteration "
                  "(Value #B: seconds, Value #C: joules)."),
        ],
    )


def operator_health() -> dict:
    return dashboard(
        "kareus-operator", "Kareus / Operator",
        "The operator: KareusJobs per phase, how long phases take, profile reuse.",
        [],
        [
            row("Jobs"),
            stat("Running jobs", f'sum({m.JOBS}{{phase="Running"}})', "none", "KareusJobs training now."),
            stat("Failed jobs", f'sum({m.JOBS}{{phase="Failed"}})', "none", "KareusJobs in phase Failed."),
            stat("Profiles reused in range", f"sum(increase({m.PROFILE_CACHE_HITS_TOTAL}[$__range]))", "none",
                 "Jobs that skipped profiling because a stored profile matched."),
            stat("Jobs profiling or optimizing", f'sum({m.JOBS}{{phase=~"Profiling|Optimizing"}})', "none",
                 "KareusJobs before training."),
            timeseries("Jobs per phase", [target(f"sum by (phase) ({m.JOBS})", "{{phase}}")], "none",
                       "KareusJobs in each phase.", w=GRID_W),
            row("Phases"),
            timeseries("Phase duration p50",
                       [target(f"histogram_quantile(0.5, sum by (le, phase) (rate({m.PHASE_SECONDS}_bucket{RATE})))",
                               "{{phase}}")], "s", "Median time a job spends in each phase."),
            timeseries("Phase duration p90",
                       [target(f"histogram_quantile(0.9, sum by (le, phase) (rate({m.PHASE_SECONDS}_bucket{RATE})))",
                               "{{phase}}")], "s", "90th percentile time a job spends in each phase."),
            timeseries("Profile cache hits",
                       [target(f"sum(rate({m.PROFILE_CACHE_HITS_TOTAL}{RATE}))", "hits")], "ops",
                       "Profiles reused per second.", w=GRID_W),
        ],
    )


DASHBOARDS = {"cluster-energy": cluster_energy, "job": job_view, "operator": operator_health}


def render_all() -> dict[str, str]:
    """File name → JSON text of every dashboard."""
    return {f"{name}.json": json.dumps(build(), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}


def main() -> int:
    for name, text in render_all().items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
