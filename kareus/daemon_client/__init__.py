"""The runtime's side of the node daemon: ask `kareus-node` for GPU clocks.

`connect(endpoint, gpu_uuids)` is all a training process needs: it returns a `ClockClient`
whose `request_clock(clock_mhz, instruction=…)` never blocks and never raises. The endpoint is a
Unix socket path or ``tcp://HOST:PORT`` (authenticated with the pod's projected ServiceAccount
token; `daemon_endpoint` and `endpoint_from_env` build it from `--daemon-socket`/`--daemon-address`
or `KAREUS_DAEMON_SOCKET`/`KAREUS_DAEMON_ADDRESS`). Without an endpoint it returns a
`NullClockClient`; when the daemon is missing or refuses the GPUs, the client is a *degraded*
`NullClockClient` that says why (training goes on at default clocks).

`DaemonConnection` is the lower-level, blocking request/answer API (discover, lock, reset, read,
schedule, next, status) used by `kareus clock` and the tests. The wire format is in `protocol`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kareus.daemon_client.clients import (
    ClockClient,
    ClockRecord,
    DaemonClockClient,
    NullClockClient,
    RecordingClockClient,
)
from kareus.daemon_client.connection import (
    DaemonConnection,
    DaemonError,
    GPUInfo,
    GPUReading,
    daemon_endpoint,
    endpoint_from_env,
    open_connection,
)

__all__ = [
    "ClockClient",
    "ClockRecord",
    "DaemonClockClient",
    "DaemonConnection",
    "DaemonError",
    "GPUInfo",
    "GPUReading",
    "NullClockClient",
    "RecordingClockClient",
    "connect",
    "daemon_endpoint",
    "endpoint_from_env",
    "open_connection",
]

log = logging.getLogger("kareus.daemon_client")


def connect(
    socket_path: str | None,
    gpu_uuids: Sequence[str] | None = None,
    *,
    job: str | None = None,
    required: bool = False,
    timeout_s: float = 5.0,
    token_file: str | None = None,
) -> ClockClient:
    """A clock client for `gpu_uuids` (default: every GPU the daemon lets this process control).

    `socket_path` is the daemon's endpoint: a Unix socket path or ``tcp://HOST:PORT`` (then
    `token_file`, default `$KAREUS_DAEMON_TOKEN_FILE`, holds the token to authenticate with).
    With ``required=True`` a missing daemon or a refused GPU raises `DaemonError` instead of
    returning a degraded client.
    """
    if not socket_path:
        return NullClockClient()
    try:
        connection = open_connection(socket_path, timeout_s=timeout_s, job=job, token_file=token_file)
    except DaemonError as error:
        return _degraded(str(error), required, error)
    try:
        gpus = {gpu.uuid: gpu for gpu in connection.discover()}
        chosen = _choose_gpus(gpus, gpu_uuids)
    except DaemonError as error:
        connection.close()
        return _degraded(str(error), required, error)
    return DaemonClockClient(connection, chosen)


def _choose_gpus(gpus: dict[str, GPUInfo], wanted: Sequence[str] | None) -> list[str]:
    if wanted is None:
        chosen = [uuid for uuid, gpu in gpus.items() if gpu.controllable]
        if not chosen:
            raise DaemonError("refused", "the daemon lets this process control no GPU")
        return chosen
    for uuid in wanted:
        if uuid not in gpus:
            raise DaemonError("refused", f"GPU {uuid} is not on this node (known: {', '.join(gpus) or 'none'})")
        if not gpus[uuid].controllable:
            raise DaemonError("refused", f"GPU {uuid} cannot be controlled by this process: {gpus[uuid].reason}")
    return list(wanted)


def _degraded(reason: str, required: bool, error: DaemonError) -> ClockClient:
    if required:
        raise error
    log.warning("no clock control, training continues at default clocks: %s", reason)
    return NullClockClient(reason)
