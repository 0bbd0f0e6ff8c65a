"""Graceful stop on SIGTERM: the kubelet signals a pod's PID 1, which passes it on, and every rank
finishes the step it is in, then stops with the others (a rank that stopped alone would leave its peers
waiting in a collective until the grace period ran out).

`on_sigterm()` installs the handler in a rank; `requested()` is what the rank contributes to the per-step
agreement (`trainer._reduce_step` takes the MAX over ranks). `EXIT_CODE` (128 + SIGTERM) is what `kareus
train` exits with when it stopped early: not among the exit codes the pod failure policy fails a job on.
"""

from __future__ import annotations

import signal
import threading

EXIT_CODE = 128 + signal.SIGTERM

_requested = threading.Event()


def on_sigterm() -> None:
    """From now on, SIGTERM asks this process to stop after its current step."""
    signal.signal(signal.SIGTERM, lambda *_: _requested.set())


def requested() -> bool:
    return _requested.is_set()


def forward_to(pids_of) -> None:
    """In the parent of local ranks: SIGTERM goes on to every rank (`pids_of()` lists their pids)."""
    import contextlib
    import os

    def forward(*_: object) -> None:
        _requested.set()
        for pid in pids_of():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)


_agreed = threading.Event()


def agreed() -> None:
    """The ranks' per-step reduction found a rank asked to stop."""
    _agreed.set()


def stop_now(*, distributed: bool) -> bool:
    """After a step: stop? With peers, only when they all know (the reduction said so); alone, on request."""
    return _agreed.is_set() if distributed else _requested.is_set()
