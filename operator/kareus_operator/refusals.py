"""Why the API server refused a child, in the words a user acts on.

A refused create is not a transient error: a missing ServiceAccount, a Pod Security level, a
ResourceQuota or a missing RBAC verb stays until someone fixes it, and the job must say so — a
False condition whose reason names the cause and an Event carrying the server's own message —
while the operator keeps trying with exponential backoff, so fixing the cause lets the job go on
without being recreated. Throttling (429), conflicts and server errors are retried quietly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kareus_operator.kube import ApiError

# The condition each kind of child reports a refusal on: the phase it blocks.
CONDITION_OF_ROLE = {"spec": "Profiled", "profile": "Profiled", "optimize": "Planned", "train": "Training"}
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class Refusal:
    """A classified refusal: `reason` for the condition, `message` from the server."""

    reason: str
    message: str
    retryable: bool


def classify(error: ApiError) -> Refusal:
    """The cause of an API error, from its status code and the admission plugin's message."""
    message = error.message or error.reason or str(error)
    text = message.lower()
    if error.code == 429 or error.code >= 500 or error.code == 409:
        return Refusal("Throttled" if error.code == 429 else "ServerError", message, retryable=True)
    if error.code == 403:
        if "violates podsecurity" in text:
            return Refusal("PodSecurityRejected", message, retryable=False)
        if "exceeded quota" in text:
            return Refusal("QuotaExceeded", message, retryable=False)
        if "service account" in text or "serviceaccount" in text:
            return Refusal("ServiceAccountMissing", message, retryable=False)
        if "is being terminated" in text or "because it is being terminated" in text:
            return Refusal("NamespaceTerminating", message, retryable=False)
        return Refusal("Forbidden", message, retryable=False)
    if error.code == 422:
        return Refusal("Invalid", message, retryable=False)
    if error.code == 404:
        return Refusal("NotFound", message, retryable=False)
    return Refusal("BadRequest" if error.code == 400 else f"HTTP{error.code}", message, retryable=False)


class ChildRefused(Exception):
    """A child the job needs was refused by the API server (or by the operator's own checks)."""

    def __init__(self, kind: str, name: str, role: str, refusal: Refusal, *, by: str = "the API server") -> None:
        super().__init__(f"{kind} {name}: {refusal.reason}: {refusal.message}")
        self.kind, self.name, self.role, self.refusal, self.by = kind, name, role, refusal, by

    @property
    def condition(self) -> str:
        return CONDITION_OF_ROLE.get(self.role, "Profiled")

    def text(self) -> str:
        return f"{self.by} refused {self.kind} {self.name}: {self.refusal.message}"


def backoff_s(attempt: int, base_s: float = 1.0) -> float:
    """Delay before the next attempt after `attempt` refusals in a row: 1, 2, 4, … 60 s."""
    return min(MAX_BACKOFF_S, base_s * 2 ** max(0, attempt - 1))
