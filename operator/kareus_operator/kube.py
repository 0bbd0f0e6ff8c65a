"""The operator's small asynchronous Kubernetes client (aiohttp).

kopf watches and patches the KareusJob itself; everything else the operator touches (pods,
services, ConfigMaps, the policy) goes through this client: typed paths, JSON bodies, and the API's
`Status` errors as `ApiError` with the HTTP code, so handlers can say "409 means already done" and
"404 means gone" in one line. Credentials come from a kubeconfig (token or client certificate) or
from the pod's service account, like every in-cluster client.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kareus.errors import KareusError
from kareus.incluster import api_url, serviceaccount_dir


class ApiError(Exception):
    """A non-2xx answer; `code` is the HTTP status, `reason` the API's reason."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message


@dataclass(frozen=True)
class Credentials:
    """Where the API is and how to prove who we are."""

    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    namespace: str = "default"


def load_kubeconfig(path: str | Path, context: str | None = None) -> Credentials:
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise KareusError(f"--kubeconfig: cannot read {path}: {error}") from None
    name = context or config.get("current-context")
    ctx = next((c["context"] for c in config.get("contexts", []) if c["name"] == name), None)
    if ctx is None:
        raise KareusError(f"kubeconfig {path}: context {name!r} not found")
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
    user = next((u["user"] for u in config.get("users", []) if u["name"] == ctx.get("user")), {})
    return Credentials(server=cluster["server"].rstrip("/"), token=user.get("token"),
                       ca_file=cluster.get("certificate-authority"), cert_file=user.get("client-certificate"),
                       key_file=user.get("client-key"), insecure=bool(cluster.get("insecure-skip-tls-verify")),
                       namespace=ctx.get("namespace", "default"))


def in_cluster_credentials() -> Credentials:
    """The pod's service account (`kareus.incluster`: the dev cluster's nodes mount it elsewhere)."""
    sa = serviceaccount_dir()
    server = api_url()
    if not (sa / "token").exists() or server is None:
        raise KareusError(f"not running in a cluster (no service-account token in {sa}): pass --kubeconfig PATH")
    ca = sa / "ca.crt"
    namespace = (sa / "namespace").read_text().strip() if (sa / "namespace").exists() else "default"
    return Credentials(server=server.rstrip("/"), token=(sa / "token").read_text().strip(),
                       ca_file=str(ca) if ca.exists() else None, namespace=namespace)


def path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None) -> str:
    """`/api/v1/namespaces/ns/pods/name/status` and friends."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class Kube:
    """One aiohttp session to the API; use as `async with Kube(credentials) as kube:`."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Kube:
        c = self.credentials
        headers = {"Authorization": f"Bearer {c.token}"} if c.token else {}
        ssl_context: ssl.SSLContext | bool = True
        if c.server.startswith("https"):
            if c.insecure:
                ssl_context = False
            else:
                ssl_context = ssl.create_default_context(cafile=c.ca_file)
                if c.cert_file and c.key_file:
                    ssl_context.load_cert_chain(c.cert_file, c.key_file)
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=ssl_context, limit=32),
            # No total timeout: waiting for a pooled connection is not the server being slow.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, url_path: str, body: Any = None, *,
                      params: Mapping[str, str] | None = None, content_type: str | None = None) -> Any:
        assert self._session is not None, "use `async with Kube(...)`"
        headers = {"Content-Type": content_type} if content_type else {}
        async with self._session.request(method, self.credentials.server + url_path, json=body,
                                         params=params, headers=headers) as response:
            if response.status >= 400:
                try:
                    status = await response.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    status = {"message": await response.text()}
                raise ApiError(response.status, status.get("reason", ""), status.get("message", ""))
            if response.content_type == "application/json":
                return await response.json()
            return await response.text()

    async def get(self, url_path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", url_path)
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    async def list(self, url_path: str, label_selector: str | None = None, *,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        params = {key: value for key, value in (("labelSelector", label_selector),
                                                ("fieldSelector", field_selector)) if value}
        return (await self.request("GET", url_path, params=params or None)).get("items", [])

    async def create(self, collection_path: str, body: Mapping[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """Create; `(object, True)`, or `(existing, False)` when it exists already (409 = done)."""
        try:
            return await self.request("POST", collection_path, body), True
        except ApiError as error:
            if error.code != 409:
                raise
        return await self.get(f"{collection_path}/{body['metadata']['name']}"), False

    async def merge_patch(self, url_path: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            return await self.request("PATCH", url_path, patch, content_type="application/merge-patch+json")
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    async def watch_events(self, collection_path: str, params: Mapping[str, str] | None = None):
        """Every object of a collection as an event, then its changes, forever: LIST, then WATCH from
        the list's resourceVersion; a 410 Gone or a dropped stream relists (as an informer does).
        Listed objects come as `ADDED`; bookmarks are swallowed."""
        assert self._session is not None, "use `async with Kube(...)`"
        query = dict(params or {})
        while True:
            listing = await self.request("GET", collection_path, params=query)
            for item in listing.get("items", []):
                yield {"type": "ADDED", "object": item}
            version = listing["metadata"]["resourceVersion"]
            watch = {**query, "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                     "timeoutSeconds": "300"}
            async with self._session.get(self.credentials.server + collection_path, params=watch,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as response:
                if response.status >= 400:
                    raise ApiError(response.status, "", await response.text())
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        break  # 410 Gone: the version is too old; relist
                    if event["type"] != "BOOKMARK":
                        yield event

    async def delete(self, url_path: str, *, propagation: str = "Background") -> bool:
        """Delete (background propagation unless told); False when it was already gone."""
        try:
            await self.request("DELETE", url_path, {"propagationPolicy": propagation})
        except ApiError as error:
            if error.code == 404:
                return False
            raise
        return True
