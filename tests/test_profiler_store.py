"""The profile store: append-only log, torn lines, and resuming a killed profiling run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kareus.errors import KareusError
from kareus.profiler import ProfileStore, profile_job, profile_key
from kareus.profiler.backends import SimBackend
from kareus.spec import load_job

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

# Profiles the quickstart job slowly (5 ms per candidate) so the test can kill it mid-run.
SLOW_PROFILE = """
import sys, time
from kareus.profiler import profile_job
from kareus.profiler.backends import SimBackend
from kareus.spec import load_job

class Slow(SimBackend):
    def measure_partitions(self, ptype, candidates):
        out = []
        for c in candidates:
            time.sleep(0.005)
            out.extend(super().measure_partitions(ptype, [c]))
        return out

profile_job(load_job(sys.argv[1]), backend=Slow("A100-SXM4-40GB"), store_path=sys.argv[2])
"""


class Counting(SimBackend):
    """The simulated GPU, remembering every candidate it was asked to measure."""

    def __init__(self) -> None:
        super().__init__("A100-SXM4-40GB")
        self.asked: list[tuple[str, int, int, str]] = []
        self.work_asked = 0

    def measure_partitions(self, ptype, candidates):
        self.asked.extend((ptype.name, c.clock_mhz, c.comm_sms, c.launch_slot) for c in candidates)
        return super().measure_partitions(ptype, candidates)

    def measure_work(self, what, stage, direction, clock_mhz):
        self.work_asked += 1
        return super().measure_work(what, stage, direction, clock_mhz)


def _partition_lines(path: Path) -> int:
    return path.read_text().count('"kind":"partition"') if path.exists() else 0


def test_killed_run_resumes_without_measuring_anything_twice(tmp_path):
    job = load_job(QUICKSTART)
    log = tmp_path / f"{profile_key(job)}.jsonl"
    child = subprocess.Popen([sys.executable, "-c", SLOW_PROFILE, str(QUICKSTART), str(tmp_path)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while _partition_lines(log) < 120 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None, "the profiling run ended before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    before = ProfileStore(tmp_path, profile_key(job))
    assert before.loaded >= 120

    backend = Counting()
    resumed = profile_job(job, backend=backend, store_path=tmp_path)
    assert backend.asked, "the killed run cannot have finished everything"
    assert not set(backend.asked) & set(before.partitions), "a stored candidate was measured again"
    assert len(backend.asked) == len(set(backend.asked))

    fresh_backend = Counting()
    fresh = profile_job(job, backend=fresh_backend)  # no store: the same search from scratch
    assert resumed.partitions == fresh.partitions  # resuming changes nothing about the result
    assert len(fresh_backend.asked) == len(backend.asked) + len(before.partitions)

    again = Counting()
    profile_job(job, backend=again, store_path=tmp_path)
    assert again.asked == [] and again.work_asked == 0  # a later job with the same key reuses everything


def test_torn_last_line_is_dropped_and_the_log_stays_appendable(tmp_path):
    store = ProfileStore(tmp_path, "k")
    store.add_partition(("fwd_mlp", 1410, 3, "norm_0"), 1e-3, 0.3)
    store.close()
    log = tmp_path / "k.jsonl"
    with log.open("a") as raw:
        raw.write('{"kind":"partition","type":"fwd_mlp","clock')  # killed mid-write
    reopened = ProfileStore(tmp_path, "k")
    assert reopened.partitions == {("fwd_mlp", 1410, 3, "norm_0"): (1e-3, 0.3)}
    reopened.add_work(("sequential", 0, "forward", 1410), 2e-3, 0.5)
    reopened.close()
    again = ProfileStore(tmp_path, "k")
    assert again.work == {("sequential", 0, "forward", 1410): (2e-3, 0.5)}
    assert again.loaded == 2


def test_store_refuses_another_keys_log_and_names_a_corrupt_line(tmp_path):
    ProfileStore(tmp_path, "k").close()
    (tmp_path / "k.jsonl").rename(tmp_path / "other.jsonl")
    with pytest.raises(KareusError, match="belongs to key 'k'"):
        ProfileStore(tmp_path, "other")
    (tmp_path / "bad.jsonl").write_text('{"kind":"header","key":"bad"}\nnot json\n')
    with pytest.raises(KareusError, match=r"bad.jsonl:2"):
        ProfileStore(tmp_path, "bad")
