"""Superseded: the one-GPU check is `bench/device_check.py` (issue 19, item 6); this forwards to it.

    python bench/gpu_check.py [--out gpu_check.json]   # = python bench/device_check.py --out ...

What this script used to measure — NVML identity and the energy counter, a GEMM, a memory-bound op
and the copy kernel on k blocks, alone and together, beside the simulator — is now the device
check's `nvml`, `interference` and `profiler` sections, done properly (the op inside a copy long
enough to cover it, the SMs the blocks got, clocks read inside the window, cuda:0 found in NVML by
UUID, NOT_SUPPORTED reads recorded). Like the device check it never changes clocks: the old
`--allow-clock-control` is refused (locked-clock measurements are the profiler's job:
`kareus profile --backend nvml`). Exit codes are the device check's (2: no GPU, one line).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REFUSED_EXIT = 1


def _device_check():
    path = Path(__file__).resolve().parent / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON record path (default gpu_check.json)")
    parser.add_argument("--allow-clock-control", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nvml-module", default="pynvml", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.allow_clock_control:
        print("gpu_check: --allow-clock-control was removed: the device check never changes clocks; "
              "measure at locked clocks with `kareus profile --backend nvml`", file=sys.stderr)
        return REFUSED_EXIT
    return _device_check().main(["--out", args.out, "--nvml-module", args.nvml_module])


if __name__ == "__main__":
    sys.exit(main())
