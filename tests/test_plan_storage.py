"""A plan for a large pipeline fits where the operator stores it: PP16 × 256 microbatches.

The plan ConfigMap holds the document gzip-compressed in `binaryData` (a ConfigMap holds at most
1 MiB). The plan is built the way the optimizer builds one — the real option tables of a 16-stage
Llama 3.2 3B, and a frontier whose rows move a few instructions at a time to a cheaper option, as
Phillips–Dessouky's steps do — with 120 rows (the frontier's target steps), then stored by the
operator's own `plan_data` and read back by `plan_text` and the runtime's `Plan.loads`.
"""

from __future__ import annotations

import base64
import json
import random

from kareus_operator.reconcile import plan_data, plan_text
from optimizer_fixtures import plan_job, stage_options

from kareus.plan import FrontierRow, FrontierTable, Plan, Provenance, plan_from_frontier

CONFIGMAP_LIMIT_BYTES = 1 << 20  # the API server's limit on a ConfigMap's data
STAGES, MICROBATCHES, ROWS = 16, 256, 120


def big_plan(stages: int = STAGES, microbatches: int = MICROBATCHES) -> Plan:
    options = stage_options(pp=stages)
    rng = random.Random(7)
    choice = [[[0] * microbatches, [0] * microbatches] for _ in range(stages)]
    rows = []
    for step in range(ROWS):
        for _ in range(24):  # one step slows a few instructions by one option
            stage, kind, microbatch = rng.randrange(stages), rng.randrange(2), rng.randrange(microbatches)
            table = options[stage].forward if kind == 0 else options[stage].backward
            choice[stage][kind][microbatch] = min(choice[stage][kind][microbatch] + 1, len(table) - 1)
        rows.append(FrontierRow(time_s=10.0 + step * 0.05, energy_j=1e6 - step * 900.0,
                                choice=tuple((tuple(f), tuple(b)) for f, b in choice)))
    frontier = FrontierTable(options=tuple(options), rows=tuple(rows))
    return plan_from_frontier(plan_job(microbatches=microbatches, pp=stages), frontier, {"maxThroughput": {}},
                              provenance=Provenance(profile_key="big"))


def test_a_pp16_by_256_plan_fits_a_configmap_and_reads_back():
    plan = big_plan()
    text = plan.to_json()
    stored = plan_data(text)
    packed = stored["binaryData"]["plan.json.gz"]
    size_bytes = len(packed.encode())
    print(f"plan: {len(text) / 1e6:.2f} MB of JSON, {size_bytes / 1e6:.3f} MB stored (gzip + base64)")
    assert len(text) > CONFIGMAP_LIMIT_BYTES  # plain, it would not fit
    assert size_bytes < CONFIGMAP_LIMIT_BYTES * 0.9  # room for the object's metadata
    assert stored["data"] == {"plan.json": None}  # a merge patch drops an old plain copy
    config_map = {"binaryData": stored["binaryData"]}
    assert json.loads(plan_text(config_map)) == json.loads(text)
    assert Plan.loads(base64.b64decode(packed), source="the mounted plan.json.gz") == plan
    assert len(plan.stages) == STAGES and len(plan.frontier.rows) == ROWS
    assert all(len(stage.instructions) == 2 * MICROBATCHES for stage in plan.stages)
