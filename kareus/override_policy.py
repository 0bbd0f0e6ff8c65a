"""What a KareusJob's `spec.podTemplateOverrides` may add to its pods, whatever its namespace allows.

The profiling and optimizing pods run the operator's image and write what other jobs trust (the
profile cache, the plan), and every child pod reaches the node agent: an override is therefore
checked by the operator itself, not left to the namespace's Pod Security label (which a cluster
may never set). The policy's key `podTemplateOverrides` says

- `volumeTypes`: the volume sources an override may add; the default is exactly the set Pod
  Security `restricted` admits, so hostPath (and nfs, iscsi, …) is refused until a platform team
  lists it;
- `priorityClassNames`: the PriorityClasses an override may name; empty allows any but the
  `system-` ones, which would let a job preempt node-critical pods;
- `tolerationKeys`: the taint keys a toleration may name; empty allows any key; a toleration of
  every taint (no key, operator Exists) only with the entry `"*"`;
- `deniedEnvNames` / `deniedEnvPrefixes`: environment an override may not set, because it changes
  which code the operator's own commands run (`LD_PRELOAD`, `PYTHONPATH`) or how they talk to the
  node agent (`KAREUS_`).

Annotations that switch off AppArmor or seccomp, which Pod Security `baseline` already refuses,
are refused always: no policy key admits them, as no override field admits privilege, host
namespaces or added capabilities. So is a volume mount, in the profiling and optimizing pods, at
or above a directory that holds their code or their inputs and outputs (`OPERATOR_ROLE_PATHS`: the
image's system and Python directories, `/etc/kareus`, `/var/kareus`): a configMap mounted over the
optimizer's code, or a forged profile over the one the operator mounts, would make the plan that
the power allocator and the node agents' clock ceilings trust the tenant's own (issue 29 item 6).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.errors import KareusError

# Pod Security `restricted` (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
RESTRICTED_VOLUME_TYPES: tuple[str, ...] = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                            "persistentVolumeClaim", "projected", "secret")
DENIED_ENV_NAMES: tuple[str, ...] = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME",
                                     "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONSAFEPATH", "BASH_ENV", "ENV",
                                     "NCCL_NET_PLUGIN", "TORCHINDUCTOR_CACHE_DIR")
DENIED_ENV_PREFIXES: tuple[str, ...] = ("LD_", "KAREUS_")
TOLERATE_ALL = "*"
# The roles whose pods run the operator's image and command (`kareus profile`, `kareus optimize`).
OPERATOR_ROLES: tuple[str, ...] = ("profile", "optimize")
# Where those pods' code, libraries and the operator's mounts live (images/runtime.Dockerfile: the venv
# in /opt/kareus, the working directory /workspace; kareus_operator.settings.MOUNT_*); an override may
# not mount at, under or above any of them in those roles.
OPERATOR_ROLE_PATHS: tuple[str, ...] = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc",
                                        "/opt", "/proc", "/sys", "/dev", "/var/kareus", "/workspace")
_KEYS = frozenset({"volumeTypes", "priorityClassNames", "tolerationKeys", "deniedEnvNames", "deniedEnvPrefixes"})
_APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
_SECCOMP_ANNOTATIONS = ("seccomp.security.alpha.kubernetes.io/pod",)
_SECCOMP_PREFIX = "container.seccomp.security.alpha.kubernetes.io/"


class OverridePolicyError(KareusError):
    """The policy's `podTemplateOverrides` section is malformed; the message names the key."""


@dataclass(frozen=True)
class OverridePolicy:
    """The typed `podTemplateOverrides` policy; the defaults are what Pod Security `restricted` allows."""

    volume_types: frozenset[str] = frozenset(RESTRICTED_VOLUME_TYPES)
    priority_class_names: frozenset[str] = frozenset()
    toleration_keys: frozenset[str] = frozenset()
    denied_env_names: frozenset[str] = frozenset(DENIED_ENV_NAMES)
    denied_env_prefixes: tuple[str, ...] = DENIED_ENV_PREFIXES


@dataclass(frozen=True)
class OverrideRefusal:
    """One override field the policy refuses: `field` is its path in the job, `rule` the policy key."""

    field: str
    rule: str
    message: str

    def text(self) -> str:
        return f"{self.field}: {self.message} (policy.podTemplateOverrides.{self.rule})"


def load_override_policy(raw: Any, where: str = "policy.podTemplateOverrides") -> OverridePolicy:
    """Parse the section; absent keys keep the restricted defaults."""
    if raw is None:
        return OverridePolicy()
    if not isinstance(raw, Mapping):
        raise OverridePolicyError(f"{where}: must be a mapping with keys {', '.join(sorted(_KEYS))}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise OverridePolicyError(f"{where}.{unknown[0]}: unknown key; allowed keys are {', '.join(sorted(_KEYS))}")
    default = OverridePolicy()
    return OverridePolicy(
        volume_types=frozenset(_names(raw, "volumeTypes", where, default.volume_types)),
        priority_class_names=frozenset(_names(raw, "priorityClassNames", where, default.priority_class_names)),
        toleration_keys=frozenset(_names(raw, "tolerationKeys", where, default.toleration_keys)),
        denied_env_names=frozenset(_names(raw, "deniedEnvNames", where, default.denied_env_names)),
        denied_env_prefixes=tuple(_names(raw, "deniedEnvPrefixes", where, default.denied_env_prefixes)),
    )


def _names(raw: Mapping[str, Any], key: str, where: str, default: Sequence[str] | frozenset[str]) -> list[str]:
    value = raw.get(key)
    if value is None:
        return list(default)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise OverridePolicyError(f"{where}.{key}: must be a list of non-empty strings, got {value!r}")
    return value


def check_overrides(policy: OverridePolicy, overrides: Sequence[Any], role: str | None = None) -> list[OverrideRefusal]:
    """Every refused field of a job's `spec.podTemplateOverrides` (`kareus.spec.PodOverride`s),
    of the entries for `role` only when one is given."""
    return [refusal for index, override in enumerate(overrides) if role is None or role in override.roles
            for refusal in _check_one(policy, override, f"spec.podTemplateOverrides[{index}]")]


def _check_one(policy: OverridePolicy, override: Any, at: str) -> Iterator[OverrideRefusal]:
    for i, volume in enumerate(override.volumes):
        for source in sorted(set(volume) - {"name"}):
            if source not in policy.volume_types:
                yield OverrideRefusal(f"{at}.spec.volumes[{i}].{source}", "volumeTypes",
                                      f"volume type {source} is not allowed (Pod Security restricted refuses it "
                                      f"unless the cluster policy lists it); allowed: {', '.join(sorted(policy.volume_types))}")
    name = override.priority_class_name
    if name and not _priority_allowed(policy, name):
        allowed = (", ".join(sorted(policy.priority_class_names)) if policy.priority_class_names
                   else "any PriorityClass not named system-*")
        yield OverrideRefusal(f"{at}.spec.priorityClassName", "priorityClassNames",
                              f"{name!r} is not allowed; allowed: {allowed}")
    for i, toleration in enumerate(override.tolerations):
        message = _toleration_refused(policy, toleration)
        if message:
            yield OverrideRefusal(f"{at}.spec.tolerations[{i}]", "tolerationKeys", message)
    for i, env in enumerate(override.env):
        rule = ("deniedEnvNames" if env.name in policy.denied_env_names
                else "deniedEnvPrefixes" if env.name.startswith(policy.denied_env_prefixes) else None)
        if rule is not None:
            yield OverrideRefusal(f"{at}.spec.env[{i}].name", rule,
                                  f"{env.name} may not be set by an override: it changes the code or the node-agent "
                                  f"connection of the operator's own commands")
    roles = [role for role in OPERATOR_ROLES if role in override.roles]
    for i, mount in enumerate(override.volume_mounts if roles else ()):
        path = str(mount.get("mountPath") or "")
        hit = next((guarded for guarded in OPERATOR_ROLE_PATHS if _overlaps(path, guarded)), None)
        if hit is not None:
            yield OverrideRefusal(f"{at}.spec.volumeMounts[{i}].mountPath", "none",
                                  f"{path!r} covers {hit}: the {' and '.join(roles)} pods run the operator's own image "
                                  f"and command, and a mount there could replace their code or their inputs; no "
                                  f"policy key allows it (mount elsewhere, or only in the train role)")
    for key, value in sorted(override.annotations.items()):
        if _unconfined(key, value):
            yield OverrideRefusal(f"{at}.metadata.annotations.{key}", "none",
                                  f"{value!r} switches off a security profile; Pod Security baseline refuses it "
                                  f"and no policy key allows it")


def _priority_allowed(policy: OverridePolicy, name: str) -> bool:
    if policy.priority_class_names:
        return name in policy.priority_class_names
    return not name.startswith("system-")


def _toleration_refused(policy: OverridePolicy, toleration: Mapping[str, Any]) -> str | None:
    key = toleration.get("key") or ""
    allowed = policy.toleration_keys
    if not key:
        if TOLERATE_ALL in allowed:
            return None
        return "a toleration without a key tolerates every taint (control-plane, not-ready, …); name the taint key"
    if allowed and key not in allowed and TOLERATE_ALL not in allowed:
        return f"taint key {key!r} is not allowed; allowed: {', '.join(sorted(allowed))}"
    return None


def _overlaps(path: str, guarded: str) -> bool:
    """Whether a mount at `path` is at, under or above directory `guarded` (both absolute)."""
    mount = posixpath.normpath("/" + path.lstrip("/"))
    if mount == "/":
        return True
    return mount == guarded or mount.startswith(guarded + "/") or guarded.startswith(mount + "/")


def _unconfined(key: str, value: str) -> bool:
    if key.startswith(_APPARMOR_PREFIX):
        return value != "runtime/default" and not value.startswith("localhost/")
    if key in _SECCOMP_ANNOTATIONS or key.startswith(_SECCOMP_PREFIX):
        return value not in ("runtime/default", "docker/default") and not value.startswith("localhost/")
    return False
