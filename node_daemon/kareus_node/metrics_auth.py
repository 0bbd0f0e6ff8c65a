"""`--metrics-auth tokenreview`: who may scrape `/metrics`, decided the way kube-rbac-proxy does.

The scraper sends its ServiceAccount token as a bearer token; a TokenReview says whose it is and a
SubjectAccessReview whether that user may `get` the non-resource URL `/metrics` (the chart binds
the `kareus-node-metrics-reader` ClusterRole to the Prometheus ServiceAccount it is told about).
Answers, yes and no, are kept for `cache_s` by the token's hash, so a scraper costs the API
server two requests a minute, and a flood of requests with one bad token costs it two in all.
Distinct made-up tokens are bounded by the HTTP server's connection cap, not by this cache.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

from kareus_node.kubeapi import KubeAPI, KubeAPIUnavailable

TOKEN_REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEW_PATH = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
MAX_CACHED = 1024


class MetricsAuthorizer:
    """`__call__(authorization_header)` → "" when the caller may read /metrics, else why not."""

    def __init__(self, api: KubeAPI, *, cache_s: float = 60.0) -> None:
        self._api = api
        self._cache_s = cache_s
        self._answers: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.reviews = 0

    def __call__(self, authorization: str) -> str:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "metrics need a bearer token (Authorization: Bearer <ServiceAccount token>)"
        key = hashlib.sha256(token.strip().encode()).hexdigest()
        with self._lock:
            hit = self._answers.get(key)
            if hit is not None and time.monotonic() < hit[1]:
                return hit[0]
        try:
            answer = self._decide(token.strip())
        except KubeAPIUnavailable as error:
            return f"cannot review the bearer token (failing closed): {error}"  # not cached: may pass soon
        with self._lock:
            self._answers[key] = (answer, time.monotonic() + self._cache_s)
            while len(self._answers) > MAX_CACHED:
                self._answers.popitem(last=False)
        return answer

    def _decide(self, token: str) -> str:
        self.reviews += 1
        review = self._api.post(TOKEN_REVIEW_PATH, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                                    "spec": {"token": token}})
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return "bearer token refused by the API server's TokenReview"
        user = status.get("user") or {}
        access = self._api.post(ACCESS_REVIEW_PATH, {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user.get("username", ""), "groups": user.get("groups") or [],
                     "uid": user.get("uid", ""), "nonResourceAttributes": {"path": "/metrics", "verb": "get"}}})
        if not (access.get("status") or {}).get("allowed"):
            return f"{user.get('username', 'this user')} may not get /metrics (RBAC)"
        return ""
