"""The Grafana dashboards Kareus ships, built with Grafana's own typed SDK and written beside this script.

Three dashboards: **cluster energy** (GPU power, energy per namespace and per KareusJob, the power
budget vs predicted vs measured power, SM clocks, clock changes, node-agent refusals), **job view** (iteration time, energy per iteration, tokens per
joule, predicted vs measured, the plan in use) and **operator health** (jobs per phase, phase
durations, profile reuse). Panels, variables and dashboards are built with `grafana-foundation-sdk`
(Grafana's generated builders for its dashboard schema, Apache-2.0), so a field Grafana does not
know fails here, not in a user's Grafana. Every panel queries Prometheus through a `datasource`
variable, so the dashboards work with whichever Prometheus a cluster has; every metric name comes
from `kareus.metric_names` (a test re-checks the rendered PromQL against `all_metric_names()`, and
tests/test_dashboards_live.py runs every query against a real Prometheus after a real job).

Run `python helm/kareus/dashboards/generate.py` after editing; a test fails when the JSON files and
this script disagree. The chart ships the JSON (templates/dashboards-configmap.yaml), so neither
Helm nor a cluster needs the SDK.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, common, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models import prometheus as prometheus_models

from kareus import metric_names as m

HERE = Path(__file__).resolve().parent
DATASOURCE = models.DataSourceRef(type_val="prometheus", uid="${datasource}")
KWH_PER_J = "3.6e6"
RATE = "[$__rate_interval]"
GRID_W = 24


# ---------------------------------------------------------------- building blocks


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False,
           table_format: bool = False) -> prometheus.Dataquery:
    query = (prometheus.Dataquery().datasource(DATASOURCE).expr(expr).legend_format(legend or "__auto")
             .ref_id(ref))
    if instant:
        query = query.instant()
    if table_format:
        query = query.format(prometheus_models.PromQueryFormat.TABLE)
    return query


def _common(builder, title: str, targets: list[prometheus.Dataquery], unit: str, w: int, h: int,
            description: str):
    return (builder.title(title).description(description).datasource(DATASOURCE).targets(targets)
            .unit(unit).span(w).height(h))


def stat_panel(title: str, expr: str, unit: str, description: str, w: int = 6) -> stat.Panel:
    return (_common(stat.Panel(), title, [target(expr, instant=True)], unit, w, 4, description)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
            .color_mode(common_models.BigValueColorMode.VALUE))


def timeseries_panel(title: str, targets: list[prometheus.Dataquery], unit: str, description: str,
                     w: int = 12) -> timeseries.Panel:
    return (_common(timeseries.Panel(), title, targets, unit, w, 8, description)
            .legend(common.VizLegendOptions().display_mode(common_models.LegendDisplayMode.TABLE)
                    .placement(common_models.LegendPlacement.BOTTOM).calcs(["mean", "max"]).show_legend(True))
            .tooltip(common.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)))


def bars_panel(title: str, expr: str, legend: str, unit: str, description: str, w: int = 12) -> bargauge.Panel:
    return (_common(bargauge.Panel(), title, [target(expr, legend, instant=True)], unit, w, 8, description)
            .orientation(common_models.VizOrientation.HORIZONTAL)
            .display_mode(common_models.BarGaugeDisplayMode.BASIC)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def table_panel(title: str, targets: list[prometheus.Dataquery], description: str, w: int = GRID_W) -> table.Panel:
    return (_common(table.Panel(), title, targets, "none", w, 7, description).show_header(True)
            .with_transformation(models.DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(models.DataTransformerConfig(
                id_val="organize", options={"excludeByName": {"Time": True, "__name__": True}})))


def query_variable(name: str, label: str, query: str) -> db.QueryVariable:
    return (db.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": query, "refId": f"{name}-variable"})
            .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(models.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def datasource_variable() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


Item = db.Row | stat.Panel | timeseries.Panel | bargauge.Panel | table.Panel


def dashboard(uid: str, title: str, description: str, variables: list[db.QueryVariable],
              items: list[Item]) -> dict:
    """The dashboard as Grafana's JSON model (a dict). Rows and panels flow left to right, top to
    bottom, as the SDK's builder places them on Grafana's 24-column grid."""
    builder = (db.Dashboard(title).uid(uid).description(description).tags(["kareus", "energy", "gpu"])
               .editable().tooltip(models.DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-6h", "now")
               .timezone("browser").fiscal_year_start_month(0).version(1)
               .link(db.DashboardLink("Kareus dashboards").type(models.DashboardLinkType.DASHBOARDS)
                     .tags(["kareus"]).as_dropdown(True))
               .with_variable(datasource_variable()))
    for variable in variables:
        builder = builder.with_variable(variable)
    for item in items:
        builder = builder.with_row(item) if isinstance(item, db.Row) else builder.with_panel(item)
    model = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    # Ids in reading order, rows included: unique within the dashboard (Grafana keys panel links and
    # state on them; the SDK leaves them unset).
    for number, panel in enumerate(model["panels"], start=1):
        panel["id"] = number
    return model


def row(title: str) -> db.Row:
    return db.Row(title)


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
            stat_panel("GPU power now", f"sum({m.GPU_POWER_WATTS}{{{NODE}}})", "watt",
                       "Power drawn by every GPU the node agents see."),
            stat_panel("GPU energy in range",
                       f"sum(increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE}}}[$__range])) / {KWH_PER_J}",
                       "kwatth", "Energy of every GPU over the dashboard's time range."),
            stat_panel("Energy of KareusJobs in range",
                       f"sum(increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE},{owned}}}[$__range])) / {KWH_PER_J}",
                       "kwatth", "Energy of GPUs while a KareusJob pod held them."),
            stat_panel("GPUs with a locked clock", f"count({m.GPU_LOCKED_CLOCK_HERTZ}{{{NODE}}} > 0)", "none",
                       "GPUs whose SM clock a training pod has locked through the node agent."),
            timeseries_panel("GPU power per node",
                             [target(f"sum by (node) ({m.GPU_POWER_WATTS}{{{NODE}}})", "{{node}}")],
                             "watt", "Sum of GPU power per node."),
            timeseries_panel("GPU power per KareusJob",
                             [target(f"sum by (namespace, kareusjob) ({m.GPU_POWER_WATTS}{{{NODE},{owned}}})",
                                     "{{namespace}}/{{kareusjob}}")],
                             "watt", "Power of the GPUs each KareusJob holds."),
            bars_panel("Energy per namespace",
                       f"sum by (namespace) (increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE},namespace!=\"\"}}"
                       f"[$__range])) / {KWH_PER_J}", "{{namespace}}", "kwatth",
                       "GPU energy per namespace over the time range; compare with policy.namespaceEnergyBudgets."),
            bars_panel("Energy per KareusJob",
                       f"sum by (namespace, kareusjob) (increase({m.GPU_ENERGY_JOULES_TOTAL}{{{NODE},{owned}}}"
                       f"[$__range])) / {KWH_PER_J}", "{{namespace}}/{{kareusjob}}", "kwatth",
                       "GPU energy per KareusJob over the time range."),
            row("Power budget"),
            timeseries_panel("Power budget vs predicted vs measured",
                             [target(f"{m.POWER_BUDGET_WATTS}", "budget {{scope}} {{name}}", "A"),
                              target(f"sum({m.JOB_POWER_ALLOTMENT_WATTS})", "predicted (allotted points)", "B"),
                              target(f"sum({m.JOB_MEASURED_POWER_WATTS})", "measured (KareusJobs)", "C")],
                             "watt", "policy.powerBudget per scope, the summed predicted power of the frontier "
                                     "points the operator allotted to the running KareusJobs, and what they measure.",
                             w=18),
            stat_panel("Jobs held by the power budget", f"max({m.POWER_BUDGET_HELD_JOBS})", "none",
                       "New KareusJobs not started because the budget cannot fit them.", w=6),
            row("Clocks"),
            timeseries_panel("SM clock per GPU",
                             [target(f"{m.GPU_SM_CLOCK_HERTZ}{{{NODE}}}", "{{node}} {{gpu_uuid}}", "A"),
                              target(f"{m.GPU_LOCKED_CLOCK_HERTZ}{{{NODE}}} > 0", "locked {{node}} {{gpu_uuid}}", "B")],
                             "hertz", "Measured SM clock and, where set, the locked clock the plan asked for."),
            timeseries_panel("Clock changes",
                             [target(f"sum by (node) (rate({m.GPU_CLOCK_CHANGES_TOTAL}{{{NODE}}}{RATE}))", "{{node}}")],
                             "ops", "Clock locks and resets applied per second (a plan switches per instruction)."),
            row("Node agents"),
            timeseries_panel("Refused clock requests",
                             [target(f'sum by (node, result) (rate({m.DAEMON_REQUESTS_TOTAL}{{{NODE},result!="ok"}}'
                                     f"{RATE}))", "{{node}} {{result}}")],
                             "reqps", "Requests the node agent refused or failed (another pod's GPU, outside the "
                                      "clock bounds, shared or MIG GPU, dry run)."),
            timeseries_panel("Node agent request latency",
                             [target(f"histogram_quantile(0.5, sum by (le) (rate({m.DAEMON_REQUEST_SECONDS}_bucket"
                                     f"{{{NODE}}}{RATE})))", "p50", "A"),
                              target(f"histogram_quantile(0.99, sum by (le) (rate({m.DAEMON_REQUEST_SECONDS}_bucket"
                                     f"{{{NODE}}}{RATE})))", "p99", "B")],
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
    energy_left_j = (f"max by ({per_job}) ({m.JOB_PROJECTED_ENERGY_JOULES}{{{job}}}) - "
                     f"max by ({per_job}) ({m.JOB_MEASURED_ENERGY_JOULES}{{{job}}})")
    return dashboard(
        "kareus-job", "Kareus / Job",
        "One KareusJob: iteration time and energy, tokens per joule, the plan in use and its predictions, "
        "progress, ETA and the energy still to spend.",
        [query_variable("namespace", "Namespace", f"label_values({m.PLAN_INFO}, namespace)"),
         query_variable("kareusjob", "KareusJob", f'label_values({m.PLAN_INFO}{{namespace=~"$namespace"}}, kareusjob)')],
        [
            row("Training"),
            stat_panel("Iteration time", iteration_s, "s", "Wall time of the last iteration (slowest rank)."),
            stat_panel("Energy per iteration", iteration_j, "joule",
                       "Energy of the last iteration, all GPUs of the job together."),
            stat_panel("Tokens per joule", f"max by ({per_job}) ({m.TOKENS_PER_JOULE}{{{job}}})", "none",
                       "Training tokens per joule of GPU energy."),
            stat_panel("Job GPU power", f"sum({m.GPU_POWER_WATTS}{{{job}}})", "watt",
                       "Power of the job's GPUs, measured by the node agents."),
            timeseries_panel("Iteration time", [target(iteration_s, "{{namespace}}/{{kareusjob}}")],
                             "s", "Wall time of each iteration (slowest rank)."),
            timeseries_panel("Energy per iteration",
                             [target(iteration_j, "reported {{kareusjob}}", "A"),
                              target(f"sum by ({per_job}) (rate({m.GPU_ENERGY_JOULES_TOTAL}{{{job}}}{RATE})) * "
                                     f"{iteration_s}", "node agents {{kareusjob}}", "B")],
                             "joule", "Energy per iteration as the workers report it and as the node agents "
                                      "measure it (job GPU power × iteration time); they should agree."),
            timeseries_panel("Tokens per joule", [target(f"max by ({per_job}) ({m.TOKENS_PER_JOULE}{{{job}}})",
                                                         "{{namespace}}/{{kareusjob}}")],
                             "none", "Higher is better."),
            timeseries_panel("Energy per iteration per GPU",
                             [target(f'{m.ITERATION_ENERGY_JOULES}{{{job},scope="gpu"}}', "rank {{rank}} stage {{stage}}")],
                             "joule", "Each rank's own GPU: pipeline stages off the critical path run at lower clocks."),
            timeseries_panel("SM clocks of the job's GPUs",
                             [target(f"{m.GPU_SM_CLOCK_HERTZ}{{{job}}}", "{{node}} {{gpu_uuid}}")],
                             "hertz", "The clocks the plan switches between, per instruction.", w=GRID_W),
            row("Progress"),
            stat_panel("Complete", f"max by ({per_job}) ({m.JOB_PROGRESS_RATIO}{{{job}}})", "percentunit",
                       "Share of spec.training.steps done, across restarts (status.measured.percentComplete)."),
            stat_panel("ETA", f"max by ({per_job}) ({m.JOB_ETA_SECONDS}{{{job}}})", "s",
                       "Training time left at the measured iteration time (status.measured.etaSeconds)."),
            stat_panel("Energy still to spend", energy_left_j, "joule",
                       "Energy of the steps left at the measured rate: projectedTotalJoules minus energyJoules."),
            stat_panel("Energy spent", f"max by ({per_job}) ({m.JOB_MEASURED_ENERGY_JOULES}{{{job}}})", "joule",
                       "GPU energy of the steps done, each counted once across restarts (status.measured.energyJoules)."),
            timeseries_panel("ETA", [target(f"max by ({per_job}) ({m.JOB_ETA_SECONDS}{{{job}}})",
                                            "{{namespace}}/{{kareusjob}}")],
                             "s", "Training time left; it falls by one second a second when the pace holds."),
            timeseries_panel("Energy spent and still to spend",
                             [target(f"max by ({per_job}) ({m.JOB_MEASURED_ENERGY_JOULES}{{{job}}})",
                                     "spent {{kareusjob}}", "A"),
                              target(energy_left_j, "still to spend {{kareusjob}}", "B")],
                             "joule", "The measured energy and the energy the rest of the run will spend at the "
                                      "measured rate; together the projected total."),
            row("Plan"),
            table_panel("Plan in use: predicted vs measured",
                        [target(f'{m.PLAN_INFO}{{{job},rank="0"}}', ref="A", instant=True, table_format=True),
                         target(iteration_s, ref="B", instant=True, table_format=True),
                         target(iteration_j, ref="C", instant=True, table_format=True)],
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
            stat_panel("Training jobs", f'sum({m.JOBS}{{phase="Training"}})', "none", "KareusJobs training now."),
            stat_panel("Failed jobs", f'sum({m.JOBS}{{phase="Failed"}})', "none", "KareusJobs in phase Failed."),
            stat_panel("Profiles reused in range", f"sum(increase({m.PROFILE_CACHE_HITS_TOTAL}[$__range]))", "none",
                       "Jobs that skipped profiling because a stored profile matched."),
            stat_panel("Jobs profiling or optimizing", f'sum({m.JOBS}{{phase=~"Profiling|Optimizing"}})', "none",
                       "KareusJobs before training."),
            timeseries_panel("Jobs per phase", [target(f"sum by (phase) ({m.JOBS})", "{{phase}}")], "none",
                             "KareusJobs in each phase.", w=GRID_W),
            row("Phases"),
            timeseries_panel("Phase duration p50",
                             [target(f"histogram_quantile(0.5, sum by (le, phase) (rate({m.PHASE_SECONDS}_bucket{RATE})))",
                                     "{{phase}}")], "s", "Median time a job spends in each phase."),
            timeseries_panel("Phase duration p90",
                             [target(f"histogram_quantile(0.9, sum by (le, phase) (rate({m.PHASE_SECONDS}_bucket{RATE})))",
                                     "{{phase}}")], "s", "90th percentile time a job spends in each phase."),
            timeseries_panel("Profile cache hits",
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
