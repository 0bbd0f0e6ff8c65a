"""The in-pod step that carries results from a pod to the API: `kareus-operator publish`.

Every Kareus pod runs its phase command under this wrapper:

    kareus-operator publish --configmap NAME --file profile.json=/out/profile.json -- kareus profile ...

It runs the command, and when the command succeeds writes the named files into a ConfigMap (created,
or merged into an existing one) through the API with the pod's service-account token, exactly as
it would on a real cluster. With `--follow FILE` (training rank 0) it also publishes a running
summary of the `train.jsonl` progress log — iterations, energy, average iteration time — every
`--interval-s` seconds while the command runs, so the operator can fill `status.measured` and
watch the energy budget. The exit code is the command's.

Only the standard library is used: the training image needs no operator dependencies for this.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.incluster import api_url, serviceaccount_dir
from kareus_operator.ledger import Ledger, latest_checkpoint

PROGRESS_KEY = "progress.json"
LEDGER_TICK_S = 0.5  # how far behind train.jsonl the ledger may fall (steps a SIGKILL could lose)


def summarise_progress(lines: Sequence[str]) -> dict[str, Any]:
    """Sum a `train.jsonl` log (one JSON object per step: step, iteration_time_s, energy_j)."""
    records = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a half-written last line
        if isinstance(record, dict) and "iteration_time_s" in record:
            records.append(record)
    time_s = sum(float(r["iteration_time_s"]) for r in records)
    energy_j = sum(float(r.get("energy_j") or 0.0) for r in records)
    # A worker that lost clock control says so per step (`clock_control: degraded`, with a reason).
    degraded = [r for r in records if r.get("clock_control") == "degraded"]
    extra = {"clockControlDegraded": str(degraded[-1].get("clock_control_reason") or "no reason given")} if degraded else {}
    # Straggler re-selection (the runtime logs why a replica's plan changed, per step).
    rows = [r["plan_frontier_row"] for r in records if isinstance(r.get("plan_frontier_row"), int)]
    if rows:
        extra["planFrontierRow"] = rows[-1]
    # A record carries its revision's reason on every step: count the steps where the revision changed.
    revisions = [(r.get("plan_revision"), r.get("plan_revision_reason")) for r in records]
    switches = sum(1 for before, now in itertools.pairwise(revisions)
                   if now[0] != before[0] and now[1] in ("straggler", "recovered"))
    if switches:
        extra["stragglerReselections"] = switches
    return extra | {
        "iterations": len(records),
        "energyJoules": round(energy_j, 6),
        "averageIterationSeconds": round(time_s / len(records), 9) if records else 0.0,
        "lastStep": int(records[-1].get("step", len(records) - 1)) if records else -1,
    }


class ConfigMapWriter:
    """Create-or-merge one ConfigMap through the API with the service-account token."""

    def __init__(self, name: str, namespace: str | None, labels: Mapping[str, str],
                 owner: Mapping[str, Any] | None) -> None:
        sa = serviceaccount_dir()
        self.token = (sa / "token").read_text().strip()
        self.namespace = namespace or (sa / "namespace").read_text().strip()
        server = api_url()
        if server is None:
            raise KareusError("publish runs in a pod: KUBERNETES_SERVICE_HOST/PORT are not set")
        self.server = server
        self.ca_file = str(sa / "ca.crt") if (sa / "ca.crt").exists() else None
        self.name, self.labels, self.owner = name, dict(labels), owner
        self._exists = False  # after the first write, one PATCH per update (not a 409 and a PATCH)

    def write(self, data: Mapping[str, str], binary: Mapping[str, bytes] | None = None) -> None:
        collection = f"/api/v1/namespaces/{self.namespace}/configmaps"
        metadata: dict[str, Any] = {"name": self.name, "labels": self.labels}
        if self.owner:
            metadata["ownerReferences"] = [dict(self.owner)]
        content: dict[str, Any] = {"data": dict(data)}
        if binary:
            content["binaryData"] = {key: base64.b64encode(value).decode() for key, value in binary.items()}
        if not self._exists:
            try:
                self._send("POST", collection, {"metadata": metadata, **content}, "application/json")
                self._exists = True
                return
            except urllib.error.HTTPError as error:
                if error.code != 409:
                    raise
        self._send("PATCH", f"{collection}/{self.name}", {"metadata": {"labels": self.labels}, **content},
                   "application/merge-patch+json")
        self._exists = True

    def _send(self, method: str, url_path: str, body: Any, content_type: str) -> None:
        request = urllib.request.Request(
            self.server.rstrip("/") + url_path, data=json.dumps(body).encode(), method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type})
        context = None
        if self.server.startswith("https"):
            import ssl

            context = ssl.create_default_context(cafile=self.ca_file)
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as response:
                response.read()
        except urllib.error.HTTPError as error:
            if error.code == 409:
                raise
            raise KareusError(f"{method} {url_path}: {error.code} {_status_message(error)}") from None


def _follow(path: Path, writer: ConfigMapWriter, interval_s: float, stop: threading.Event,
            ledger: Ledger | None = None, checkpoint_dir: Path | None = None) -> None:
    """Publish the progress summary at most every `interval_s` (the first one within a second of the
    first step, so a job shows it is training), and once more when the command ends. With a
    `ledger` (a job with a checkpoint claim) every step is copied to it within half a second, and
    the summary is the ledger's: the job's steps across its runs, each once."""
    last: dict[str, Any] | None = None
    copied = 0  # complete lines of train.jsonl already in the ledger
    published_at = float("-inf")
    while True:
        wait_s = interval_s if last and last.get("iterations") else min(interval_s, 1.0)
        stopping = stop.wait(min(wait_s, LEDGER_TICK_S) if ledger is not None else wait_s)
        text = path.read_text(errors="replace") if path.exists() else ""
        lines = text.splitlines()
        if ledger is not None:
            complete = text.split("\n")[:-1]  # the last piece may be a line being written
            try:
                ledger.add(_step_records(complete[copied:]))
                copied = len(complete)
            except OSError as error:  # a full or lost claim: try again, keep publishing
                print(f"kareus-operator publish: progress ledger not written: {error}", file=sys.stderr)
            if not stopping and time.monotonic() - published_at < wait_s:
                continue
        summary = summarise_progress(lines)
        if ledger is not None:
            summary |= ledger.state.summary()
        if checkpoint_dir is not None and (found := latest_checkpoint(checkpoint_dir)) is not None:
            summary["checkpoint"] = found
        published_at = time.monotonic()
        if summary != last:
            try:
                writer.write({PROGRESS_KEY: json.dumps(summary)})
                last = summary
            except (KareusError, urllib.error.URLError, OSError) as error:
                print(f"kareus-operator publish: progress not published: {error}", file=sys.stderr)
        if stopping:
            return


def _step_records(lines: Sequence[str]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "iteration_time_s" in record and isinstance(record.get("step"), int):
            records.append(record)
    return records


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("publish", help="run a pod command and publish its results to a ConfigMap")
    parser.add_argument("--configmap", required=True, help="ConfigMap to write")
    parser.add_argument("--namespace", help="its namespace (default: the pod's)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--owner", metavar="APIVERSION/KIND/NAME/UID",
                        help="controller ownerReference (e.g. kareus.dev/v1alpha1/KareusJob/q/UID)")
    parser.add_argument("--file", action="append", default=[], metavar="KEY=PATH",
                        help="after success, store PATH's text under KEY")
    parser.add_argument("--gzip-file", action="append", default=[], metavar="KEY=PATH",
                        help="after success, store PATH gzip-compressed under KEY in binaryData (large plans)")
    parser.add_argument("--follow", type=Path, help="train.jsonl to summarise while the command runs")
    parser.add_argument("--follow-if-rank0", action="store_true",
                        help="publish only where NODE_RANK is 0 (the Indexed Job's other pods just run)")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--ledger", type=Path, help="progress ledger on the checkpoint claim: the followed steps "
                        "are kept there across pods, and the summary counts each step of the job once")
    parser.add_argument("--checkpoint-dir", type=Path, help="the runtime's checkpoint directory: the summary "
                        "names its newest complete checkpoint")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    parser.set_defaults(func=run)


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"kareus-operator publish: {flag}: expected KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _status_message(error: urllib.error.HTTPError) -> str:
    """The API server's own words (its `Status.message`), which say which permission or rule refused."""
    try:
        return json.loads(error.read() or b"{}").get("message") or error.reason
    except ValueError:
        return str(error.reason)


def _owner(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    parts = text.split("/")
    if len(parts) < 4:
        raise SystemExit("kareus-operator publish: --owner: expected APIVERSION/KIND/NAME/UID")
    *api_version, kind, name, uid = parts
    # No blockOwnerDeletion: setting it needs `update` on kareusjobs/finalizers
    # (OwnerReferencesPermissionEnforcement), which a worker must not have; garbage collection of
    # the ConfigMap with its job does not depend on it.
    return {"apiVersion": "/".join(api_version), "kind": kind, "name": name, "uid": uid, "controller": True}


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("kareus-operator publish: no command given after --")
    if args.follow_if_rank0 and os.environ.get("NODE_RANK", "0") != "0":
        return _run_only(command)
    writer = ConfigMapWriter(args.configmap, args.namespace, _pairs(args.label, "--label"), _owner(args.owner))
    files = {key: Path(value) for key, value in _pairs(args.file, "--file").items()}
    packed = {key: Path(value) for key, value in _pairs(args.gzip_file, "--gzip-file").items()}
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    stop = threading.Event()
    follower = None
    ledger = Ledger(args.ledger, os.environ.get("POD_NAME", "run")) if args.ledger and args.follow else None
    if args.follow is not None:
        follower = threading.Thread(target=_follow, args=(args.follow, writer, args.interval_s, stop, ledger,
                                                          args.checkpoint_dir), daemon=True)
        follower.start()
    code = child.wait()
    stop.set()
    if follower is not None:
        follower.join(timeout=30)
    if ledger is not None:
        ledger.close()
    if code != 0:
        return code
    missing = [str(p) for p in [*files.values(), *packed.values()] if not p.exists()]
    if missing:
        print(f"kareus-operator publish: the command succeeded but wrote no {', '.join(missing)}", file=sys.stderr)
        return 1
    if files or packed:
        writer.write({key: p.read_text() for key, p in files.items()},
                     {key: gzip.compress(p.read_bytes(), mtime=0) for key, p in packed.items()})
    return 0


def _run_only(command: Sequence[str]) -> int:
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    return child.wait()
