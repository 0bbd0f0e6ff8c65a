"""The daemon's own, minimal API-server client: JSON over HTTPS with its ServiceAccount token.

Two reads need it — the pods on this node (`pods.PodDirectory`) and TokenReviews of callers'
tokens (`auth.TokenAuthorizer`) — so both share one way of authenticating: the projected token
and CA of the daemon's pod (`kareus.incluster`), the token re-read on every call because the
kubelet rotates it. Any failure to get an answer is `KubeAPIUnavailable` (callers fail closed).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any

from kareus.incluster import serviceaccount_dir


class KubeAPIUnavailable(Exception):
    """The API server could not be asked, or answered with an error; `status` is the HTTP status (0: none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class KubeAPI:
    """`get`/`post` JSON against `api_url` as the daemon's ServiceAccount."""

    def __init__(self, api_url: str, *, token_path: str | None = None, ca_path: str | None = None,
                 timeout_s: float = 2.0) -> None:
        self.api_url = api_url.rstrip("/")
        self._token_path = token_path or str(serviceaccount_dir() / "token")
        ca_path = ca_path or str(serviceaccount_dir() / "ca.crt")
        self._context = ssl.create_default_context(cafile=ca_path) if os.path.exists(ca_path) else None
        self._timeout_s = timeout_s

    def get(self, path: str, *, accept: str = "application/json") -> Any:
        """GET `path` as JSON; `accept` names the media type where the API server insists on its own
        (the JWKS is served only as application/jwk-set+json)."""
        return self._call("GET", path, None, accept)

    def post(self, path: str, body: Any) -> Any:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: Any, accept: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api_url + path, data=data, method=method,
                                         headers={"Accept": accept})
        if data is not None:
            request.add_header("Content-Type", "application/json")
        token = self._token()
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s, context=self._context) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            detail = _status_message(error)
            raise KubeAPIUnavailable(f"{method} {path}: HTTP {error.code}{': ' + detail if detail else ''}",
                                     error.code) from None
        except (OSError, ValueError, urllib.error.URLError) as error:
            raise KubeAPIUnavailable(f"{method} {path}: {error}") from None

    def _token(self) -> str:
        try:
            with open(self._token_path, encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError:
            return ""


def _status_message(error: urllib.error.HTTPError) -> str:
    """The `message` of a Kubernetes Status body, so an RBAC denial says what was denied."""
    try:
        return str(json.loads(error.read().decode("utf-8", "replace")).get("message", ""))[:300]
    except (OSError, ValueError, AttributeError):
        return ""
