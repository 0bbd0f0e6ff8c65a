"""A Kubernetes API server for development and tests, on kmock's `KubernetesEmulator`.

kmock serves discovery and keeps objects in memory, but (by design) treats them as plain JSON. An
operator needs more of the API server's contract, and this emulator adds it:

- object identity: `uid`, a cluster-wide increasing `resourceVersion`, `generation` (bumped only when
  something outside `metadata`/`status` changes), `creationTimestamp`, `generateName`;
- bodies returned on create, patch, replace and delete; 409 `AlreadyExists` on a duplicate create and
  `Conflict` on a stale `resourceVersion` in a replace; 404 for a missing namespace;
- the three patch dialects (merge, strategic-as-merge, JSON patch with `test` → 422);
- the status subresource kept apart: writes to the object ignore `status`, writes to `/status`
  change nothing else;
- CRDs: creating a `CustomResourceDefinition` registers its resource for discovery, and objects of it
  get the CRD's defaults, structural-schema and CEL validation (422 with field paths);
- deletion with finalizers (`deletionTimestamp`), and ownerReference garbage collection (background
  propagation, recursively);
- list and watch with label and field selectors, `resourceVersion` and `timeoutSeconds`; the watch
  never loses an event that happens while the initial objects are streamed;
- bearer-token authentication (the admin token of the kubeconfig, plus service-account tokens);
- pod logs (`/pods/NAME/log`) from a pluggable reader (the pod runner keeps them).

History is not kept (only the latest version of each object) so memory stays bounded under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, rendering

from kareus_operator.devcluster import patching

CRD_RESOURCE = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PODS = kmock.resource("", "v1", "pods")
_VERSION_PATH = re.compile(r"^/(?:api|apis/([^/]+))/([^/]+)/?$")
_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces(?:/([^/]+))?(?:/(status|finalize))?/?$")
# Resources whose writes to the object itself never change `status` (they have the subresource).
_MAX_KEPT_REQUESTS = 200

LogReader = Callable[[str, str, str | None], Awaitable[str | None]]
Validator = Callable[[Mapping[str, Any], dict[str, Any], Mapping[str, Any] | None], list[str]]


class ApiError(Exception):
    """An API answer other than success: rendered as a `Status` object with this code."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, dict(details or {})

    def body(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": self.code, "reason": self.reason, "message": self.message, "details": self.details}


def now_iso() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}" if resource.group else f"v1/{resource.plural}"


@attrs.define(kw_only=True)
class ApiEmulator(kmock.KubernetesEmulator):
    """The realistic emulator; `tokens` are accepted bearer tokens (empty: no authentication)."""

    tokens: set[str] = attrs.field(factory=set)
    log_reader: LogReader | None = None
    # Validates a custom object against its CRD (defaults applied in place); returns error messages.
    custom_validator: Validator | None = None
    _rv: int = attrs.field(default=0, init=False)
    _crds: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)

    def new_token(self) -> str:
        token = secrets.token_urlsafe(24)
        self.tokens.add(token)
        return token

    # ------------------------------------------------------------------ HTTP entry

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's path parser reads `/api/v1/namespaces/NAME` as a namespace with no resource;
        # requests for Namespace objects themselves are parsed here.
        match = _NAMESPACE_PATH.match(raw_request.path)
        if match is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        request = rendering.Request(
            method=raw_request.method, url=raw_request.url, params=dict(raw_request.query),
            headers=dict(raw_request.headers), body=body, data=data, resource=NAMESPACES,
            name=match.group(1), subresource=match.group(2), raw_request=raw_request)
        return await self._handle(request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        del self._requests[:-_MAX_KEPT_REQUESTS]  # kmock records every request; keep memory bounded
        try:
            self._authenticate(request)
            if request.resource is None or request.resource.plural is None:
                if match := _VERSION_PATH.match(request.url.path):
                    return _json(self._resource_list(match.group(1) or "", match.group(2)))
                return await super()._handle(request)  # the rest of discovery
            return await self._serve(request)
        except ApiError as error:
            return aiohttp.web.json_response(error.body(), status=error.code)

    def _authenticate(self, request: rendering.Request) -> None:
        if not self.tokens:
            return
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or header[7:] not in self.tokens:
            raise ApiError(401, "Unauthorized", "Unauthorized: a valid bearer token is required")

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        resource, method = request.resource, request.method
        info = self._info(resource)
        namespace = request.namespace if info.namespaced else None
        sub = request.subresource
        if method == enums.method.GET and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, resource, namespace)
        table = "as=Table" in request.headers.get("Accept", "")
        if request.name is None:
            if method == enums.method.GET:
                listed = self.list_objects(resource, namespace, request.params)
                return _json(self._table(resource, listed["items"], listed["metadata"]) if table else listed)
            if method == enums.method.POST:
                return _json(await self.create(resource, namespace, request.data), 201)
            raise ApiError(405, "MethodNotAllowed", f"{method.value} is not allowed on a collection")
        if sub == "log" and resource == PODS:
            return await self._log(namespace or "", request.name, request.params.get("container"))
        if sub not in (None, "status"):
            raise ApiError(404, "NotFound", f"subresource {sub!r} is not served by the dev cluster")
        if sub == "status" and "status" not in info.subresources:
            raise ApiError(404, "NotFound", f"{resource.plural} has no status subresource")
        if method == enums.method.GET:
            obj = self.get(resource, namespace, request.name)
            return _json(self._table(resource, [obj], {"resourceVersion": str(self._rv)}) if table and sub is None else obj)
        if method == enums.method.PATCH:
            content_type = request.headers.get("Content-Type", "application/merge-patch+json")
            return _json(await self.patch(resource, namespace, request.name, request.data, content_type, sub))
        if method == enums.method.PUT:
            return _json(await self.replace(resource, namespace, request.name, request.data, sub))
        if method == enums.method.DELETE:
            return _json(await self.delete(resource, namespace, request.name))
        raise ApiError(405, "MethodNotAllowed", f"{method.value} is not allowed")

    def _table(self, resource: kmock.resource, items: list[dict[str, Any]], meta: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side printing for `kubectl get`: Name, the CRD's printer columns (or Phase for pods), Age."""
        crd = self._crds.get(_key(resource))
        columns: list[dict[str, Any]] = []
        if crd is not None:
            version = next(v for v in crd["spec"]["versions"] if v["name"] == resource.version)
            columns = [c for c in version.get("additionalPrinterColumns", []) if c.get("jsonPath") != ".metadata.creationTimestamp"]
        elif resource == PODS:
            columns = [{"name": "Status", "type": "string", "jsonPath": ".status.phase"}]
        definitions = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
        definitions += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                         "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in columns]
        definitions.append({"name": "Age", "type": "date", "format": "", "description": "", "priority": 0})
        rows = [{"cells": [o["metadata"]["name"], *(_json_path(o, c["jsonPath"]) for c in columns),
                           _age(o["metadata"].get("creationTimestamp"))],
                 "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}}
                for o in items]
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": dict(meta),
                "columnDefinitions": definitions, "rows": rows}

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        """`/api/v1` and `/apis/GROUP/VERSION` (kmock answers the core group with the root listing)."""
        entries = []
        for resource in sorted(self._get_resources(), key=lambda r: r.plural or ""):
            if resource.group != group or resource.version != version or not resource.plural:
                continue
            info = self.resources[resource]
            main = {"name": resource.plural, "singularName": info.singular or resource.plural,
                    "namespaced": bool(info.namespaced), "kind": info.kind or resource.plural.capitalize(),
                    "verbs": sorted(info.verbs or []), "shortNames": sorted(info.shortnames or []),
                    "categories": sorted(info.categories or [])}
            entries.append(main)
            entries += [{"name": f"{resource.plural}/{sub}", "singularName": "", "namespaced": main["namespaced"],
                         "kind": main["kind"], "verbs": ["get", "patch", "update"]} for sub in sorted(info.subresources or [])]
        if not entries and group:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {group}/{version}")
        return {"apiVersion": "v1", "kind": "APIResourceList",
                "groupVersion": f"{group}/{version}" if group else version, "resources": entries}

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        try:
            return self.resources[resource]
        except KeyError:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {_key(resource)}") from None

    async def _log(self, namespace: str, name: str, container: str | None) -> aiohttp.web.StreamResponse:
        self.get(PODS, namespace, name)
        text = await self.log_reader(namespace, name, container) if self.log_reader else None
        if text is None:
            raise ApiError(400, "BadRequest", f'container in pod "{name}" is waiting to start')
        return aiohttp.web.Response(text=text, content_type="text/plain")

    # ------------------------------------------------------------------ reads

    def _stored(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key].raw

    def get(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._stored(resource, namespace, name)
        if obj is None:
            raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found',
                           {"name": name, "kind": resource.plural})
        return obj

    def items(self, resource: kmock.resource, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every live object of a resource (in one namespace, or all with None)."""
        return [obj.raw for (res, ns, _), obj in list(self._objects.items())
                if res == resource and not obj.deleted and (namespace is None or ns == namespace)]

    def list_objects(self, resource: kmock.resource, namespace: str | None,
                     params: Mapping[str, str]) -> dict[str, Any]:
        selector = patching.parse_label_selector(params.get("labelSelector", ""))
        items = [o for o in self.items(resource, namespace) if _selected(o, selector, params.get("fieldSelector"))]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        kind = self._info(resource).kind or resource.plural.capitalize()
        api_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
        return {"apiVersion": api_version, "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    # ------------------------------------------------------------------ writes

    async def create(self, resource: kmock.resource, namespace: str | None, body: Any) -> dict[str, Any]:
        info = self._info(resource)
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        obj = json.loads(json.dumps(body))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        if info.namespaced:
            namespace = namespace or meta.get("namespace") or "default"
            if self._stored(NAMESPACES, None, namespace) is None:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
            meta["namespace"] = namespace
        if "status" in info.subresources and resource != CRD_RESOURCE:
            obj.pop("status", None)
        kind = info.kind or resource.plural.capitalize()
        obj["kind"] = kind
        obj["apiVersion"] = f"{resource.group}/{resource.version}" if resource.group else resource.version
        async with self._lock:
            if self._stored(resource, namespace, name) is not None:
                raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists',
                               {"name": name, "kind": resource.plural})
            self._admit(resource, obj, None)  # may replace nested dicts (defaults, pruning)
            meta = obj["metadata"]
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
            for transient in ("deletionTimestamp", "resourceVersion"):
                meta.pop(transient, None)
            if resource == CRD_RESOURCE:
                self._register_crd(obj)
            await self._put(resource, namespace, name, obj, "ADDED")
        return obj

    async def patch(self, resource: kmock.resource, namespace: str | None, name: str, body: Any,
                    content_type: str, subresource: str | None = None) -> dict[str, Any]:
        async with self._lock:
            old = self.get(resource, namespace, name)
            try:
                if "json-patch" in content_type:
                    new = patching.json_patch(old, body)
                else:
                    new = patching.merge_patch(old, body if isinstance(body, Mapping) else {})
            except patching.PatchError as error:
                raise ApiError(error.status, "Invalid" if error.status == 422 else "BadRequest", str(error)) from None
            return await self._update(resource, namespace, old, new, subresource)

    async def replace(self, resource: kmock.resource, namespace: str | None, name: str, body: Any,
                      subresource: str | None = None) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        async with self._lock:
            old = self.get(resource, namespace, name)
            wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
            if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource.plural} "{name}": '
                               "the object has been modified; please apply your changes to the latest version")
            return await self._update(resource, namespace, old, json.loads(json.dumps(body)), subresource)

    async def _update(self, resource: kmock.resource, namespace: str | None, old: dict[str, Any],
                      new: dict[str, Any], subresource: str | None) -> dict[str, Any]:
        """Apply the subresource split, keep identity fields, admit, store; the lock is held."""
        info = self._info(resource)
        if subresource == "status":
            merged = dict(old)
            merged["status"] = new.get("status")
            if merged["status"] is None:
                merged.pop("status")
            new = merged
        elif "status" in info.subresources and resource != CRD_RESOURCE:
            new = {**new, "status": old.get("status")} if "status" in old else {k: v for k, v in new.items() if k != "status"}
        meta = new["metadata"] = dict(new.get("metadata") or {})  # never mutate the stored version
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
            else:
                meta.pop(fixed, None)
        meta["generation"] = old["metadata"].get("generation", 1) + (1 if _spec_changed(old, new) else 0)
        new["kind"], new["apiVersion"] = old["kind"], old["apiVersion"]
        if new == old:
            return old  # a no-op write does not bump resourceVersion (as the API server does)
        self._admit(resource, new, old)
        if resource == CRD_RESOURCE:
            self._register_crd(new)
        name = meta["name"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(resource, namespace, name, new)
            return new
        await self._put(resource, namespace, name, new, "MODIFIED")
        return new

    async def delete(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any]:
        async with self._lock:
            obj = dict(self.get(resource, namespace, name))
            meta = obj["metadata"] = dict(obj["metadata"])
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = now_iso()
                    meta["deletionGracePeriodSeconds"] = 0
                    await self._put(resource, namespace, name, obj, "MODIFIED")
                return obj
            await self._remove(resource, namespace, name, obj)
        return obj

    async def _put(self, resource: kmock.resource, namespace: str | None, name: str,
                   obj: dict[str, Any], event: str) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (resource, namespace, name)
        self._objects[key] = obj  # replaces the history: one version kept
        await self._buses[resource].put({"type": event, "object": obj})

    async def _remove(self, resource: kmock.resource, namespace: str | None, name: str,
                      obj: dict[str, Any]) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        del self._objects[(resource, namespace, name)]
        await self._buses[resource].put({"type": "DELETED", "object": obj})
        await self._collect_garbage(obj["metadata"]["uid"])

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Background propagation: delete every object that names the gone owner (recursively)."""
        dependents = [(res, ns, name) for (res, ns, name), o in list(self._objects.items())
                      if not o.deleted and any(ref.get("uid") == owner_uid
                                               for ref in o.get("metadata", {}).get("ownerReferences", []) or [])]
        for res, ns, name in dependents:
            obj = dict(self._objects[(res, ns, name)].raw)
            meta = obj["metadata"] = dict(obj["metadata"])
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = now_iso()
                    await self._put(res, ns, name, obj, "MODIFIED")
            else:
                await self._remove(res, ns, name, obj)

    # ------------------------------------------------------------------ admission

    def _admit(self, resource: kmock.resource, obj: dict[str, Any], old: Mapping[str, Any] | None) -> None:
        crd = self._crds.get(_key(resource))
        if crd is None or self.custom_validator is None:
            return
        errors = self.custom_validator(crd, obj, old)
        if errors:
            kind = obj.get("kind", resource.plural)
            name = obj.get("metadata", {}).get("name", "")
            raise ApiError(422, "Invalid", f'{kind}.{resource.group} "{name}" is invalid: ' + "; ".join(errors),
                           {"name": name, "kind": kind, "causes": [{"message": e} for e in errors]})

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = {
                "kind": names.get("kind"), "singular": names.get("singular"),
                "namespaced": spec.get("scope", "Namespaced") == "Namespaced",
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                "shortnames": names.get("shortNames", []), "categories": names.get("categories", []),
                "subresources": list((version.get("subresources") or {}).keys()),
            }
            self._crds[_key(resource)] = crd
        crd["status"] = {"conditions": [
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "lastTransitionTime": now_iso()}],
            "acceptedNames": names}

    # ------------------------------------------------------------------ watch

    async def _watch(self, request: rendering.Request, resource: kmock.resource,
                     namespace: str | None) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        timeout_s = float(request.params.get("timeoutSeconds") or 3600)
        with contextlib.suppress(asyncio.TimeoutError, ConnectionResetError, asyncio.CancelledError):
            async with asyncio.timeout(timeout_s):
                async for event in self.watch_events(resource, namespace, request.params):
                    await response.write(json.dumps(event).encode() + b"\n")
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    async def watch_events(self, resource: kmock.resource, namespace: str | None,
                           params: Mapping[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Events for current objects (after `resourceVersion`, if given), then every change."""
        params = params or {}
        selector = patching.parse_label_selector(params.get("labelSelector", ""))
        since = int(params["resourceVersion"]) if str(params.get("resourceVersion", "")).isdigit() else None
        bus = self._buses[resource]
        async with self._lock:
            mark = await bus.mark()  # before the snapshot: nothing between the two is lost
            snapshot = self.items(resource, namespace)
        try:
            for obj in snapshot:
                rv = int(obj["metadata"]["resourceVersion"])
                if (since is None or rv > since) and _selected(obj, selector, params.get("fieldSelector")):
                    yield {"type": "ADDED" if since is None else "MODIFIED", "object": obj}
            async for event in bus.stream(since=mark):
                obj = event["object"]
                if namespace is not None and obj["metadata"].get("namespace") != namespace:
                    continue
                if since is not None and int(obj["metadata"]["resourceVersion"]) <= since:
                    continue
                if _selected(obj, selector, params.get("fieldSelector")):
                    yield event
        finally:
            await bus.unmark(mark)


def _json_path(obj: Mapping[str, Any], json_path: str) -> Any:
    """The value at a simple `.a.b.c` JSONPath (what printer columns use), or None."""
    current: Any = obj
    for part in json_path.strip(".").split("."):
        current = current.get(part) if isinstance(current, Mapping) else None
    return current


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    created = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(tz=datetime.UTC) - created).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _selected(obj: Mapping[str, Any], selector: tuple[patching.Requirement, ...], fields: str | None) -> bool:
    return patching.labels_match(selector, obj.get("metadata", {}).get("labels")) and patching.fields_match(fields, obj)


def _spec_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    def essence(o: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in o.items() if k not in ("metadata", "status", "kind", "apiVersion")}

    return essence(old) != essence(new)


def _json(body: Mapping[str, Any], status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)
