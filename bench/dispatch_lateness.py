"""How late the runtime's clock dispatcher sends while the training thread is busy launching.

A training rank's main thread launches kernels in a Python loop and holds the GIL nearly all the
time; the `ClockDispatcher`'s helper thread must take the GIL back to send a clock request. This
bench runs that situation on the CPU: a stand-in device whose instructions run back to back for
`--instruction-ms` each (a marker is reached at its instruction's boundary: `wait()` sleeps until
then, GIL released, as a blocking CUDA event does), a main thread that spins launching tiny torch
ops and never sleeps, and requests submitted as `PlanFollower` submits them:

- `end`: nothing measured yet, so the next clock goes out when the GPU reaches the end marker;
- `lead`: the instruction's duration is known, so it goes out `--lead-ms` before the expected end.

Lateness = when the request was sent (the dispatcher's `on_sent` time) minus when it was due (the
end marker's time, or the lead point). Negative: early. Each mode runs with the dispatcher's
lowered GIL switch interval and with the interpreter's own (`sys.getswitchinterval()`, 5 ms by
default). `--clocking FILE` measures another version of `kareus/runtime/clocking.py` the same way.

    python bench/dispatch_lateness.py [--instructions 100] [--instruction-ms 20] [--lead-ms 5] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from kareus.daemon_client import RecordingClockClient


def load_clocking(path: str | None):
    if path is None:
        from kareus.runtime import clocking

        return clocking
    spec = importlib.util.spec_from_file_location("clocking_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def timed_marker_class(clocking):
    class TimedMarker(clocking.Marker):
        """Reached at monotonic time `at_s` (the stand-in device's instruction boundary)."""

        def __init__(self, at_s: float) -> None:
            self.at_s = at_s

        def reached(self) -> bool:
            return time.monotonic() >= self.at_s

        def wait(self) -> None:
            time.sleep(max(0.0, self.at_s - time.monotonic()))

        def elapsed_s(self, earlier) -> float:
            return self.at_s - earlier.at_s

    return TimedMarker


def busy_launch_loop(stop: threading.Event) -> int:
    """The training thread: tiny ops back to back, never sleeping (holds the GIL between them)."""
    x = torch.zeros(64)
    launches = 0
    while not stop.is_set():
        x.add_(1.0)
        launches += 1
    return launches


def measure(clocking, mode: str, switch: str, instructions: int, instruction_s: float, lead_s: float) -> dict:
    marker = timed_marker_class(clocking)
    sent: list[float] = []
    kwargs = {}
    if switch == "interpreter" and hasattr(clocking, "SWITCH_INTERVAL_S"):
        kwargs["switch_interval_s"] = None
    dispatcher = clocking.ClockDispatcher(RecordingClockClient(), clocking.HostProgress(), lead_s=lead_s,
                                          on_sent=lambda label, mhz, at: sent.append(at), **kwargs)
    dispatcher.progress = _Asynchronous()  # a device that runs behind the CPU, as a GPU does
    start_s = time.monotonic() + 0.05
    due: list[float] = []
    for i in range(instructions):
        begin, end = marker(start_s + i * instruction_s), marker(start_s + (i + 1) * instruction_s)
        if mode == "lead":
            dispatcher.submit(f"F{i + 1}", 1200, anchor=begin, end=end, expected_s=instruction_s)
            due.append(begin.at_s + clocking.send_delay_s(instruction_s, lead_s))
        else:
            dispatcher.submit(f"F{i + 1}", 1200, anchor=begin, end=end)
            due.append(end.at_s)
    stop = threading.Event()
    threading.Timer(start_s + instructions * instruction_s + 0.05 - time.monotonic(), stop.set).start()
    busy_launch_loop(stop)
    dispatcher.close()
    late_ms = [1000.0 * (s - d) for s, d in zip(sent, due, strict=True)]
    ordered = sorted(late_ms)
    return {"mode": mode, "switch_interval": switch, "requests": len(late_ms),
            "p50_ms": round(statistics.median(ordered), 3), "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
            "max_ms": round(ordered[-1], 3), "min_ms": round(ordered[0], 3)}


class _Asynchronous:
    """Progress flags only: `synchronous = False` sends through the helper thread."""

    synchronous = False

    def enter_thread(self) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instructions", type=int, default=100)
    parser.add_argument("--instruction-ms", type=float, default=20.0)
    parser.add_argument("--lead-ms", type=float, default=5.0)
    parser.add_argument("--clocking", help="a clocking.py to measure instead of the project's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    clocking = load_clocking(args.clocking)
    # A clocking module that cannot lower the switch interval runs with the interpreter's only.
    switches = ("dispatcher", "interpreter") if hasattr(clocking, "SWITCH_INTERVAL_S") else ("interpreter",)
    rows = [measure(clocking, mode, switch, args.instructions, args.instruction_ms / 1000, args.lead_ms / 1000)
            for mode in ("end", "lead") for switch in switches]
    if args.json:
        json.dump({"interpreter_switch_interval_ms": 1000 * sys.getswitchinterval(),
                   "load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "rows": rows}, sys.stdout)
        print()
        return 0
    # Lateness on a loaded machine is mostly the OS's: say how loaded it was.
    print(f"interpreter switch interval {1000 * sys.getswitchinterval():.1f} ms; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"clocking: {Path(args.clocking) if args.clocking else 'kareus.runtime.clocking'}")
    for row in rows:
        print(f"{row['mode']:>4} send, {row['switch_interval']:>11} switch interval: lateness p50 {row['p50_ms']:7.3f} ms"
              f"  p99 {row['p99_ms']:7.3f} ms  max {row['max_ms']:7.3f} ms  (min {row['min_ms']:.3f}, "
              f"{row['requests']} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
