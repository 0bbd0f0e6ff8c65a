"""What a training job's progress summary adds to its status: how far it is, when it will finish,
and where its checkpoints are.

The summary is the progress ConfigMap's (`kareus_operator.publish`; for a job with a checkpoint
claim, the ledger's, which counts each step once across restarts). `percentComplete` is the share
of `spec.training.steps` done; `etaSeconds` the steps left at the recent measured iteration time
(the last steps' mean, so a plan switch shows at once), falling back to the run's average.
`status.checkpoint` is the contract `{lastStep, lastTime, resumedFromStep}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def progress_fields(progress: Mapping[str, Any], measured: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """`percentComplete`, `etaSeconds` and, with a ledger, `redoneJoules` for `status.measured`."""
    done = min(int(measured["iterations"]), steps)
    per_step_s = _positive(progress.get("recentIterationSeconds")) or _positive(measured["averageIterationSeconds"])
    out: dict[str, Any] = {"percentComplete": round(100.0 * done / steps, 3)}
    if per_step_s is not None or done == steps:
        out["etaSeconds"] = round((steps - done) * (per_step_s or 0.0), 3)
    redone_j = _positive(progress.get("redoneJoules"))
    if redone_j is not None:
        out["redoneJoules"] = redone_j
    return out


def checkpoint_status(progress: Mapping[str, Any], previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`status.checkpoint` from a ledger's summary (None without one: the job keeps no checkpoints).
    The latest checkpoint seen stays when a new run has not found one yet."""
    if "resumedFromStep" not in progress:
        return None
    out: dict[str, Any] = {key: value for key, value in (previous or {}).items() if key in ("lastStep", "lastTime")}
    found = progress.get("checkpoint")
    if isinstance(found, Mapping) and isinstance(found.get("lastStep"), int):
        out |= {"lastStep": found["lastStep"], "lastTime": str(found.get("lastTime") or "")}
        if not out["lastTime"]:
            out.pop("lastTime")
    out["resumedFromStep"] = max(0, int(progress["resumedFromStep"]))
    return out


def _positive(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None
