"""Prometheus metrics and health endpoints of the node daemon.

GPU metrics are read from the devices at scrape time by a collector, so a series always shows
the GPU's state now and its owner labels (`namespace`, `pod`, `kareusjob`; empty when no lease)
can never go stale. Request counters and the latency histogram are ordinary instruments updated by
the server. Everything lives in the daemon's own registry, not prometheus-client's global one.

`/metrics` serves the registry, `/healthz` says the event loop is alive, `/readyz` says the
socket is being served and authorisation facts can be established (fail closed otherwise).

The HTTP servers are bounded: at most `max_connections` connections are served at once (one
thread each; more are closed at accept), and a connection that does not complete its request
within `timeout_s` is dropped, so idle sockets cannot pile up threads. The kubelet's probes go to a
second server of their own on localhost (`--health-port`), which nobody off the node can reach or
fill. `/metrics` may require a bearer token (`authorize`, e.g. `metrics_auth.MetricsAuthorizer`):
it names every GPU's pod, job and power, which is not every tenant's business.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kareus import metric_names as names

GPU_LABELS = ("gpu_uuid", "node", "namespace", "pod", "kareusjob")
LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1.0, 5.0)
HEARTBEAT_STALE_S = 10.0


class GPUCollector:
    """Reads every GPU of a daemon when scraped."""

    def __init__(self, daemon: Any) -> None:
        self._daemon = daemon

    def collect(self) -> Iterator[Any]:
        families = {
            "power": GaugeMetricFamily(names.GPU_POWER_WATTS, "GPU power draw in watts", labels=GPU_LABELS),
            "energy": CounterMetricFamily(names.GPU_ENERGY_JOULES_TOTAL, "GPU energy counter in joules", labels=GPU_LABELS),
            "clock": GaugeMetricFamily(names.GPU_SM_CLOCK_HERTZ, "Current SM clock in hertz", labels=GPU_LABELS),
            "locked": GaugeMetricFamily(names.GPU_LOCKED_CLOCK_HERTZ, "SM clock lock set by Kareus in hertz, 0 when not locked", labels=GPU_LABELS),
            "changes": CounterMetricFamily(names.GPU_CLOCK_CHANGES_TOTAL, "SM clock locks and resets applied by the daemon", labels=GPU_LABELS),
            "limit": GaugeMetricFamily(names.GPU_POWER_LIMIT_WATTS, "Board power limit in force in watts (the default unless Kareus set one)", labels=GPU_LABELS),
        }
        daemon = self._daemon
        for uuid, gpu in daemon.gpus.items():
            lease = daemon.leases.get(uuid)
            owner = lease.owner if lease else None
            labels = [uuid, daemon.node_name, owner.namespace if owner else "", owner.pod if owner else "", owner.job if owner else ""]
            try:
                locked = gpu.locked_clock_mhz()
                families["power"].add_metric(labels, gpu.power_w())
                families["energy"].add_metric(labels, gpu.energy_j())
                families["clock"].add_metric(labels, gpu.sm_clock_mhz() * 1e6)
                families["locked"].add_metric(labels, (locked or 0) * 1e6)
            except Exception:  # an unreadable GPU is left out of this scrape, not fatal to it
                continue
            worker = daemon.workers.get(uuid)
            families["changes"].add_metric(labels, worker.clock_changes if worker else 0)
            with contextlib.suppress(Exception):  # a board without power limits still has its other series
                families["limit"].add_metric(labels, gpu.power_limit_w())
        yield from families.values()


class DaemonMetrics:
    """The registry plus the request instruments; `observe` is the server's metrics hook."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(names.DAEMON_REQUESTS_TOTAL.removesuffix("_total"), "Requests by result",
                                ["result"], registry=self.registry)
        self.latency = Histogram(names.DAEMON_REQUEST_SECONDS, "Time to handle one request in seconds",
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.heartbeat_s = time.monotonic()

    def observe(self, result: str, seconds: float) -> None:
        self.requests.labels(result).inc()
        if seconds > 0:
            self.latency.observe(seconds)

    def watch(self, daemon: Any) -> None:
        self.registry.register(GPUCollector(daemon))

    def beat(self) -> None:
        self.heartbeat_s = time.monotonic()


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, but at most `max_connections` of them; the surplus is closed at accept."""

    daemon_threads = True
    request_queue_size = 128  # a full accept queue would leave the surplus waiting instead of closed

    def __init__(self, address: tuple[str, int], handler: type, *, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.turned_away = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.turned_away += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_http(address: str, port: int, metrics: DaemonMetrics, ready: Callable[[], bool], *,
               max_connections: int = 16, timeout_s: float = 5.0,
               authorize: Callable[[str], str] | None = None, paths: tuple[str, ...] = ("/metrics", "/healthz", "/readyz"),
               ) -> ThreadingHTTPServer:
    """Start `paths` (of /metrics, /healthz, /readyz) on (address, port) in a thread; port 0 picks a
    free one. `authorize(authorization_header)` says why a /metrics request is refused ("": allowed)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # per socket operation: a request that stalls is dropped

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in paths:
                self._send(404, b"not found\n")
            elif path == "/metrics":
                refusal = authorize(self.headers.get("Authorization", "")) if authorize else ""
                if refusal:
                    self._send(401 if "token" in refusal else 403, refusal.encode() + b"\n")
                else:
                    self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                alive = time.monotonic() - metrics.heartbeat_s < HEARTBEAT_STALE_S
                self._send(200 if alive else 503, b"ok\n" if alive else b"event loop stalled\n")
            elif path == "/readyz":
                is_ready = ready()
                self._send(200 if is_ready else 503, b"ready\n" if is_ready else b"not ready\n")
            else:
                self._send(404, b"not found\n")

        def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:  # scrapes are not worth a log line each
            pass

    server = BoundedHTTPServer((address, port), Handler, max_connections=max_connections)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
