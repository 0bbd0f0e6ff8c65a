"""The report's numbers: units chosen by magnitude, a clock colour bar with a sensible span, and the
job's power and energy over time read from Prometheus (`kareus report --prometheus URL JOB`).

Prometheus is played by a local HTTP server that answers `/api/v1/query_range` as Prometheus does
(the live cluster test reads a real one); the energy is the rise of each GPU's counter while the
job owned it, summed over the job's GPUs.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kareus.errors import KareusError
from kareus.report import clock_range_mhz, job_energy_series, quantity, render_job_report, scaled


@pytest.mark.parametrize(("value", "unit", "text"), [
    (0.794, "J", "794 mJ"),  # what used to read 0.000794 kJ
    (1.3594, "J", "1.359 J"),
    (16380.0, "J", "16.38 kJ"),
    (4.2e7, "J", "42 MJ"),
    (0.0037058, "s", "3.706 ms"),
    (3.21, "s", "3.21 s"),
    (0.0, "J", "0 J"),
    (None, "J", "—"),
])
def test_quantities_take_the_prefix_their_magnitude_calls_for(value, unit, text):
    assert quantity(value, unit) == text


def test_scaled_keeps_the_sign_and_the_value():
    number, label = scaled(-2500.0, "W")
    assert (number, label) == (-2.5, "kW")


@pytest.mark.parametrize(("clocks", "span"), [([1410], (1310.0, 1510.0)), ([1405, 1410], (1307.5, 1507.5)),
                                              ([900, 1410], (900, 1410))])
def test_the_clock_colour_bar_spans_at_least_200_mhz(clocks, span):
    assert clock_range_mhz(clocks) == span


class FakePrometheus:
    """Answers query_range for the job's power sum and per-GPU energy counters."""

    def __init__(self, matrices: dict[str, list[dict]]) -> None:
        self.matrices, self.queries = matrices, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                params = dict(urllib.parse.parse_qsl(url.query))
                outer.queries.append(params)
                key = "power" if "kareus_gpu_power_watts" in params.get("query", "") else "energy"
                body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": outer.matrices[key]}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def gpu(uuid: str, points: list[tuple[float, float]]) -> dict:
    return {"metric": {"gpu_uuid": uuid, "namespace": "obs", "kareusjob": "quickstart"},
            "values": [[t, str(v)] for t, v in points]}


@pytest.fixture
def prometheus():
    # Two GPUs at 100 W and 200 W; the second is owned from t=1002 only.
    fake = FakePrometheus({
        "power": [{"metric": {}, "values": [[1000 + 2 * i, str(p)] for i, p in enumerate([100, 300, 300, 300])]}],
        "energy": [gpu("GPU-a", [(1000, 5000), (1002, 5200), (1004, 5400), (1006, 5600)]),
                   gpu("GPU-b", [(1002, 900), (1004, 1300), (1006, 1700)])],
    })
    yield fake
    fake.close()


def test_the_jobs_energy_is_the_rise_of_its_gpus_counters(prometheus):
    series = job_energy_series(prometheus.url, "obs", "quickstart", start_s=990, end_s=1010, step_s=2)
    assert series.time_s == (1000, 1002, 1004, 1006)
    assert series.power_w == (100, 300, 300, 300)
    assert series.energy_j == (0, 200, 400 + 400, 600 + 800)
    assert series.gpus == 2 and series.total_energy_j == 1400 and series.duration_s == 6
    asked = {q["query"] for q in prometheus.queries}
    assert asked == {'sum(kareus_gpu_power_watts{namespace="obs",kareusjob="quickstart"})',
                     'kareus_gpu_energy_joules_total{namespace="obs",kareusjob="quickstart"}'}
    page = render_job_report(series)
    assert "1.4 kJ" in page and "data:image/png;base64," in page and "obs/quickstart" in page


def test_kareus_report_writes_the_page(prometheus, tmp_path, capsys):
    from kareus.cli import main

    out = tmp_path / "r.html"
    assert main(["report", "quickstart", "-n", "obs", "--prometheus", prometheus.url, "--out", str(out)]) == 0
    assert "Power and energy over time" in out.read_text()
    assert "obs/quickstart: 1.4 kJ over 6 s on 2 GPUs" in capsys.readouterr().out


def test_a_job_without_series_is_one_clear_error(tmp_path):
    empty = FakePrometheus({"power": [], "energy": []})
    try:
        with pytest.raises(KareusError, match="no GPU series of KareusJob obs/missing"):
            job_energy_series(empty.url, "obs", "missing", start_s=0, end_s=10)
    finally:
        empty.close()
