"""Reading a manifest mapping field by field, collecting every error instead of stopping at the first.

A user who runs `kareus validate` wants the whole list of what is wrong, each line naming the field
path (`spec.parallelism.tensor`) and what is allowed. `Fields` wraps one mapping of the manifest at
a path; its typed getters return the value (or the default) and record a `FieldError` when the value
is missing or does not fit. `finish()` reports the keys nobody asked for: unknown fields are errors,
as they are for the CRD (a typo such as `microbatchSize` must not silently fall back to a default).

Null values of known fields count as absent, as the Kubernetes API server prunes them before
defaulting; an unknown field is an error whatever its value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kareus.errors import KareusError

REQUIRED: Any = object()  # sentinel default: the field must be present

# RFC 3339 date-time as the API server takes it through the CRD's `date-time` format, its CEL
# timestamps (upper-case T and Z only) and the CRD's pattern (a year from 0001, offsets within a day).
RFC3339 = re.compile(r"([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}T"
                     r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")


@dataclass(frozen=True)
class FieldError:
    """One problem with one field: `path` in dotted manifest form, `message` says what is allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(KareusError):
    """A manifest that does not validate; `errors` lists every problem found, one per line in `str`."""

    def __init__(self, errors: Sequence[FieldError]) -> None:
        self.errors: list[FieldError] = list(errors)
        super().__init__("\n".join(str(error) for error in self.errors))


def describe(value: Any) -> str:
    """A short rendering of a bad value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_rfc3339(text: str) -> datetime | None:
    """The timestamp `text` denotes, or None when it is not an RFC 3339 date-time."""
    if not RFC3339.fullmatch(text):
        return None
    try:
        return datetime.fromisoformat(text)  # the calendar: no February 30
    except ValueError:
        return None


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_integer(value: Any) -> Any:
    """A whole float as the int it denotes (YAML's `8.0` reaches the server as 8); else `value`."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Fields:
    """One mapping of the manifest at `path`; getters record errors into the shared `errors` list."""

    def __init__(self, data: Mapping[str, Any], path: str, errors: list[FieldError]) -> None:
        self.data = {key: value for key, value in data.items() if value is not None}
        self.null_keys = {key for key, value in data.items() if value is None}
        self.path = path
        self.errors = errors
        self._known: set[str] = set()

    @classmethod
    def of(cls, value: Any, path: str, errors: list[FieldError]) -> Fields | None:
        """`Fields` over `value` when it is a mapping with string keys; an error otherwise."""
        if not isinstance(value, Mapping):
            errors.append(FieldError(path or "manifest", f"must be an object, got {describe(value)}"))
            return None
        bad_keys = [key for key in value if not isinstance(key, str)]
        if bad_keys:
            errors.append(FieldError(path or "manifest", f"field names must be strings, got {describe(bad_keys[0])}"))
            return None
        return cls(value, path, errors)

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | None, message: str) -> None:
        self.errors.append(FieldError(self.at(key) if key else self.path or "manifest", message))

    def has(self, key: str) -> bool:
        self._known.add(key)
        return key in self.data

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value); records `required` when absent without a default."""
        self._known.add(key)
        if key in self.data:
            return True, self.data[key]
        if default is REQUIRED:
            self.error(key, "required field is missing")
        return False, None if default is REQUIRED else default

    def integer(self, key: str, default: Any = REQUIRED, *, minimum: int = 1, maximum: int) -> int | None:
        present, value = self._get(key, default)
        if not present:
            return value
        value = as_integer(value)
        if not is_integer(value) or not minimum <= value <= maximum:
            self.error(key, f"must be an integer in [{minimum}, {maximum}], got {describe(value)}")
            return None
        return value

    def number(self, key: str, default: Any = REQUIRED, *, minimum: float, maximum: float,
               exclusive_minimum: bool = False) -> float | None:
        present, value = self._get(key, default)
        if not present:
            return value
        low_ok = is_number(value) and (value > minimum if exclusive_minimum else value >= minimum)
        if not low_ok or value > maximum:
            low = f"({minimum:g}" if exclusive_minimum else f"[{minimum:g}"
            self.error(key, f"must be a number in {low}, {maximum:g}], got {describe(value)}")
            return None
        return float(value)

    def boolean(self, key: str, default: Any = REQUIRED) -> bool | None:
        present, value = self._get(key, default)
        if present and not isinstance(value, bool):
            self.error(key, f"must be true or false, got {describe(value)}")
            return None
        return value

    def string(self, key: str, default: Any = REQUIRED, *, max_length: int, pattern: re.Pattern | None = None,
               choices: Sequence[str] | None = None, hint: str = "") -> str | None:
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, str) or not 1 <= len(value) <= max_length:
            self.error(key, f"must be a non-empty string of at most {max_length} characters, got {describe(value)}")
            return None
        if choices is not None and value not in choices:
            self.error(key, f"must be one of {', '.join(choices)}, got {describe(value)}")
            return None
        if pattern is not None and not pattern.fullmatch(value):
            self.error(key, f"must match {pattern.pattern}{hint}, got {describe(value)}")
            return None
        return value

    def string_list(self, key: str, *, max_items: int, max_length: int) -> tuple[str, ...] | None:
        present, value = self._get(key, ())
        if not present:
            return value
        if not isinstance(value, list) or len(value) > max_items:
            self.error(key, f"must be a list of at most {max_items} strings, got {describe(value)}")
            return None
        bad = [i for i, item in enumerate(value) if not isinstance(item, str) or len(item) > max_length]
        for index in bad:
            self.errors.append(FieldError(f"{self.at(key)}[{index}]",
                                          f"must be a string of at most {max_length} characters, "
                                          f"got {describe(value[index])}"))
        return None if bad else tuple(value)

    def mapping(self, key: str, *, required: bool = False) -> Fields | None:
        """The nested object at `key` (an empty one when absent and optional)."""
        present, value = self._get(key, REQUIRED if required else {})
        if not present and required:
            return None
        return Fields.of(value, self.at(key), self.errors)

    def finish(self) -> None:
        """Record every key that no getter asked for, null or not (the server's strict decoding does)."""
        unknown = sorted((set(self.data) | self.null_keys) - self._known)
        allowed = ", ".join(sorted(self._known))
        for key in unknown:
            self.error(key, f"unknown field; allowed here: {allowed}")
