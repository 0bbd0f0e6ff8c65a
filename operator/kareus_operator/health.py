"""The operator's health endpoints, for the kubelet's probes.

- `/healthz` (liveness) answers from the operator's event loop: a loop stuck in a handler stops answering
  and the pod is restarted.
- `/readyz` (readiness) also asks the API server for its version, with a short timeout: a replica that
  cannot reach the API is not ready. A standby replica waiting for the leader Lease is ready: it is what
  takes over when the leader goes.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kareus_operator.kube import ApiError, Kube

API_TIMEOUT_S = 3.0


async def serve(kube: Kube, address: str, port: int) -> web.AppRunner:
    """Start the endpoints on `address:port`; the runner stops them (`await runner.cleanup()`)."""

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(kube.get("/version"), API_TIMEOUT_S)
        except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as error:
            return web.Response(status=503, text=f"the API server is not reachable: {error or type(error).__name__}")
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, address, port).start()
    return runner
