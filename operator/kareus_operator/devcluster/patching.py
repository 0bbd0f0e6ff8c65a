"""How the API server changes and selects stored objects: patches and selectors.

Three patch dialects reach a Kubernetes API server: JSON merge patch (RFC 7386: objects merge,
`null` deletes a key, lists are replaced whole — what kopf sends), strategic merge patch (what the
official client sends by default; for the objects the dev cluster serves it behaves like a merge
patch, because their lists carry no merge keys Kareus relies on) and JSON patch (RFC 6902: a list of
operations, including `test`, which kopf uses for optimistic concurrency on finalizers). Label and
field selectors decide which objects a list or watch returns.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class PatchError(ValueError):
    """A patch that cannot be applied; `status` is the HTTP status the API server answers with."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: a new value, neither input is modified."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Mapping[str, Any], operations: Any) -> dict[str, Any]:
    """RFC 6902 JSON patch; a failed `test` raises PatchError (the API answers 422, as kopf expects)."""
    if not isinstance(operations, list):
        raise PatchError("json patch: the body must be a list of operations", status=400)
    doc: Any = copy.deepcopy(dict(target))
    for op in operations:
        if not isinstance(op, Mapping) or "op" not in op or "path" not in op:
            raise PatchError(f"json patch: malformed operation {op!r}", status=400)
        doc = _apply_op(doc, op)
    return doc


def _apply_op(doc: Any, op: Mapping[str, Any]) -> Any:
    kind, parts = op["op"], _pointer(op["path"])
    if kind == "test":
        if _get(doc, parts) != op.get("value"):
            raise PatchError(f"json patch: test failed at {op['path']}")
        return doc
    if kind in ("copy", "move"):
        value = copy.deepcopy(_get(doc, _pointer(op["from"])))
        if kind == "move":
            doc = _remove(doc, _pointer(op["from"]))
        return _add(doc, parts, value)
    if kind == "remove":
        return _remove(doc, parts)
    if kind == "add":
        return _add(doc, parts, copy.deepcopy(op.get("value")))
    if kind == "replace":
        _get(doc, parts)  # must exist
        return _add(_remove(doc, parts), parts, copy.deepcopy(op.get("value")))
    raise PatchError(f"json patch: unknown op {kind!r}", status=400)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"json patch: bad path {path!r}", status=400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _get(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        try:
            doc = doc[int(part)] if isinstance(doc, list) else doc[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"json patch: path /{'/'.join(parts)} does not exist") from None
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent, last = _get(doc, parts[:-1]), parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise PatchError(f"json patch: index {last} out of range")
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise PatchError(f"json patch: cannot add under a scalar at /{'/'.join(parts)}")
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return None
    parent, last = _get(doc, parts[:-1]), parts[-1]
    _get(doc, parts)
    if isinstance(parent, list):
        del parent[int(last)]
    else:
        del parent[last]
    return doc


# ------------------------------------------------------------------ selectors


@dataclass(frozen=True)
class Requirement:
    """One clause of a label selector: `key op values` with op in =, !=, in, notin, exists, !exists."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values  # != and notin


_SET_CLAUSE = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_label_selector(text: str) -> tuple[Requirement, ...]:
    """Parse `a=b,c!=d,e,!f,g in (x,y),h notin (z)` (the API's string form)."""
    clauses = re.findall(r"[^,(]+(?:\([^)]*\))?", text or "")
    return tuple(_clause(c) for c in clauses if c.strip())


def _clause(clause: str) -> Requirement:
    if match := _SET_CLAUSE.match(clause):
        values = frozenset(v.strip() for v in match.group(3).split(",") if v.strip())
        return Requirement(match.group(1), match.group(2), values)
    for op in ("!=", "==", "="):
        if op in clause:
            key, value = (s.strip() for s in clause.split(op, 1))
            return Requirement(key, "!=" if op == "!=" else "=", frozenset({value}))
    clause = clause.strip()
    if clause.startswith("!"):
        return Requirement(clause[1:].strip(), "!exists")
    return Requirement(clause, "exists")


def labels_match(selector: tuple[Requirement, ...], labels: Mapping[str, str] | None) -> bool:
    return all(req.matches(labels or {}) for req in selector)


def fields_match(text: str | None, obj: Mapping[str, Any]) -> bool:
    """Field selectors as equality on dotted paths (`metadata.name=x`, `status.phase!=Running`)."""
    for clause in filter(None, (text or "").split(",")):
        negate = "!=" in clause
        path, value = clause.split("!=" if negate else ("==" if "==" in clause else "="), 1)
        current: Any = obj
        for part in path.strip().split("."):
            current = current.get(part) if isinstance(current, Mapping) else None
        if ((current if current is not None else "") == value.strip()) == negate:
            return False
    return True
