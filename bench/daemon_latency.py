"""Round-trip latency and throughput of clock requests to `kareus-node`, against a bare echo server.

Both servers run as separate processes on the same kind of socket (Unix stream) with the same
length-prefixed framing, and the same client code sends the same `lock` message to each, side by
side in one run. The echo server only reads a frame and writes it back, so the ratio of the two
is the daemon's own cost: decoding, validation, authorisation, the lease check and handing the
clock to the GPU worker (simulated backend).

Measured: p50/p99 round trip of one request at a time (the runtime's pattern: a clock request per
pipeline instruction), requests/s for that sequential pattern, and requests/s when a burst is
pipelined (sent without waiting, acks read afterwards — what `DaemonClockClient` does).

    python bench/daemon_latency.py [--requests 5000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kareus.daemon_client import DaemonConnection, protocol
from kareus.gpu import sim_uuid

CLOCKS_MHZ = (1200, 1185)  # alternate, so every request is a real change for the worker


def _echo_server(path: str) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(protocol.HEADER.size)
                body = await reader.readexactly(protocol.frame_length(header))
                writer.write(header + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(echo, path=path)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _wait_for_socket(path: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no socket at {path} after {timeout_s} s")
        time.sleep(0.05)


def _sequential(connection: DaemonConnection, gpu: str, count: int) -> list[float]:
    """Seconds per round trip of `count` clock requests, one at a time."""
    latencies = []
    for i in range(count):
        started = time.perf_counter()
        connection.send("lock", gpus=[gpu], clock_mhz=CLOCKS_MHZ[i % 2], wait=False)
        reply = connection.receive()
        latencies.append(time.perf_counter() - started)
        if "error" in reply:
            raise SystemExit(f"request refused: {reply['error']}")
    return latencies


def _pipelined(connection: DaemonConnection, gpu: str, count: int, burst: int = 200) -> float:
    """Requests/s when bursts of `burst` requests are sent before their acks are read."""
    started = time.perf_counter()
    for start in range(0, count, burst):
        size = min(burst, count - start)
        for i in range(size):
            connection.send("lock", gpus=[gpu], clock_mhz=CLOCKS_MHZ[i % 2], wait=False)
        for _ in range(size):
            connection.receive()
    return count / (time.perf_counter() - started)


def _measure(paths: dict[str, str], gpu: str, count: int, rounds: int = 10) -> dict[str, dict[str, float]]:
    """Both servers measured in alternating blocks, so background load hits them alike."""
    latencies: dict[str, list[float]] = {name: [] for name in paths}
    pipelined: dict[str, list[float]] = {name: [] for name in paths}
    connections = {name: DaemonConnection(path) for name, path in paths.items()}
    try:
        for connection in connections.values():
            _sequential(connection, gpu, min(500, count))  # warm up
        for _ in range(rounds):
            for name, connection in connections.items():
                latencies[name] += _sequential(connection, gpu, count // rounds)
                pipelined[name].append(_pipelined(connection, gpu, count // rounds))
    finally:
        for connection in connections.values():
            connection.close()
    results = {}
    for name, values in latencies.items():
        ordered = sorted(values)
        results[name] = {
            "p50_us": ordered[len(ordered) // 2] * 1e6,
            "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
            "mean_us": statistics.fmean(ordered) * 1e6,
            "sequential_rps": len(ordered) / sum(ordered),
            "pipelined_rps": statistics.median(pipelined[name]),
        }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        daemon_socket, echo_socket = f"{tmp}/node.sock", f"{tmp}/echo.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kareus_node.main", "--backend", "sim", "--sim-gpus", "1", "--standalone",
             "--socket", daemon_socket, "--state-dir", f"{tmp}/state", "--metrics-port", "0",
             "--metrics-address", "127.0.0.1", "--node-name", "bench", "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL)
        echo = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(echo_socket,), daemon=True)
        echo.start()
        try:
            _wait_for_socket(daemon_socket)
            _wait_for_socket(echo_socket)
            gpu = sim_uuid("bench", "A100-SXM4-40GB", 0)
            results = _measure({"echo": echo_socket, "daemon": daemon_socket}, gpu, args.requests)
        finally:
            daemon.terminate()
            daemon.wait(10)
            echo.terminate()
            echo.join(10)
    ratios = {key: results["daemon"][key] / results["echo"][key] for key in ("p50_us", "p99_us", "sequential_rps", "pipelined_rps")}
    if args.json:
        print(json.dumps({"requests": args.requests, **results, "daemon_over_echo": ratios}, indent=2))
        return 0
    print(f"clock requests over a Unix socket, {args.requests} each (simulated GPU backend)")
    print(f"{'':10}{'p50 µs':>10}{'p99 µs':>10}{'seq req/s':>12}{'pipelined req/s':>18}")
    for name in ("echo", "daemon"):
        r = results[name]
        print(f"{name:10}{r['p50_us']:10.1f}{r['p99_us']:10.1f}{r['sequential_rps']:12.0f}{r['pipelined_rps']:18.0f}")
    print(f"{'ratio':10}{ratios['p50_us']:10.2f}{ratios['p99_us']:10.2f}{ratios['sequential_rps']:12.2f}{ratios['pipelined_rps']:18.2f}")
    daemon_p99_ms = results["daemon"]["p99_us"] / 1e3
    print(f"daemon: p99 {daemon_p99_ms:.3f} ms (target < 1 ms), {results['daemon']['sequential_rps']:.0f} req/s "
          f"sequential (target > 5000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
