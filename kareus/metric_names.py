"""Prometheus metric names exported by Kareus, in one place.

Every exporter (node daemon, training workers, operator) takes its names from here, and the
Grafana dashboards are tested to use only these names. Base units and `_total` counters follow the
Prometheus naming conventions.
"""

# Node daemon, labelled gpu_uuid, node and, when owned, namespace/pod/kareusjob.
GPU_POWER_WATTS = "kareus_gpu_power_watts"
GPU_ENERGY_JOULES_TOTAL = "kareus_gpu_energy_joules_total"
GPU_SM_CLOCK_HERTZ = "kareus_gpu_sm_clock_hertz"
GPU_LOCKED_CLOCK_HERTZ = "kareus_gpu_locked_clock_hertz"
GPU_CLOCK_CHANGES_TOTAL = "kareus_gpu_clock_changes_total"
DAEMON_REQUESTS_TOTAL = "kareus_daemon_requests_total"
DAEMON_REQUEST_SECONDS = "kareus_daemon_request_seconds"

# Training workers (rank-local endpoint).
ITERATION_SECONDS = "kareus_iteration_seconds"
ITERATION_ENERGY_JOULES = "kareus_iteration_energy_joules"
TOKENS_PER_JOULE = "kareus_tokens_per_joule"
PLAN_INFO = "kareus_plan_info"

# Operator.
JOBS = "kareus_jobs"
PHASE_SECONDS = "kareus_phase_seconds"
PROFILE_CACHE_HITS_TOTAL = "kareus_profile_cache_hits_total"


def all_metric_names() -> frozenset[str]:
    """Every base metric name defined above (what dashboards may refer to)."""
    return frozenset(v for k, v in globals().items() if k.isupper() and isinstance(v, str))
