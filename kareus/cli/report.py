"""`kareus report --prometheus URL JOB`: a KareusJob's GPU power and energy over time, as one HTML page.

The series are the node agents' (`kareus_gpu_power_watts`, `kareus_gpu_energy_joules_total`,
labelled with the owning job), read from a Prometheus that scrapes Kareus — `kareus dev-cluster`
prints the URL of its own. The page is self-contained (the chart is embedded), like `kareus run`'s
report.html.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from kareus.errors import KareusError

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="a cluster job's power and energy over time, from Prometheus",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", metavar="JOB", help="the KareusJob's name")
    parser.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--namespace", "-n", default="default", help="the job's namespace (default: default)")
    parser.add_argument("--since", default="6h", help="how far back to look for the job (e.g. 30m, 6h, 2d; default 6h)")
    parser.add_argument("--step", type=float, default=2.0, metavar="S", help="resolution in seconds (default 2)")
    parser.add_argument("--out", type=Path, help="where to write the page (default: report-<JOB>.html)")
    parser.set_defaults(func=run)


def duration_s(text: str) -> float:
    match = _DURATION.match(text)
    if match is None:
        raise KareusError(f"--since: expected a duration like 30m, 6h or 2d, got {text!r}")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def run(args: argparse.Namespace) -> int:
    from kareus.report import job_energy_series, quantity, render_job_report

    if args.step <= 0:
        raise KareusError(f"--step: must be > 0, got {args.step}")
    end_s = time.time()
    series = job_energy_series(args.prometheus, args.namespace, args.job, start_s=end_s - duration_s(args.since),
                               end_s=end_s, step_s=args.step)
    out = args.out or Path(f"report-{args.job}.html")
    out.write_text(render_job_report(series), encoding="utf-8")
    print(f"{args.namespace}/{args.job}: {quantity(series.total_energy_j, 'J')} over "
          f"{quantity(series.duration_s, 's')} on {series.gpus} GPUs; wrote {out}")
    return 0
