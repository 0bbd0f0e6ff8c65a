"""The KareusJob CRD on a real API server, used as a user uses it: kubectl and the official client.

The session's control plane (tests/conftest.py) is etcd and kube-apiserver v1.34 with TLS, RBAC and
the production admission chain; nothing here is emulated. What issue 15 asks of the CRD: the server
takes it as a structural schema, the examples apply (client-side with kubectl's field validation,
and server-side) and read back defaulted, `kubectl explain` documents the fields, `kubectl get` and
`kubectl get -w` print the printer columns, invalid jobs are refused with the field path, and the
spec freezes once training has started.
"""

from __future__ import annotations

import copy
import json
import os
import re
import select
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from crd_server import CRD_FILE, FIELD_MANAGER, GROUP, PLURAL, ROOT, VERSION, apply_crd, dry_run_create

from kareus.spec import immutable_changes, load_job, parse_job

CRD = yaml.safe_load(CRD_FILE.read_text())
[SERVED] = CRD["spec"]["versions"]
SPEC = SERVED["schema"]["openAPIV3Schema"]["properties"]["spec"]
COLUMNS = SERVED["additionalPrinterColumns"]
QUICKSTART = ROOT / "tests" / "data" / "tiny-tp2.yaml"  # a small valid job
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# wrong-api-version names a version the server does not serve: test_unserved_version_is_not_found.
INVALID = sorted(p for p in (ROOT / "tests" / "data" / "invalid").glob("*.yaml") if p.stem != "wrong-api-version")
# Strict field validation refuses unknown fields while decoding (400 Bad Request); every other
# refusal is schema or CEL validation (422 Unprocessable Entity).
DECODING_ERRORS = {"unknown-field", "override-affinity-unknown-field"}
IMMUTABLE = "spec: Forbidden: is immutable once training started, except objective and suspend"
# Every printer column filled in, so that the rows kubectl prints split into one value per column.
STATUS = {"phase": "Training", "objective": "maxThroughput", "trainingStartTime": "2026-01-01T00:00:00Z",
          "plan": {"predictedIterationSeconds": 1.25, "predictedIterationJoules": 3000.5},
          "measured": {"energyJoules": 12345, "iterations": 3, "percentComplete": 37.5, "etaSeconds": 6.25},
          "profile": {"key": "p-abc123"}}
WATCH_TIMEOUT_S = 30.0

pytestmark = pytest.mark.usefixtures("kareusjob_crd")


@pytest.fixture(scope="module")
def kareusjob_crd(kubectl, control_plane) -> dict:
    return apply_crd(kubectl, control_plane, CRD_FILE)


def custom_objects(kube_client):
    from kubernetes import client

    return client.CustomObjectsApi(kube_client)


def create_quickstart(kube_client, namespace: str, status: dict | None = None) -> dict:
    """The quickstart job stored in `namespace`; `status` written through the status subresource."""
    api = custom_objects(kube_client)
    stored = api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 yaml.safe_load(QUICKSTART.read_text()))
    if status is not None:
        stored = api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL,
                                                           stored["metadata"]["name"], {"status": status})
    return stored


def without_namespace(path: Path, directory: Path) -> Path:
    """A copy of the example without its `metadata.namespace` line, so that `-n` places it."""
    copied = directory / path.name
    copied.write_text(re.sub(r"(?m)^  namespace: \S+\n", "", path.read_text()))
    original = yaml.safe_load(path.read_text())
    original["metadata"].pop("namespace", None)
    assert yaml.safe_load(copied.read_text()) == original  # nothing else changed
    return copied


def split_row(line: str) -> list[str]:
    """kubectl's table: columns apart by two spaces or more (headers such as `PRED S/ITER` hold one)."""
    return re.split(r"\s{2,}", line.strip())


def headers(wide: bool = False) -> list[str]:
    return ["NAME", *(c["name"].upper() for c in COLUMNS if wide or not c.get("priority"))]


# ----------------------------------------------------------------------------- the CRD itself


def test_the_crd_is_established_with_its_names_and_a_structural_schema(kareusjob_crd):
    conditions = {c["type"]: c["status"] for c in kareusjob_crd["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"
    assert "NonStructuralSchema" not in conditions, kareusjob_crd["status"]["conditions"]
    assert kareusjob_crd["status"]["acceptedNames"]["shortNames"] == ["kj", "kjob"]
    # Stored as written: the server neither rejected nor rewrote any part of the version.
    assert kareusjob_crd["spec"]["versions"] == CRD["spec"]["versions"]


def test_reapplying_the_crd_changes_nothing_and_warns_of_nothing(kubectl, kareusjob_crd):
    result = kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}",
                     "-f", str(CRD_FILE))
    assert result.stderr == ""
    again = json.loads(kubectl("get", "crd", kareusjob_crd["metadata"]["name"], "-o", "json").stdout)
    assert again["metadata"]["generation"] == kareusjob_crd["metadata"]["generation"]


# ----------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_apply_client_side_and_read_back_defaulted(kubectl, namespace, path, tmp_path):
    # No --validate=false: kubectl asks the server for strict field validation.
    result = kubectl("apply", "-n", namespace, "-f", str(without_namespace(path, tmp_path)))
    job = load_job(path)
    assert result.stdout.strip() == f"kareusjob.kareus.dev/{job.name} created" and result.stderr == ""
    stored = json.loads(kubectl("get", "kj", job.name, "-n", namespace, "-o", "json").stdout)
    # Every default the CRD declares was filled in: the stored spec is the Python spec's full form.
    assert stored["spec"] == job.spec.to_dict()
    assert "kubectl.kubernetes.io/last-applied-configuration" in stored["metadata"]["annotations"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_apply_server_side_and_read_back_defaulted(kubectl, namespace, path, tmp_path):
    result = kubectl("apply", "--server-side", "-n", namespace, "-f", str(without_namespace(path, tmp_path)))
    job = load_job(path)
    assert result.stdout.strip() == f"kareusjob.kareus.dev/{job.name} serverside-applied" and result.stderr == ""
    stored = json.loads(kubectl("get", "kj", job.name, "-n", namespace, "-o", "json", "--show-managed-fields").stdout)
    assert stored["spec"] == job.spec.to_dict()
    [managed] = stored["metadata"]["managedFields"]
    assert (managed["manager"], managed["operation"]) == ("kubectl", "Apply")
    # kubectl owns what the file sets, not what the server defaulted.
    written = yaml.safe_load(path.read_text())["spec"]
    assert set(managed["fieldsV1"]["f:spec"]) == {f"f:{key}" for key in written}
    assert set(managed["fieldsV1"]["f:spec"]["f:parallelism"]) == {f"f:{key}" for key in written["parallelism"]}


def test_defaults_match_the_crd_for_a_minimal_job(kubectl, namespace):
    stored = json.loads(kubectl("apply", "-n", namespace, "-f", str(QUICKSTART), "-o", "json").stdout)
    spec = stored["spec"]
    assert spec["profiling"] == {"reuse": True, "measurementSeconds": 5, "cooldownSeconds": 5,
                                 "preset": "default", "backend": "sim"}  # the quickstart names only the backend
    assert spec["gpu"] == {"product": "A100-SXM4-40GB"} and spec["backoffLimit"] == 3 and spec["suspend"] is False
    assert (spec["parallelism"]["pipeline"], spec["parallelism"]["context"], spec["parallelism"]["data"]) == (1, 1, 1)
    assert spec["parallelism"]["nanobatching"] is True and spec["parallelism"]["activationCheckpointing"] is True
    assert "activeDeadlineSeconds" not in spec and "ttlSecondsAfterFinished" not in spec


# ----------------------------------------------------------------------------- kubectl explain and get


def test_kubectl_explain_prints_the_field_descriptions(kubectl):
    printed = " ".join(kubectl("explain", "kareusjob.spec.objective").stdout.split())
    objective = SPEC["properties"]["objective"]
    descriptions = [objective["description"], *(field["description"] for field in objective["properties"].values())]
    for description in descriptions:
        assert " ".join(description.split()) in printed
    assert "What to optimise for; exactly one of maxThroughput, timeBudget, energyBudget." in printed


def test_kubectl_explain_documents_the_name_rule_on_the_kind(kubectl):
    # The root metadata may carry no description, so the kind's own says what a name must be.
    printed = " ".join(kubectl("explain", "kareusjob").stdout.split())
    assert "Its name is a DNS-1123 label of at most 40 characters" in printed


def test_kubectl_get_prints_the_printer_columns(kubectl, kube_client, namespace):
    create_quickstart(kube_client, namespace, STATUS)
    header, row = kubectl("get", "kj", "-n", namespace).stdout.splitlines()
    assert split_row(header) == headers()
    assert split_row(row)[:-1] == ["quickstart", "Training", "maxThroughput", "1.25", "3000.5", "12345", "37.5",
                                   "6.25"]
    header, row = kubectl("get", "kareus", "-n", namespace, "-o", "wide").stdout.splitlines()  # by category
    assert split_row(header) == headers(wide=True)
    assert split_row(row)[9:] == ["tiny", "1", "2", "8", "3", "p-abc123", "false"]


class Lines:
    """Lines of a child's stdout, each read within a bounded wait."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.buffer = process, b""

    def next(self, count: int) -> list[str]:
        deadline = time.monotonic() + WATCH_TIMEOUT_S
        while self.buffer.count(b"\n") < count:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.process.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                pytest.fail(f"kubectl printed {self.buffer!r} and no more (wanted {count} lines)", pytrace=False)
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n", count)
        return [line.decode() for line in lines]


def test_kubectl_get_watch_keeps_the_printer_columns(control_plane, kube_client, namespace):
    create_quickstart(kube_client, namespace, STATUS)
    api = custom_objects(kube_client)
    command = [str(control_plane.kubectl()), f"--kubeconfig={control_plane.admin.kubeconfig}", "get", "kj",
               "-n", namespace, "--watch"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0) as watch:
        try:
            lines = Lines(watch)
            printed = lines.next(2)  # the header and the listed job
            # Each change after the list arrives as a watch event: one row each.
            api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "quickstart",
                                                      {"status": {"phase": "Succeeded",
                                                                  "measured": {"energyJoules": 20000}}})
            printed += lines.next(1)
            api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "quickstart",
                                               {"metadata": {"labels": {"seen": "yes"}}})
            printed += lines.next(1)
        finally:
            watch.kill()
    header, *rows = (split_row(line) for line in printed)
    assert header == headers()
    assert [row[:-1] for row in rows] == [
        ["quickstart", "Training", "maxThroughput", "1.25", "3000.5", "12345", "37.5", "6.25"],
        ["quickstart", "Succeeded", "maxThroughput", "1.25", "3000.5", "20000", "37.5", "6.25"],
        ["quickstart", "Succeeded", "maxThroughput", "1.25", "3000.5", "20000", "37.5", "6.25"],
    ]
    assert all(re.fullmatch(r"\d+[smhd]\S*", row[-1]) for row in rows), rows  # Age, a duration


# ----------------------------------------------------------------------------- invalid jobs


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_jobs_are_refused_with_the_field_path_through_the_client(kube_client, namespace, path):
    [expected] = re.findall(r"^# expect: (\S+)$", path.read_text(), flags=re.MULTILINE)
    verdict = dry_run_create(kube_client, yaml.safe_load(path.read_text()), namespace)
    assert verdict.status == (400 if path.stem in DECODING_ERRORS else 422), verdict
    assert expected in verdict.fields and expected in verdict.message, verdict


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_jobs_are_refused_with_the_field_path_through_kubectl(kubectl, namespace, path):
    [expected] = re.findall(r"^# expect: (\S+)$", path.read_text(), flags=re.MULTILINE)
    # -v=6 logs each response's HTTP status: the refusal is the server's, not kubectl's own.
    result = kubectl("apply", "-n", namespace, "-f", str(path), "-v=6", check=False)
    assert result.returncode == 1
    statuses = re.findall(r'"Response" verb="POST" url="[^"]*" status="(\d{3})', result.stderr)
    assert statuses == ["400" if path.stem in DECODING_ERRORS else "422"], result.stderr
    message = "\n".join(line for line in result.stderr.splitlines() if not re.match(r"[IWE]\d{4} ", line))
    assert expected in message, message
    assert kubectl("get", "kj", "-n", namespace, "-o", "name").stdout == ""


def test_unserved_version_is_not_found(kubectl, kube_client, namespace):
    from kubernetes import client

    path = ROOT / "tests" / "data" / "invalid" / "wrong-api-version.yaml"
    result = kubectl("apply", "-n", namespace, "-f", str(path), check=False)
    assert result.returncode == 1
    assert 'no matches for kind "KareusJob" in version "kareus.dev/v1"' in result.stderr
    with pytest.raises(client.ApiException) as refused:
        custom_objects(kube_client).create_namespaced_custom_object(GROUP, "v1", namespace, PLURAL,
                                                                    yaml.safe_load(path.read_text()))
    assert refused.value.status == 404


# ----------------------------------------------------------------------------- immutability


FROZEN = {
    "model": {"preset": "tiny", "layers": 2}, "sequenceLength": 128,
    "parallelism": {"tensor": 2, "microBatchSize": 2, "numMicroBatches": 2}, "profiling": {"backend": "nvml"},
    "gpu": {"product": "H200"}, "backoffLimit": 0, "managedBy": "example.com/x", "activeDeadlineSeconds": 60,
    "ttlSecondsAfterFinished": 5, "training": {"image": "localhost/kareus/runtime:0.1.0",
                                                "command": ["kareus", "train"], "args": ["--seed", "1"],
                                                "steps": 8, "gpusPerNode": 2, "nodes": 1},
}


def dry_run_update(kube_client, namespace: str, job: dict):
    """The server's answer to replacing the stored job with `job` (nothing is stored)."""
    from kubernetes import client

    try:
        custom_objects(kube_client).replace_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, job["metadata"]["name"], job, dry_run="All")
    except client.ApiException as error:
        return error.status, json.loads(error.body)["message"]
    return 200, ""


@pytest.mark.parametrize(("field", "value"), FROZEN.items(), ids=FROZEN.keys())
def test_each_field_is_frozen_once_training_started(kube_client, namespace, field, value):
    stored = create_quickstart(kube_client, namespace, {"trainingStartTime": "2026-01-01T00:00:00Z"})
    changed = copy.deepcopy(stored)
    changed["spec"][field] = value
    status, message = dry_run_update(kube_client, namespace, changed)
    assert (status, message.split(": ", 1)[1]) == (422, IMMUTABLE)
    # The Python spec names the same change.
    assert [e.path for e in immutable_changes(parse_job(stored).spec, parse_job(changed).spec)] == [f"spec.{field}"]


def test_objective_and_suspend_may_change_while_training(kube_client, namespace):
    stored = create_quickstart(kube_client, namespace, {"trainingStartTime": "2026-01-01T00:00:00Z"})
    changed = copy.deepcopy(stored)
    changed["spec"]["objective"] = {"energyBudget": {"perIterationJoules": 1e4}}
    changed["spec"]["suspend"] = True
    assert dry_run_update(kube_client, namespace, changed) == (200, "")
    assert immutable_changes(parse_job(stored).spec, parse_job(changed).spec) == []


def test_defaulted_fields_left_out_are_not_a_change(kube_client, namespace):
    stored = create_quickstart(kube_client, namespace, {"trainingStartTime": "2026-01-01T00:00:00Z"})
    changed = copy.deepcopy(stored)
    del changed["spec"]["backoffLimit"]  # defaulted back to the same value before the rule runs
    assert dry_run_update(kube_client, namespace, changed) == (200, "")


def test_the_spec_may_change_freely_before_training(kube_client, namespace):
    stored = create_quickstart(kube_client, namespace, {"phase": "Profiling"})
    changed = copy.deepcopy(stored)
    changed["spec"].update(sequenceLength=128, backoffLimit=0, managedBy="example.com/x")
    assert dry_run_update(kube_client, namespace, changed) == (200, "")
