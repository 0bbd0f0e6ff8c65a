"""Local signature checks of ServiceAccount tokens, before the API server is asked about them.

A TokenReview costs the API server a request, and API Priority and Fairness counts all of them
against the node agent's ServiceAccount, on every node: a flood of forged hellos must not reach it.
The API server publishes the public keys its ServiceAccount tokens are signed with at
`/openid/v1/jwks` (RBAC: the `nonResourceURLs` rule the chart grants, or the built-in
`system:service-account-issuer-discovery` role). `TokenVerifier` keeps them and checks a token's
signature, audience and expiry with PyJWT; only a token that passes is sent to a TokenReview,
which still decides (a bound token is valid only while its pod exists).

Keys are fetched on first use and again when a token names a key id (`kid`) not in the set — at
most every `refetch_interval_s`, so tokens with made-up key ids cannot turn into a flood of JWKS
reads either. When the keys cannot be fetched the verifier raises `AuthUnavailable`: the daemon
fails closed rather than reviewing unverified tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jwt

from kareus_node.auth import AuthUnavailable
from kareus_node.kubeapi import KubeAPI, KubeAPIUnavailable

JWKS_PATH = "/openid/v1/jwks"
JWKS_MEDIA_TYPE = "application/jwk-set+json"  # the only representation the API server offers (406 otherwise)
# Kubernetes signs ServiceAccount tokens with RSA or ECDSA keys; symmetric algorithms (and "none")
# are never accepted, whatever a token's header says.
ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "PS384", "PS512")
REFETCH_INTERVAL_S = 30.0
CLOCK_SKEW_S = 60.0


class TokenVerifier:
    """Checks tokens against the keys `api` publishes at /openid/v1/jwks."""

    def __init__(self, api: KubeAPI, *, audience: str, refetch_interval_s: float = REFETCH_INTERVAL_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._api = api
        self._audience = audience
        self._refetch_interval_s = refetch_interval_s
        self._now = now
        self._keys: dict[str, Any] = {}  # kid → PyJWK
        self._fetched_at = float("-inf")
        self._lock = threading.Lock()
        self.fetches = 0

    def problem(self, token: str) -> str:
        """Why `token` is not a current token of our audience signed by the API server ("" when it is)."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            return "not a JSON Web Token"
        kid = header.get("kid", "")
        key = self._key(kid if isinstance(kid, str) else "")
        if key is None:
            return f"signed by a key the API server does not publish (kid {str(kid)[:40]!r})"
        try:
            jwt.decode(token, key.key, algorithms=list(ALGORITHMS), audience=self._audience, leeway=CLOCK_SKEW_S,
                       options={"require": ["exp", "aud"]})
        except jwt.ExpiredSignatureError:
            return "it has expired"
        except jwt.InvalidAudienceError:
            return f"not valid for audience {self._audience}"
        except jwt.InvalidSignatureError:
            return "its signature does not verify against the API server's keys"
        except jwt.PyJWTError as error:
            return f"not a valid ServiceAccount token ({error})"
        return ""

    def _key(self, kid: str) -> Any:
        with self._lock:
            if kid not in self._keys and self._now() - self._fetched_at >= self._refetch_interval_s:
                self._fetch()
            if not kid and len(self._keys) == 1:  # a single-key issuer may leave kid out
                return next(iter(self._keys.values()))
            return self._keys.get(kid)

    def _fetch(self) -> None:
        try:
            body = self._api.get(JWKS_PATH, accept=JWKS_MEDIA_TYPE)
        except KubeAPIUnavailable as error:
            hint = (" (the node agent's ServiceAccount needs get on the nonResourceURL /openid/v1/jwks)"
                    if error.status == 403 else "")
            raise AuthUnavailable(f"cannot fetch the API server's token signing keys: {error}{hint}") from None
        self._fetched_at = self._now()
        self.fetches += 1
        keys = {}
        for entry in body.get("keys", []) if isinstance(body, dict) else []:
            try:
                key = jwt.PyJWK.from_dict(entry)
            except (jwt.PyJWTError, ValueError, TypeError, KeyError):
                continue  # a key type this library cannot use signs no token we could accept
            keys[str(entry.get("kid", ""))] = key
        self._keys = keys
