"""Fast stand-ins for `kareus profile|optimize|train`, for operator tests and the scale benchmark.

They do what the real phases do at the interface the operator sees — write a profile file, a plan
document with a prediction and frontier rows, a `train.jsonl` progress log — in milliseconds.
Failures are injected by the job's name: a job named `x-f2train` fails its first 2 training runs
(exit 3), `x-f1profile` its first profiling run (runs counted in `FAKE_STATE_DIR`). `FAKE_STEP_S`
is the time per fake training step (a job named `*nodaemon*` reports degraded clock control), `FAKE_STEPS` the number of steps, `FAKE_PHASE_S` how long
profiling and optimizing take. `FAKE_PLAN_FILE` (optional): a real plan document (with a frontier)
the fake optimize writes instead of its stand-in. A training run stops early when the file
`FAKE_STATE_DIR/<job>.finish` exists, and records the plan's `selected_row` it read last (the plan
file is re-read every step, as a runtime watching it would) in `FAKE_STATE_DIR/<job>.row`, and every
step it ran in `FAKE_STATE_DIR/<job>.executed` (and the step each run started at in `<job>.runs`).
When `FAKE_STATE_DIR/<job>.lock-request` holds a clock in MHz, the next step asks the node daemon
(as the runtime would: the pod's address and token) to lock every GPU it may control at that clock
and writes the answer to `<job>.lock-result` (`{"ok": …, "code": …, "message": …}`). With `--checkpoint-dir` it keeps checkpoints as the
runtime lays them out (`step-N/kareus-checkpoint.json`, every `--checkpoint-every` steps and on
SIGTERM, which ends the run after its current step with exit 143) and resumes from the newest.

    python tests/operator_fakes.py profile JOB --out PROFILE
    python tests/operator_fakes.py optimize JOB --profile PROFILE --out PLAN
    python tests/operator_fakes.py train JOB --plan PLAN --out DIR --nproc N

In the dev cluster the pods run Kareus's runtime image, which has no tests in it: the operator's pod
environment carries this file's source (`FAKE_SOURCE`), and the phase commands run it with the image's
Python. A job gets `FAKE_STATE_DIR` as a hostPath volume through its `podTemplateOverrides`
(`fake_overrides`): the nodes see the host's /tmp, so the test and the pods share that directory.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

SCRIPT = str(Path(__file__).resolve())
QUICKSTART = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-tp2.yaml"  # a small valid job
STEP_ENERGY_J = 123.0
STEP_TIME_S = 0.25


# Runs FAKE_SOURCE as this file would run (`__file__` only needs a parent directory or two).
LOADER = ("import os; exec(compile(os.environ['FAKE_SOURCE'], 'operator_fakes.py', 'exec'), "
          "{'__name__': '__main__', '__file__': '/fakes/tests/operator_fakes.py'})")
FAKE_STATE_VOLUME = "fake-state"


def settings_env(state_dir: Path, *, step_s: float = 0.05, steps: int = 4, phase_s: float = 0.0,
                 plan_file: Path | None = None, python: str = "python") -> dict[str, str]:
    """Operator environment that makes every pod run these fakes (`python`: the image's interpreter;
    `sys.executable` for processes on this machine)."""
    for directory in (state_dir, *state_dir.resolve().parents):  # the pods' user is not this one
        if directory == Path(directory.anchor) or directory == Path("/tmp"):
            break
        directory.chmod(directory.stat().st_mode | 0o755)
        if directory.name.startswith("pytest-of-"):
            break
    state_dir.chmod(0o777)
    extra = {"FAKE_STATE_DIR": str(state_dir), "FAKE_STEP_S": str(step_s), "FAKE_STEPS": str(steps),
             "FAKE_PHASE_S": str(phase_s), "FAKE_SOURCE": Path(SCRIPT).read_text()} | (
        {"FAKE_PLAN_FILE": str(plan_file)} if plan_file else {})
    fake = [python, "-c", LOADER]
    env = {
        "KAREUS_OPERATOR_PROFILE_COMMAND": json.dumps([*fake, "profile", "{job}", "--out", "{profile}"]),
        "KAREUS_OPERATOR_OPTIMIZE_COMMAND": json.dumps([*fake, "optimize", "{job}", "--profile", "{profile}",
                                                        "--out", "{plan}"]),
        "KAREUS_OPERATOR_TRAIN_COMMAND": json.dumps([*fake, "train"]),
        "KAREUS_OPERATOR_PUBLISH_COMMAND": json.dumps([python, "-m", "kareus_operator.main", "publish"]),
        "KAREUS_OPERATOR_EXTRA_POD_ENV": json.dumps(extra),
        "KAREUS_OPERATOR_RESYNC_S": "2", "KAREUS_OPERATOR_BACKOFF_BASE_S": "0.5",
        "KAREUS_OPERATOR_PROGRESS_INTERVAL_S": "0.2",
        # A killed leader's Lease expires in 4 s (production: 15 s), so restarts hand over quickly.
        "KAREUS_OPERATOR_LEASE_DURATION_S": "4",
    }
    return env


def shared_root(state_dir: Path | None = None) -> Path:
    """The directory the pods get: pytest's root of temporary directories (`pytest-of-<user>`), which
    holds every test's `tmp_path`, so one mount serves any state directory a test picks."""
    import getpass
    import tempfile

    default = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    if state_dir is None:
        return default
    return next((p for p in state_dir.resolve().parents if p.name.startswith("pytest-of-")), state_dir.resolve())


def fake_overrides(state_dir: Path | None = None) -> list[dict]:
    """`spec.podTemplateOverrides` that give every phase's pod the fakes' state directories."""
    root = str(shared_root(state_dir))
    return [{"roles": ["profile", "optimize", "train"],
             "spec": {"volumes": [{"name": FAKE_STATE_VOLUME, "hostPath": {"path": root, "type": "Directory"}}],
                      "volumeMounts": [{"name": FAKE_STATE_VOLUME, "mountPath": root}]}}]


def fake_manifest(state_dir: Path | None = None) -> dict:
    """The small valid job, its pods given the fakes' state directories."""
    import yaml

    job = yaml.safe_load(QUICKSTART.read_text())
    job["spec"]["podTemplateOverrides"] = fake_overrides(state_dir)
    return job


def conditions(job: dict) -> dict[str, tuple[str, str]]:
    """A job's conditions as {type: (status, reason)}."""
    return {c["type"]: (c["status"], c["reason"]) for c in (job.get("status") or {}).get("conditions", [])}


def _arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def _maybe_fail(phase: str) -> None:
    job = os.environ.get("KAREUS_JOB_NAME", "job")
    match = re.search(rf"f(\d+){phase}", job)
    if match is None:
        return
    counter = Path(os.environ["FAKE_STATE_DIR"]) / f"{job}-{phase}.failures"
    done = int(counter.read_text()) if counter.exists() else 0
    if done < int(match.group(1)):
        counter.write_text(str(done + 1))
        print(f"fake {phase}: injected failure {done + 1}/{match.group(1)}", flush=True)
        sys.exit(3)


def _read_plan(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)  # the plan ConfigMap stores it gzipped


def _latest_checkpoint(directory: Path) -> int:
    """Steps done at the newest complete checkpoint (kareus.runtime.checkpoint's layout), 0 if none."""
    steps = [int(p.name[5:]) for p in directory.glob("step-*") if (p / "kareus-checkpoint.json").exists()]
    return max(steps, default=0)


def _save_checkpoint(directory: Path, step: int, keep: int) -> None:
    """A complete checkpoint appears at once: written aside, its manifest last, renamed into place."""
    partial = directory / f".partial-step-{step:08d}"
    partial.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    (partial / "kareus-checkpoint.json").write_text(json.dumps({"version": 1, "step": step, "time": stamp}))
    final = directory / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in sorted(directory.glob("step-*"), reverse=True)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _lock_if_asked(state: Path, job: str) -> None:
    """A lock at the clock `<job>.lock-request` names, through the node daemon; its answer in `<job>.lock-result`."""
    request = state / f"{job}.lock-request"
    if not request.exists():
        return
    from kareus.daemon_client import DaemonConnection, DaemonError, endpoint_from_env

    clock_mhz = int(request.read_text())
    try:
        with DaemonConnection(endpoint_from_env() or "", job=job) as daemon:
            gpus = [gpu.uuid for gpu in daemon.discover() if gpu.controllable]
            daemon.lock(gpus, clock_mhz)
            result = {"ok": True, "clock_mhz": clock_mhz, "gpus": gpus}
    except DaemonError as error:
        result = {"ok": False, "clock_mhz": clock_mhz, "code": error.code, "message": str(error)}
    partial = state / f"{job}.lock-result.partial"
    partial.write_text(json.dumps(result))
    request.unlink()
    os.replace(partial, state / f"{job}.lock-result")


def main() -> int:
    phase = sys.argv[1]
    _maybe_fail(phase)
    if phase in ("profile", "optimize"):
        time.sleep(float(os.environ.get("FAKE_PHASE_S", "0")))
    if phase == "profile":
        Path(_arg("--out")).write_text(json.dumps({"fake": "profile", "job": sys.argv[2]}))
    elif phase == "optimize":
        json.loads(Path(_arg("--profile")).read_text())  # the mounted cached profile must be readable
        plan = {"predicted": {"iteration_time_s": STEP_TIME_S, "iteration_energy_j": STEP_ENERGY_J},
                "frontier": {"rows": [{"time_s": STEP_TIME_S, "energy_j": STEP_ENERGY_J}] * 3}}
        real = os.environ.get("FAKE_PLAN_FILE")
        Path(_arg("--out")).write_text(Path(real).read_text() if real else json.dumps(plan))
    elif phase == "train":
        plan_path = Path(_arg("--plan"))
        _read_plan(plan_path)
        steps = int(os.environ.get("FAKE_STEPS", "4"))
        out = Path(_arg("--out"))
        job = os.environ.get("KAREUS_JOB_NAME", "job")
        state = Path(os.environ.get("FAKE_STATE_DIR", out))
        if not state.is_dir():  # no shared hostPath (a restricted namespace): the records stay beside the output
            state = out
        checkpoints = Path(_arg("--checkpoint-dir")) if "--checkpoint-dir" in sys.argv else None
        every = int(_arg("--checkpoint-every")) if "--checkpoint-every" in sys.argv else 0
        keep = int(_arg("--checkpoint-keep")) if "--checkpoint-keep" in sys.argv else 2
        start = _latest_checkpoint(checkpoints) if checkpoints else 0
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))  # finish the step, save, exit 143
        with open(state / f"{job}.runs", "a") as runs:  # the step every run started at
            runs.write(f"{start}\n")
        with open(out / "train.jsonl", "a") as log:
            for step in range(start, steps):
                if (state / f"{job}.finish").exists():
                    break
                row = _read_plan(plan_path).get("selected_row")
                if row is not None:
                    (state / f"{job}.row").write_text(str(row))
                _lock_if_asked(state, job)
                time.sleep(float(os.environ.get("FAKE_STEP_S", "0.05")))
                record = {"step": step, "loss": 1.0 / (step + 1), "iteration_time_s": STEP_TIME_S,
                          "energy_j": STEP_ENERGY_J}
                if "nodaemon" in os.environ.get("KAREUS_JOB_NAME", ""):
                    record |= {"clock_control": "degraded", "clock_control_reason": "no node daemon on this node"}
                log.write(json.dumps(record) + "\n")
                log.flush()
                with open(state / f"{job}.executed", "a") as executed:  # every step any run ran
                    executed.write(f"{step}\n")
                done = step + 1
                if checkpoints and ((every and done % every == 0 and done < steps) or stopping):
                    _save_checkpoint(checkpoints, done, keep)
                if stopping:
                    print(f"fake train: stopped by SIGTERM after step {done}", flush=True)
                    return 143
    else:
        print(f"unknown phase {phase}", file=sys.stderr)
        return 2
    print(f"fake {phase}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
