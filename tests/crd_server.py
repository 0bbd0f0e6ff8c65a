"""The KareusJob CRD on the session's real API server (tests/conftest.py), for the CRD test modules.

`apply_crd` applies a CRD file as a user does (server-side apply) and waits until the server serves
it: Established, and its OpenAPI published (what `kubectl explain` reads); each test module applies
it once from a module-scoped fixture. `dry_run_create` asks the server for its verdict on one
manifest (`dryRun=All`: admission and validation run, nothing is stored), through the official client.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kareus_devcluster.controlplane import wait_crd_established

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "kareusjob.yaml"
CRD_NAME = "kareusjobs.kareus.dev"
GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
FIELD_MANAGER = "kareus-tests"
SERVED_TIMEOUT_S = 60.0
# A strict-decoding refusal (HTTP 400) names its fields only in the message.
_DECODING_FIELD = re.compile(r'(?:unknown|duplicate) field "([^"]+)"')


def eventually(what: str, check: Callable[[], Any], timeout_s: float = SERVED_TIMEOUT_S) -> Any:
    """`check()`'s first truthy result, polled until `timeout_s`; a failure naming `what` after that."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}", pytrace=False)
        time.sleep(0.2)


def apply_crd(kubectl, control_plane, path: Path) -> dict:
    """Server-side apply `path`; the CRD as the server holds it once it is served and documented."""
    kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}", "-f", str(path))
    wait_crd_established(kubectl, CRD_NAME, SERVED_TIMEOUT_S)

    def published() -> bool:
        # The OpenAPI controller publishes an Established CRD's schema asynchronously.
        try:
            document = control_plane.get(f"/openapi/v3/apis/{GROUP}/{VERSION}")
        except urllib.error.HTTPError:
            return False
        return f"dev.kareus.{VERSION}.KareusJob" in document.get("components", {}).get("schemas", {})

    eventually(f"the OpenAPI v3 schema of {CRD_NAME} is published", published)
    return json.loads(kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)


@dataclass(frozen=True)
class Verdict:
    """The API server's answer to creating one object."""

    status: int  # HTTP status: 201 when accepted
    stored: dict | None = None  # the object as the server would store it (nulls pruned, defaults applied)
    message: str = ""  # the refusal as the server words it
    fields: tuple[str, ...] = ()  # field paths the refusal names; "<nil>" when CEL rules were skipped

    @property
    def accepted(self) -> bool:
        return self.status == 201


def refusal(error) -> Verdict:
    """A `kubernetes.client.ApiException` as a Verdict (its body is a v1 Status)."""
    try:
        body = json.loads(error.body or "{}")
    except ValueError:
        body = {"message": str(error.body)}
    causes = (body.get("details") or {}).get("causes") or []
    message = body.get("message", "")
    fields = tuple(cause.get("field", "") for cause in causes)
    if not fields and f'in version "{VERSION}"' in message:
        # Decoded against our schema; another version has none, so its "unknown fields" mean nothing.
        fields = tuple(_DECODING_FIELD.findall(message))
    return Verdict(error.status, message=message, fields=fields)


def dry_run_create(api_client, manifest: dict, namespace: str = "default", *,
                   field_validation: str = "Strict") -> Verdict:
    """The server's verdict on creating `manifest` in `namespace`, with kubectl's field validation."""
    from kubernetes import client

    try:
        stored = client.CustomObjectsApi(api_client).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All", field_validation=field_validation)
    except client.ApiException as error:
        return refusal(error)
    return Verdict(201, stored=stored)
