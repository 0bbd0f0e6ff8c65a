"""Every dashboard query against a real Prometheus, after the quickstart ran end to end in the real cluster.

The session's dev cluster gets the monitoring API (the ServiceMonitor/PodMonitor/PrometheusRule
CRDs), the chart's monitors for its platform release (node agents, training pods), an operator
release watching namespace `obs` with its own ServiceMonitor, and a real Prometheus
(`kareus_devcluster.prometheus.DevPrometheus`: Debian's binary; targets from the real
API server, relabelled as the monitors say). `examples/quickstart.yaml` (16 steps instead of 8, so that its pod holds the GPUs for several
scrapes) then runs to Succeeded.

Checks:
- Prometheus' own target list is what the monitors select on the real pods (operator, node agent,
  every rank of the training pod) and every target is up.
- Every template variable of every shipped dashboard resolves (its `label_values` query, over the
  job's lifetime, offers the job's namespace, the job and the node).
- Every panel query of every shipped dashboard runs as Grafana runs it (instant targets in the
  middle of training — the workers report and the job holds its GPUs —, range targets over the job's lifetime, `$__range`,
  `$__rate_interval` and the variables substituted) without error, and every panel that describes
  a job or its GPUs returns finite values in its unit's range. The table of panels and results is
  printed (`pytest -s`).
- Energy: see test_energy_agrees.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from kube_helpers import install_platform_monitors, read_or_none, wait_until
from kubernetes import client, config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "helm" / "kareus" / "dashboards").glob("*.json"))}
GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
NS, JOB, RELEASE, RELEASE_NS = "obs", "quickstart", "obs", "obs-system"
SETTINGS = {"RESYNC_S": "2", "BACKOFF_BASE_S": "1", "PROGRESS_INTERVAL_S": "0.5", "LEASE_DURATION_S": "4"}
SCRAPE_S = 2.0  # the dev cluster's monitors scrape every 2 s (prometheus.SCRAPE_INTERVAL)
# A quickstart step holds its emulated GPUs for its modelled 2.9 s (TwinEnergy.run_step); 16 steps keep
# its pod on them for over 20 scrapes, so rates and increases over its lifetime have samples to work with.
STEPS = 16
QUICKSTART_GPUS = 4  # one training pod, one rank per GPU (tensor parallel 4)
# Panels whose correct answer for a healthy job is "nothing": no request was refused.
EMPTY_WHEN_HEALTHY = {"Refused clock requests"}
# What a value in a panel's unit may be (the simulated A100 idles at 85 W and clocks up to 1410 MHz).
UNIT_RANGE = {"watt": (0.0, 8 * 1000.0), "kwatth": (0.0, 1.0), "joule": (0.0, 1e7), "hertz": (1e8, 3e9),
              "s": (0.0, 3600.0), "none": (0.0, 1e9), "ops": (0.0, 1e4), "reqps": (0.0, 1e5),
              "percentunit": (0.0, 1.0)}


@pytest.fixture(scope="module")
def observed(dev_cluster, tmp_path_factory):
    """(cluster, prometheus, jobs API, core API): monitors, an operator release, Prometheus, and the
    quickstart finished."""
    from kareus_devcluster.prometheus import DevPrometheus

    metrics = install_platform_monitors(dev_cluster)
    # An operator release for namespace `obs`, with its own ServiceMonitor (its training pods are the
    # platform PodMonitor's).
    values = dev_cluster.values(operator=True, node_agent=False, settings=SETTINGS, worker_namespaces=[NS],
                                watch_namespaces=[NS], crds=False)
    values["metrics"] = {"serviceMonitor": metrics["serviceMonitor"]}
    objects = dev_cluster.install(RELEASE, RELEASE_NS, values)
    prometheus = DevPrometheus(tmp_path_factory.mktemp("prometheus"), dev_cluster.control_plane)
    api = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    jobs, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    with prometheus:
        job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
        job["spec"]["training"]["steps"] = STEPS
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
        done = wait_until(lambda: read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, JOB)),
                          lambda j: ((j or {}).get("status") or {}).get("phase") in ("Succeeded", "Failed"),
                          timeout_s=420, what="the quickstart job", interval_s=1.0)
        assert done["status"]["phase"] == "Succeeded", done["status"]
        time.sleep(3 * SCRAPE_S)  # the operator's last status and a final scrape of every target
        yield dev_cluster, prometheus, done, core
        jobs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, JOB)
    dev_cluster.uninstall(objects)


def training_pods(core) -> list:
    return core.list_namespaced_pod(NS, label_selector=f"kareus.dev/job-name={JOB},kareus.dev/role=train").items


def stamp(value) -> float:
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value.replace(tzinfo=value.tzinfo or UTC).timestamp()


@pytest.fixture(scope="module")
def window(observed) -> dict[str, float]:
    """The job's lifetime as Grafana would be set to look at it: from the training pods' start to their
    end (a scrape either side), and a moment in the middle of training (instant panels)."""
    _, prometheus, _, core = observed
    pods = training_pods(core)
    assert pods, "no training pod left to read the job's window from"
    start = min(stamp(p.status.start_time) for p in pods) - SCRAPE_S
    ends = [stamp(s.state.terminated.finished_at) for p in pods for s in p.status.container_statuses or []
            if s.state and s.state.terminated]
    end = max(ends) + 2 * SCRAPE_S
    def moments(expr: str) -> set[float]:
        result = prometheus.api("query_range", query=expr, start=start, end=end, step=1)["result"]
        return {float(t) for series in result for t, _ in series["values"]}

    owned = f'namespace="{NS}",kareusjob="{JOB}"'
    training = moments(f"max(kareus_iteration_seconds{{{owned}}})") & moments(f"max(kareus_gpu_power_watts{{{owned}}})")
    assert training, "no moment at which both the workers' series and the job's GPU series were in Prometheus"
    # Instant panels are looked at in the middle of training: the workers report and the GPUs are held.
    return {"start": start, "end": end, "last": sorted(training)[len(training) // 2]}


def test_prometheus_scrapes_what_the_monitors_select(observed):
    _, prometheus, _, core = observed
    active = prometheus.api("targets", state="active")["activeTargets"]
    up = {(t["labels"]["namespace"], t["labels"]["job"]) for t in active if t["health"] == "up"}
    assert ("kareus-node", "kareus-node-agent-metrics") in up
    assert (RELEASE_NS, f"{RELEASE}-kareus-operator-metrics") in up
    # The training pod's ranks were targets while it ran: their series carry the pod and rank.
    ranks = prometheus.api("series", **{"match[]": f'kareus_iteration_seconds{{namespace="{NS}",kareusjob="{JOB}"}}'})
    pods = {p.metadata.name for p in training_pods(core)}
    assert {s["pod"] for s in ranks} <= pods and {s["rank"] for s in ranks} == {str(r) for r in range(QUICKSTART_GPUS)}
    assert {s["endpoint"] for s in ranks} == {"metrics", *(f"metrics-{r}" for r in range(1, QUICKSTART_GPUS))}
    assert all(t["health"] == "up" for t in active if t["labels"]["namespace"] != NS), \
        [(t["labels"], t["lastError"]) for t in active if t["health"] != "up"]


# ---------------------------------------------------------------- Grafana's side, as a Prometheus client


def variable_values(prometheus, dashboard: dict, window: dict) -> dict[str, list[str]]:
    """Each query variable's options over the job's window (Grafana's label_values(selector, label))."""
    found: dict[str, list[str]] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"]).groups()
        for name, values in found.items():  # chained variables see the choice made before them
            selector = selector.replace(f"${name}", values[0] if values else "")
        found[variable["name"]] = prometheus.api(f"label/{label}/values", **{"match[]": selector},
                                                 start=window["start"], end=window["end"])
    return found


def chosen(values: dict[str, list[str]], node: str) -> dict[str, str]:
    want = {"namespace": NS, "kareusjob": JOB, "node": node}
    return {name: want[name] for name in values}


def regex_value(value: str) -> str:
    """A variable's value as Grafana puts it into a `=~"…"` matcher: regex metacharacters escaped,
    the backslash itself escaped for the PromQL string."""
    return "".join("\\\\" + ch if ch in r"\^$.|?*+()[]{}" else ch for ch in value)


def substitute(expr: str, variables: dict[str, str], range_s: float) -> str:
    rate_interval_s = max(4 * SCRAPE_S, SCRAPE_S + SCRAPE_S)  # Grafana: max(4 × scrape, interval + scrape)
    replacements = {"$__rate_interval": f"{int(rate_interval_s)}s", "$__range": f"{max(int(range_s), 1)}s",
                    "$__interval": f"{int(SCRAPE_S)}s", **{f"${k}": regex_value(v) for k, v in variables.items()}}
    for key in sorted(replacements, key=len, reverse=True):
        expr = expr.replace(key, replacements[key])
    assert "$" not in expr, expr
    return expr


def values_of(result: list[dict]) -> list[float]:
    out = []
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        out += [float(v) for _, v in points]
    return out


def run_panel(prometheus, panel: dict, variables: dict[str, str], window: dict) -> dict:
    """Every target of a panel as Grafana sends it; the panel's data and whether any query failed."""
    from kareus.errors import KareusError

    outcome = {"errors": [], "series": 0, "finite": []}
    for target in panel["targets"]:
        try:
            if target.get("instant"):
                expr = substitute(target["expr"], variables, window["last"] - window["start"])
                result = prometheus.api("query", query=expr, time=window["last"])["result"]
            else:
                expr = substitute(target["expr"], variables, window["end"] - window["start"])
                result = prometheus.api("query_range", query=expr, start=window["start"], end=window["end"],
                                        step=SCRAPE_S)["result"]
        except KareusError as error:
            outcome["errors"].append(f"{target['refId']}: {error}")
            continue
        outcome["series"] += len(result)
        outcome["finite"] += [v for v in values_of(result) if math.isfinite(v)]
    return outcome


def test_every_panel_query_runs_and_job_panels_return_data(observed, window):
    cluster, prometheus, _, _ = observed
    node = cluster.nodes[0].name
    rows, problems = [], []
    for name, dashboard in DASHBOARDS.items():
        options = variable_values(prometheus, dashboard, window)
        variables = chosen(options, node)
        for variable, value in variables.items():
            if value not in options[variable]:
                problems.append(f"{name}: variable ${variable} does not offer {value!r} (offers {options[variable]})")
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            unit = panel["fieldConfig"]["defaults"]["unit"]
            outcome = run_panel(prometheus, panel, variables, window)
            low, high = UNIT_RANGE[unit]
            data = outcome["finite"]
            verdict = ("ERROR " + "; ".join(outcome["errors"]) if outcome["errors"]
                       else f"{outcome['series']} series, {len(data)} values" +
                       (f", {min(data):.4g}…{max(data):.4g} {unit}" if data else ""))
            rows.append(f"{name:<20} {panel['title']:<42} {verdict}")
            if outcome["errors"]:
                problems.append(f"{name} / {panel['title']}: {outcome['errors']}")
            elif panel["title"] not in EMPTY_WHEN_HEALTHY and not data:
                problems.append(f"{name} / {panel['title']}: no data for the job")
            elif any(not low <= v <= high for v in data):
                problems.append(f"{name} / {panel['title']}: values {min(data):.4g}…{max(data):.4g} outside "
                                f"[{low:g}, {high:g}] {unit}")
    print("\n" + "\n".join(rows))
    assert problems == []


def test_energy_agrees(observed, window):
    """The job's energy three ways:
    - `status.measured.energyJoules` (the operator's sum of the workers' train.jsonl),
    - the training workers' own series (`kareus_iteration_energy_joules{scope="job"}`, the last
      iteration's energy of all GPUs, times the iterations),
    - the node agents' counters (`kareus_gpu_energy_joules_total`) of the GPUs the agents attributed
      to the job's pod: their rise over the job's window (a scrape before the pod started to two
      after it ended; a GPU's series changes labels when the pod takes and gives it back, so every
      sample of the GPU's UUID counts), then checked against the agents' own power gauge integrated
      over the same scrapes.
    Tolerances (docs/observability.md): workers vs status 1 % (the same numbers, rounded); agents vs
    status 0.1 % — on the simulated GPU both are the same counter (the ranks account each step's
    modelled energy on the node's shared GPU and read it back as its delta, the agent exports it, and
    time on the GPU is the modelled time, so nothing accrues between steps), leaving only float and
    6-decimal rounding; counter vs gauge 5 % (the gauge averages the last 2 s, the scrape interval, so its samples tile time;
    scrape jitter can move a step across a window's edge).
    """
    _, prometheus, done, _ = observed
    measured = done["status"]["measured"]
    status_j, iterations = float(measured["energyJoules"]), int(measured["iterations"])
    at, span = window["end"], f"{int(window['end'] - window['start'])}s"
    owned = f'namespace="{NS}",kareusjob="{JOB}"'

    last_j = prometheus.api("query", query=f'max(last_over_time(kareus_iteration_energy_joules{{{owned},scope="job"}}[{span}]))',
                            time=at)["result"]
    workers_j = float(last_j[0]["value"][1]) * iterations

    def samples(selector: str) -> dict[str, list[tuple[float, float]]]:
        """The raw samples per GPU UUID over the window (a range selector, not resampled), every
        label set of one GPU merged by time."""
        result = prometheus.api("query", query=f"{selector}[{span}]", time=at)["result"]
        merged: dict[str, dict[float, float]] = {}
        for series in result:
            merged.setdefault(series["metric"]["gpu_uuid"], {}).update((float(t), float(v)) for t, v in series["values"])
        return {uuid: sorted(points.items()) for uuid, points in merged.items()}

    def rise_j(points: list[tuple[float, float]]) -> float:
        return points[-1][1] - points[0][1]

    held = samples(f"kareus_gpu_energy_joules_total{{{owned}}}")  # while the agents attributed them to the pod
    gpus = set(held)
    match = "|".join(gpus)
    counters = samples(f'kareus_gpu_energy_joules_total{{gpu_uuid=~"{match}"}}')
    powers = samples(f'kareus_gpu_power_watts{{gpu_uuid=~"{match}"}}')
    agents_j = sum(rise_j(points) for points in counters.values())
    held_j = sum(rise_j(points) for points in held.values())
    integrated_j = sum((t1 - t0) * (p0 + p1) / 2 for points in powers.values()
                       for (t0, p0), (t1, p1) in itertools.pairwise(points))
    print(f"\nenergy of {NS}/{JOB} over its {iterations} steps: status.measured {status_j:.6g} J; workers' series "
          f"{workers_j:.6g} J; node agents' counters {agents_j:.6g} J on {len(gpus)} GPUs (relative difference "
          f"{abs(agents_j / status_j - 1):.1e}, tolerance 0.1 %; "
          f"{held_j:.6g} J of it between the scrapes that attributed the GPUs to the pod; their power gauge "
          f"integrated {integrated_j:.6g} J)")
    assert len(gpus) == QUICKSTART_GPUS and set(counters) == set(powers) == gpus  # its GPUs, attributed to its pod
    assert all(len(points) >= 3 for points in counters.values()), counters  # enough scrapes to compare
    assert workers_j == pytest.approx(status_j, rel=0.01)
    assert agents_j == pytest.approx(status_j, rel=1e-3)
    assert 0 < held_j <= agents_j * (1 + 1e-9)
    assert integrated_j == pytest.approx(agents_j, rel=0.05)
