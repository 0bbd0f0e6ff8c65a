"""The operator's probe endpoints against the real API server, and against one that is gone."""

from __future__ import annotations

import dataclasses
import socket

import aiohttp
from kareus_operator import health
from kareus_operator.kube import Kube, load_kubeconfig


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _status(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_liveness_answers_from_the_loop_and_readiness_needs_the_api(control_plane):
    credentials = load_kubeconfig(control_plane.admin.kubeconfig)
    gone = dataclasses.replace(credentials, server=f"https://127.0.0.1:{_free_port()}")  # nothing listens there
    for creds, ready in ((credentials, 200), (gone, 503)):
        async with Kube(creds) as kube:
            port = _free_port()
            runner = await health.serve(kube, "127.0.0.1", port)
            try:
                assert await _status(f"http://127.0.0.1:{port}/healthz") == (200, "ok")
                status, text = await _status(f"http://127.0.0.1:{port}/readyz")
                assert status == ready, text
                if ready == 503:
                    assert "the API server is not reachable" in text
            finally:
                await runner.cleanup()
