"""The node daemon's policy file (`--config`), rendered by Helm into a ConfigMap and mounted.

The file is YAML; every key is optional and an unknown key is an error naming it::

    dryRun: false                 # observe only: measure and export, never change a clock
    allowedNamespaces: []         # pods in other namespaces are refused (empty: every namespace)
    clockBounds:                  # the same shape as the cluster policy's clockBounds
      default: {floorMHz: 900, ceilingMHz: 1980}
      gpuModels:
        NVIDIA-A100-SXM4-40GB: {floorMHz: 1005, ceilingMHz: 1410}
    podRecheckSeconds: 5          # how often leases are re-checked against the kubelet
    tokenReviewSeconds: 60        # how often a TCP caller's token is re-reviewed (TokenReview) during a re-check
    maxConnections: 64            # authenticated sessions (Unix socket + TCP after hello); more are turned away
    reservedUnixConnections: 8    # of those, kept for the Unix socket (default: an eighth); TCP may take the rest only
    maxConnectionsPerPod: 16      # authenticated sessions of one pod (or, outside pods, one uid)
    maxPendingConnections: 32     # TCP connections that have not authenticated yet (a separate pool)
    maxPendingPerPeer: 16         # of those, from one IP address (a pod's ranks all connect at once)
    helloRatePerSecond: 10        # hellos one IP may send per second (burst: twice that)
    idleTimeoutSeconds: 120       # a session without leases that sends nothing this long is closed
    defaultFloorFraction: 0.6     # without a policy floor for a model: the floor is this share of its top clock (0: none)
    requestTimeoutSeconds: 5      # a frame must arrive completely within this
    maxScheduleLength: 4096       # entries in one uploaded clock schedule
    metricsMaxConnections: 16     # concurrent connections to the metrics/health HTTP server

`clockBounds` and `allowedNamespaces` are parsed by `kareus.policy`, so the operator (which keeps
plans inside the same bounds) and the daemon (which refuses anything outside) cannot disagree. The
default floor is `kareus.policy.DEFAULT_FLOOR_FRACTION`, which the profiler's clock grid never goes
below (and a profiling pod profiles only the clocks its node agent says it may lock).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kareus.errors import KareusError
from kareus.policy import DEFAULT_FLOOR_FRACTION, ClusterPolicy, PolicyError, load_policy

_POLICY_KEYS = ("clockBounds", "allowedNamespaces")
_LIMIT_KEYS = {
    "podRecheckSeconds": ("pod_recheck_s", float),
    "tokenReviewSeconds": ("token_review_s", float),
    "maxConnections": ("max_connections", int),
    "maxConnectionsPerPod": ("max_connections_per_pod", int),
    "maxPendingConnections": ("max_pending_connections", int),
    "maxPendingPerPeer": ("max_pending_per_peer", int),
    "helloRatePerSecond": ("hello_rate_per_s", float),
    "idleTimeoutSeconds": ("idle_timeout_s", float),
    "metricsMaxConnections": ("metrics_max_connections", int),
    "requestTimeoutSeconds": ("request_timeout_s", float),
    "maxScheduleLength": ("max_schedule_length", int),
}
_KEYS = frozenset({"dryRun", "defaultFloorFraction", "reservedUnixConnections", *_POLICY_KEYS, *_LIMIT_KEYS})


class ConfigError(KareusError):
    """The daemon's config file is malformed; the message names the key."""


@dataclass(frozen=True)
class NodeConfig:
    """What the daemon enforces. The defaults are what an absent file means."""

    dry_run: bool = False
    policy: ClusterPolicy = field(default_factory=ClusterPolicy)
    pod_recheck_s: float = 5.0
    token_review_s: float = 60.0
    max_connections: int = 64
    reserved_unix_connections: int | None = None  # None: an eighth of max_connections
    max_connections_per_pod: int = 16
    max_pending_connections: int = 32
    max_pending_per_peer: int = 16
    hello_rate_per_s: float = 10.0
    idle_timeout_s: float = 120.0
    default_floor_fraction: float = DEFAULT_FLOOR_FRACTION
    request_timeout_s: float = 5.0
    max_schedule_length: int = 4096
    metrics_max_connections: int = 16

    @property
    def unix_reserve(self) -> int:
        """Authenticated slots only the Unix socket may take."""
        if self.reserved_unix_connections is None:
            return self.max_connections // 8
        return self.reserved_unix_connections

    def namespace_allowed(self, namespace: str) -> bool:
        return self.policy.namespace_allowed(namespace)


def load_config(path: str | Path | None) -> NodeConfig:
    """Read the config file; None gives the defaults."""
    if path is None:
        return NodeConfig()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"config file {path}: cannot be read ({error.strerror or error})") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path}: not valid YAML ({error})") from None
    return parse_config(raw, source=str(path))


def parse_config(raw: Any, *, source: str = "config") -> NodeConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: must be a mapping of settings, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown key; allowed keys are {', '.join(sorted(_KEYS))}")
    dry_run = raw.get("dryRun", False)
    if not isinstance(dry_run, bool):
        raise ConfigError(f"{source}: dryRun: must be true or false, got {dry_run!r}")
    try:
        policy = load_policy({key: raw[key] for key in _POLICY_KEYS if key in raw})
    except PolicyError as error:
        raise ConfigError(f"{source}: {error}") from None
    limits = {attr: _positive(raw[key], kind, f"{source}: {key}") for key, (attr, kind) in _LIMIT_KEYS.items() if key in raw}
    fraction = raw.get("defaultFloorFraction", DEFAULT_FLOOR_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
        raise ConfigError(f"{source}: defaultFloorFraction: must be a share of the top clock from 0 (no floor) "
                          f"to 1, got {fraction!r}")
    reserve = raw.get("reservedUnixConnections")
    if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0):
        raise ConfigError(f"{source}: reservedUnixConnections: must be a whole number >= 0, got {reserve!r}")
    config = NodeConfig(dry_run=dry_run, policy=policy, default_floor_fraction=float(fraction),
                        reserved_unix_connections=reserve, **limits)
    if config.unix_reserve >= config.max_connections:
        raise ConfigError(f"{source}: reservedUnixConnections: must be less than maxConnections "
                          f"({config.max_connections}), got {config.unix_reserve}")
    return config


def _positive(value: Any, kind: type, where: str) -> Any:
    ok_type = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        noun = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{where}: must be {noun} > 0, got {value!r}")
    return kind(value)
