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
GPU_POWER_LIMIT_WATTS = "kareus_gpu_power_limit_watts"  # the board power limit in force
DAEMON_REQUESTS_TOTAL = "kareus_daemon_requests_total"
DAEMON_REQUEST_SECONDS = "kareus_daemon_request_seconds"

# Training workers (rank-local endpoint).
ITERATION_SECONDS = "kareus_iteration_seconds"
ITERATION_ENERGY_JOULES = "kareus_iteration_energy_joules"
TOKENS_PER_JOULE = "kareus_tokens_per_joule"
PLAN_INFO = "kareus_plan_info"
# The optimizer step: global gradient norm before clipping, and the learning rate it used.
GRAD_NORM = "kareus_grad_norm"
LEARNING_RATE = "kareus_learning_rate"
# Straggler-aware re-selection (data parallelism): the frontier row a rank's replica runs, the
# slowest replica's slowdown over the next (fraction), re-selections by reason (straggler|recovered).
PLAN_FRONTIER_ROW = "kareus_plan_frontier_row"
REPLICA_SLOWDOWN_RATIO = "kareus_replica_slowdown_ratio"
STRAGGLER_RESELECTIONS_TOTAL = "kareus_straggler_reselections_total"

# Operator.
JOBS = "kareus_jobs"
PHASE_SECONDS = "kareus_phase_seconds"
PROFILE_CACHE_HITS_TOTAL = "kareus_profile_cache_hits_total"
# Per KareusJob (labelled namespace, kareusjob), what the alerts read: the phase it is in (1, one
# series per job), each status condition (1 True, 0 False) and the energy its status has measured.
JOB_PHASE = "kareus_job_phase"
JOB_CONDITION = "kareus_job_condition"
JOB_MEASURED_ENERGY_JOULES = "kareus_job_measured_energy_joules"
# A training KareusJob's progress (status.measured): the share of its steps done (0–1), the seconds
# left at the measured iteration time, and the energy of all its steps at the measured rate (the
# energy still to spend is this minus the measured energy).
JOB_PROGRESS_RATIO = "kareus_job_progress_ratio"
JOB_ETA_SECONDS = "kareus_job_eta_seconds"
JOB_PROJECTED_ENERGY_JOULES = "kareus_job_projected_energy_joules"
# Cluster power budget (kareus.power_budget; the operator exports them): the budget per scope
# (label scope=cluster|gpuProduct|nodePool, name), each job's allotment (the predicted average
# power of its assigned frontier point) and measured average power, and the jobs held for lack of power.
POWER_BUDGET_WATTS = "kareus_power_budget_watts"
JOB_POWER_ALLOTMENT_WATTS = "kareus_job_power_allotment_watts"
JOB_MEASURED_POWER_WATTS = "kareus_job_measured_power_watts"
POWER_BUDGET_HELD_JOBS = "kareus_power_budget_held_jobs"

# Namespace energy ledgers (kareus.energy_ledger; the operator exports them): the joules the
# namespace's jobs spent in the current budget period (label period) and its budget per period.
NAMESPACE_ENERGY_USED_JOULES = "kareus_namespace_energy_used_joules"
NAMESPACE_ENERGY_BUDGET_JOULES = "kareus_namespace_energy_budget_joules"


def all_metric_names() -> frozenset[str]:
    """Every base metric name defined above (what dashboards may refer to)."""
    return frozenset(v for k, v in globals().items() if k.isupper() and isinstance(v, str))
