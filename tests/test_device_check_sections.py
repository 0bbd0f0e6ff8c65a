"""The pure parts of `bench/device_check.py`, on CPU: the section runner (error capture, skips,
budgets on a fake clock), the JSON schema and table, the interference-matrix bookkeeping with a
fake timer, clock-landing rows, NVML windows against the fake pynvml (read-only), and the loader
that runs a project module on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests.fakes import fake_pynvml

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "device_check.py"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the section runner ---------------------------------------------------------------------------
def test_a_failing_section_is_recorded_and_the_others_still_run(dc):
    clock, said = FakeClock(), []

    def slow(budget):
        clock.now += 7.0
        return {"summary": "fine", "left_s": budget.left_s()}

    def crash(budget):
        raise RuntimeError("boom")

    def skip(budget):
        raise dc.Skip("no NCCL")

    sections = [dc.Section("a", 5, slow), dc.Section("b", 5, crash), dc.Section("c", 5, skip),
                dc.Section("d", 5, lambda b: 1)]
    records, unusable = dc.run_sections(sections, clock=clock, announce=said.append)
    assert [r["status"] for r in records.values()] == ["ok", "error", "skipped", "ok"]
    assert records["a"]["result"]["left_s"] == -2.0 and records["a"]["over_budget"] is True
    assert records["a"]["elapsed_s"] == 7.0 and records["d"]["over_budget"] is False
    assert records["b"]["error"] == "RuntimeError: boom" and any("boom" in line for line in records["b"]["traceback"])
    assert records["c"]["reason"] == "no NCCL"
    assert unusable is None
    assert said == [f"device_check: {name} (budget 5 s)" for name in "abcd"]


def test_sections_the_total_budget_cannot_cover_are_skipped(dc):
    clock = FakeClock()

    def spend(budget):
        clock.now += 8.0

    sections = [dc.Section("a", 5, spend), dc.Section("b", 5, spend), dc.Section("c", 1, spend)]
    records, _ = dc.run_sections(sections, total_budget_s=10, clock=clock, announce=lambda _: None)
    assert records["a"]["status"] == "ok"
    assert records["b"] == {"budget_s": 5, "status": "skipped", "reason": "total budget: 2 s left of 10 s"}
    assert records["c"]["status"] == "ok"  # a smaller budget still fits


def test_a_section_that_breaks_the_device_skips_the_rest_and_makes_the_json_unusable(dc):
    def crash(budget):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    sections = [dc.Section("a", 5, crash), dc.Section("b", 5, lambda b: 1)]
    records, unusable = dc.run_sections(sections, clock=FakeClock(), healthy=lambda: "sticky CUDA error",
                                        announce=lambda _: None)
    assert records["b"]["status"] == "skipped" and "after a: sticky CUDA error" in records["b"]["reason"]
    assert "sticky CUDA error" in unusable


def test_a_required_section_failing_makes_the_json_unusable(dc):
    def crash(budget):
        raise KeyError("gpus")

    records, unusable = dc.run_sections([dc.Section("nvml", 5, crash, required=True)], clock=FakeClock(),
                                        announce=lambda _: None)
    assert records["nvml"]["status"] == "error" and unusable.startswith("nvml failed: KeyError")


def test_the_prepared_check_fits_in_eight_minutes(dc):
    sections = dc.build_sections(None, None, {}, 2.6)
    assert [s.name for s in sections] == ["nvml", "energy_idle", "cpu_gpu_lead", "op_timings", "clock_landing",
                                          "nccl_comms", "interference", "energy_load", "cuda_smoke", "profiler"]
    assert sum(s.budget_s for s in sections) <= dc.TOTAL_BUDGET_S <= 8 * 60 - 30
    assert [s.name for s in sections if s.required] == ["nvml"]


# -- JSON and table -------------------------------------------------------------------------------
def _report(dc, sections):
    return {"schema": dc.SCHEMA, "schema_version": dc.SCHEMA_VERSION, "sections": sections}


def test_the_report_schema_and_the_table(dc, tmp_path):
    clock = FakeClock()

    def long(budget):
        clock.now += 3
        return {"summary": "x" * 500}

    records, _ = dc.run_sections([dc.Section("lead", 2, long), dc.Section("nccl", 9, lambda b: [1, 2])],
                                 clock=clock, announce=lambda _: None)
    report = _report(dc, records)
    assert dc.validate_report(report) == []
    path = tmp_path / "out.json"
    assert dc.write_report(report, str(path)) is None
    assert json.loads(path.read_text())["sections"]["nccl"]["result"] == [1, 2]
    table = dc.format_table(records, width=40)
    assert table[0].split()[:3] == ["section", "status", "s"]
    assert table[1].split()[:3] == ["lead", "ok", "3/2!"] and table[1].endswith("x" * 40)
    assert table[2].split() == ["nccl", "ok", "0/9", "[1,", "2]"]


def test_reports_consumers_cannot_use_are_named(dc, tmp_path):
    assert dc.validate_report({"sections": {}}) == [f"schema must be {dc.SCHEMA} v{dc.SCHEMA_VERSION}"]
    bad = _report(dc, {"a": {"status": "ok"}, "b": {"status": "weird"}, "c": {"status": "skipped", "reason": "r"}})
    assert dc.validate_report(bad) == ["sections.a: a ok section needs 'result'",
                                       "sections.b.status must be ok, error or skipped"]
    problem = dc.write_report(_report(dc, {}), str(tmp_path / "missing" / "out.json"))
    assert problem.startswith("could not write")


# -- the interference matrix ----------------------------------------------------------------------
class FakeTimer:
    """An op takes 1 s per rep alone and 1 + k/10 s inside a background on k blocks; a background
    takes 4 s alone and 4·(1 + 1/k) s around an op; SMs obtained = min(k, 16)."""

    def __init__(self):
        self.calls = []
        self.mechanism = {"bound": "fake grid"}

    def alone(self, op):
        self.calls.append(("alone", op))
        return FakeTimer.window(0, 10, 10)

    def background_alone(self, kind, k):
        self.calls.append(("bg", kind, k))
        return FakeTimer.window(0, 0, 1, bg=(0, 4), sms=min(k, 16))

    def op_inside(self, op, kind, k):
        self.calls.append(("inside", op, kind, k))
        per = 1 + k / 10
        return FakeTimer.window(1, 1 + 2 * per, 2, bg=(0, 2 * per), sms=min(k, 16))

    def background_inside(self, op, kind, k):
        return FakeTimer.window(0, 100, 100, bg=(10, 10 + 4 * (1 + 1 / k)))

    @staticmethod
    def window(start, end, reps, bg=(None, None), sms=None):
        import device_check

        return device_check.Window(start, end, reps, bg[0], bg[1], sms)


def test_interference_bookkeeping(dc):
    timer = FakeTimer()
    matrix = dc.interference_matrix(timer, ["gemm", "add"], ["copy", "spin"], [1, 2, 32], repeats=1)
    assert matrix["alone_s"] == {"gemm": 1.0, "add": 1.0}
    assert len(matrix["rows"]) == 2 * 3 * 2 and matrix["truncated"] is None
    row = next(r for r in matrix["rows"] if (r["op"], r["background"], r["blocks"]) == ("add", "spin", 32))
    assert row["op_slowdown"] == pytest.approx(4.2) and row["sms_obtained"] == 16
    assert row["op_covered"] == pytest.approx((2 * 4.2 - 1) / (2 * 4.2))  # the background ended before the op
    assert row["background_slowdown"] == pytest.approx(1 + 1 / 32) and row["background_covered"] == 1.0
    assert matrix["mechanism"] == {"bound": "fake grid"}


def test_interference_takes_medians_and_stops_when_the_budget_runs_low(dc):
    clock = FakeClock()
    budget = dc.Budget(10, clock)
    timer = FakeTimer()

    def spend(kind, k):
        clock.now += 4
        return FakeTimer.background_alone(timer, kind, k)

    timer.background_alone = spend
    matrix = dc.interference_matrix(timer, ["gemm"], ["copy"], [1, 2, 4, 8], budget, min_left_s=3, repeats=3)
    assert [r["blocks"] for r in matrix["rows"]] == [1]  # 3 repeats × 4 s: 2 s left before k = 2
    assert matrix["truncated"] == "budget: stopped before copy on 2 blocks"
    assert timer.calls.count(("alone", "gemm")) == 3 and timer.calls.count(("inside", "gemm", "copy", 1)) == 3
    windows = [dc.Window(0, t, 1) for t in (5.0, 1.0, 3.0)]
    assert dc.median_window(iter(windows).__next__, 3, lambda w: w.op_s).op_s == 3.0


def test_window_overlap(dc):
    assert dc.Window(0, 10, 5).overlap() is None and dc.Window(0, 10, 5).op_s == 2.0
    assert dc.Window(2, 6, 1, 0, 4).overlap() == 0.5
    assert dc.Window(2, 6, 1, 7, 9).overlap() == 0.0


# -- clock landing --------------------------------------------------------------------------------
def test_landing_rows_relate_each_request_to_its_gpu_boundary(dc):
    sent = [("i0", 1000, 10.0), ("i1", 1015, 10.995), ("old", 1, 0.0)]
    rows = dc.landing_rows(["i0", "i1", "i2"], [10.001, 11.0, 12.0], [9.0, 9.5, 9.9], sent)
    assert rows == [
        {"instruction": "i0", "landing_ms": -1.0, "cpu_ahead_ms": 1001.0},
        {"instruction": "i1", "landing_ms": -5.0, "cpu_ahead_ms": 1500.0},
        {"instruction": "i2", "landing_ms": None, "cpu_ahead_ms": 2100.0},
    ]


BLOCKED_CLOCKING = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pymoo", "xgboost", "scipy", "kopf", "kubernetes", "sklearn") \\
                or name.startswith(("kareus.runtime", "kareus.workload", "kareus.plan")):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import importlib.util
spec = importlib.util.spec_from_file_location("device_check", {str(SCRIPT)!r})
dc = importlib.util.module_from_spec(spec); sys.modules["device_check"] = dc; spec.loader.exec_module(dc)
clocking = dc.light_module("kareus/runtime/clocking.py")
client = dc.RecordingClock(clock=lambda: 7.0)
dispatcher = clocking.ClockDispatcher(client, clocking.HostProgress())
progress = clocking.HostProgress()
dispatcher.submit("stage0/forward/0", 1410, anchor=progress.mark())
dispatcher.submit("stage0/backward/0", 1200, anchor=progress.mark(), end=progress.mark(), expected_s=0.1)
print(client.requests)
print(sorted(m for m in sys.modules if m.startswith("kareus")))
"""


def test_the_dispatcher_runs_alone_without_the_runtime_package(dc):
    done = subprocess.run([sys.executable, "-c", BLOCKED_CLOCKING], capture_output=True, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    requests, modules = done.stdout.splitlines()
    assert requests == "[('stage0/forward/0', 1410, 7.0), ('stage0/backward/0', 1200, 7.0)]"
    assert "kareus.runtime" not in modules and "kareus.daemon_client" in modules


def test_only_light_project_modules_load_alone(dc, tmp_path):
    assert dc.heavy_imports(dc.REPO / "kareus/runtime/clocking.py") == []
    assert dc.heavy_imports(dc.REPO / "kareus/runtime/comm.py") == []
    assert dc.heavy_imports(dc.REPO / "kareus/runtime/trainer.py") != []
    source = tmp_path / "m.py"
    source.write_text("import os\nimport scipy.optimize\nfrom kareus.sim import Simulator\nfrom . import x\n")
    assert dc.heavy_imports(source) == ["kareus.sim", "scipy.optimize"]
    with pytest.raises(dc.Skip, match="imports"):
        dc.light_module("kareus/runtime/trainer.py")
    comm = dc.light_module("kareus/runtime/comm.py")
    assert comm.nccl_options(8).config.max_ctas == 8  # the options the NCCL section uses


# -- NVML windows, read-only ----------------------------------------------------------------------
class FakeTime:
    """A clock whose sleep lets fake-NVML energy accumulate."""

    def __init__(self):
        self.now = 0.0

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        fake_pynvml.advance(seconds)


def _nvml(dc, count=1):
    fake_pynvml.reset(count=count)
    fake_pynvml.nvmlInit()
    nvml = dc.ReadOnlyNVML(fake_pynvml)
    return nvml, nvml.nvmlDeviceGetHandleByIndex(0)


def _no_writes():
    called = {call[0] for call in fake_pynvml.calls}
    assert not {c for c in called if c.startswith(("nvmlDeviceSet", "nvmlDeviceReset"))}
    assert all(d.lock_count == 0 and d.reset_count == 0 for d in fake_pynvml.devices())


def test_power_sampling_reads_the_counter_and_the_instant_power(dc):
    nvml, handle = _nvml(dc)
    fake = FakeTime()
    result = dc.power_sampling(nvml, handle, 1.0, clock=fake.clock, sleep=fake.sleep, poll_s=0.1)
    assert result["updates"] == 10 and result["median_interval_s"] == pytest.approx(0.1)
    assert result["median_step_j"] == pytest.approx(8.5) and result["counter_power_w"] == pytest.approx(85.0)
    assert result["instant_power_w"] == 85.0 and result["sm_clock_mhz"] == [1410, 1410]
    assert "error" in result["field_values"]  # the fake names no power fields
    ticks = []
    dc.power_sampling(nvml, handle, 0.5, clock=fake.clock, sleep=fake.sleep, poll_s=0.1, tick=lambda: ticks.append(1))
    assert len(ticks) == 5  # the load is topped up at every poll
    _no_writes()


def test_power_sampling_records_what_nvml_cannot_answer(dc):
    nvml, handle = _nvml(dc)
    fake_pynvml.fail("nvmlDeviceGetPowerUsage", fake_pynvml.NVML_ERROR_NOT_SUPPORTED, times=1000)
    fake = FakeTime()
    result = dc.power_sampling(nvml, handle, 0.5, clock=fake.clock, sleep=fake.sleep, poll_s=0.1)
    assert result["instant_power_w"] is None and result["counter_power_w"] == pytest.approx(85.0)
    fake_pynvml.fail("nvmlDeviceGetTotalEnergyConsumption", fake_pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert dc.power_sampling(nvml, handle, 0.5, clock=fake.clock, sleep=fake.sleep) == {
        "error": "NVMLError_NotSupported: Not Supported"}
    _no_writes()


def test_an_energy_window_divides_the_counter_by_its_iterations_and_samples_inside(dc):
    nvml, handle = _nvml(dc)
    fake = FakeTime()
    result = dc.energy_window(nvml, handle, lambda: fake.sleep(0.25), lambda: None, 0.25, 2.5, clock=fake.clock)
    assert result["iterations"] == 10 and result["window_s"] == pytest.approx(2.5)
    assert result["energy_j"] == pytest.approx(85.0 * 0.25, abs=1e-3) and result["power_w"] == pytest.approx(85.0, 1e-3)
    assert result["sm_clock_mhz_inside"] == [1410] * 5 and len(result["instant_power_w_inside"]) == 5
    _no_writes()


def test_the_guard_refuses_every_write_the_new_sections_could_reach(dc):
    nvml, _ = _nvml(dc)
    for name in ("nvmlDeviceSetApplicationsClocks", "nvmlDeviceResetApplicationsClocks",
                 "nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetMemoryLockedClocks", "nvmlDeviceResetGpuLockedClocks"):
        with pytest.raises(PermissionError, match="read-only"):
            getattr(nvml, name)


def test_cuda_device_is_found_in_nvml_by_uuid_not_index(dc):
    nvml, _ = _nvml(dc, count=2)
    gpus = dc.inventory(nvml)["gpus"]
    second = gpus[1]["uuid"]
    assert dc.gpu_for_uuid(gpus, second.removeprefix("GPU-"))["nvml_index"] == 1
    assert dc.gpu_for_uuid(gpus, second)["nvml_index"] == 1
    assert dc.gpu_for_uuid(gpus, "GPU-not-there") is None


# -- what a hang or a kill leaves, NCCL's timeout and evidence, Triton warm-up ------------------
def test_the_report_is_on_disk_after_every_section_so_a_kill_keeps_what_ran(dc, tmp_path):
    """Fails where the JSON is written only at the end: an interrupted run leaves nothing."""
    path = tmp_path / "out.json"
    report = {**_report(dc, {}), "complete": False}
    seen = []

    def first(budget):
        return {"summary": "first"}

    def second(budget):
        seen.append(json.loads(path.read_text()))  # what a kill right now would leave
        raise KeyboardInterrupt  # a hang ended by the device command's timeout, as far as the file knows

    with pytest.raises(KeyboardInterrupt):
        dc.run_sections([dc.Section("first", 5, first), dc.Section("second", 5, second)], clock=FakeClock(),
                        announce=lambda _: None, recorded=dc.report_writer(report, str(path)))
    left = json.loads(path.read_text())
    assert left == seen[0]
    assert left["complete"] is False and list(left["sections"]) == ["first"]
    assert left["sections"]["first"]["result"] == {"summary": "first"}
    assert dc.validate_report(left) == []
    assert not (tmp_path / "out.json.partial").exists()  # written whole, then renamed


def test_the_one_rank_nccl_group_gets_a_60_second_timeout(dc):
    """Fails on NCCL's default 10-minute timeout, longer than a device command may run."""
    calls = []

    class Dist:
        def init_process_group(self, backend, **kwargs):
            calls.append((backend, kwargs))

    dc.one_rank_init(Dist(), "store", "cuda:0")
    assert calls == [("nccl", {"store": "store", "rank": 0, "world_size": 1, "device_id": "cuda:0",
                               "timeout": timedelta(seconds=60)})]
    assert dc.NCCL_TIMEOUT_S == 60


def test_one_gpu_says_the_sm_bound_cannot_be_observed_and_keeps_nccls_init_lines(dc, tmp_path):
    assert "not observable on one GPU" in dc.ONE_RANK_SM_BOUND and "INIT" in dc.ONE_RANK_SM_BOUND
    env = dc.nccl_debug_env(str(tmp_path))
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT"
    assert env["NCCL_DEBUG_FILE"].startswith(str(tmp_path))
    # What NCCL writes there (%p: one file per process), noise and all.
    (tmp_path / "nccl.4242.log").write_text(
        "host:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>\n"
        "not an NCCL line\n"
        "host:4242:4250 [0] NCCL INFO Channel 00/04 :    0\n"
        "host:4242:4250 [0] NCCL INFO ncclCommInitRankConfig comm 0x55 rank 0 nranks 1 - Init COMPLETE\n")
    lines = dc.nccl_init_lines(str(tmp_path))
    assert [line.split("NCCL INFO ")[1] for line in lines] == [
        "Bootstrap : Using eth0:10.0.0.2<0>", "Channel 00/04 :    0",
        "ncclCommInitRankConfig comm 0x55 rank 0 nranks 1 - Init COMPLETE"]
    assert dc.nccl_init_lines(str(tmp_path), limit=1) == lines[:1]
    before = dict(os.environ)
    with dc.environment(env):
        assert os.environ["NCCL_DEBUG"] == "INFO"
    assert dict(os.environ) == before


def test_every_timed_triton_specialisation_is_launched_once_first(dc):
    """Fails where the warm-up launches (1 pass, 1 iteration) differ from what is timed: Triton
    compiles the timed specialisation inside the first timed window."""
    passes = {("copy", 1): 1, ("copy", 8): 3, ("copy", 32): 3, ("spin", 1): 1 << 16, ("spin", 32): 5 << 16}
    assert dc.warm_launches(passes) == [("copy", 32, 1), ("copy", 32, 3), ("spin", 32, 1 << 16),
                                        ("spin", 32, 5 << 16)]
    # The calibration launches are timed too, so the kernel probe launches exactly those.
    assert dc.CALIBRATION_UNITS == {"copy": 1, "spin": 1 << 16}


def test_the_energy_windows_include_the_copy_and_the_spinner_alone_and_stop_at_the_budget(dc):
    windows = dc.energy_windows(["gemm", "add"], ["copy", "spin"], dc.INTERFERENCE_BLOCKS)
    assert [w.name for w in windows] == ["gemm", "add", "gemm+copy8", "add+copy8", "gemm+copy32", "add+copy32",
                                         "copy8", "copy32", "spin8", "spin32"]
    assert [w.iteration_s(0.02) for w in windows] == [0.02] * 2 + [0.08] * 8
    assert [w.name for w in dc.energy_windows(["gemm"], ["copy", "spin"], (1,))] == ["gemm"]  # no K measured
    assert [w.name for w in dc.energy_windows(["gemm"], ["copy"], (8,))] == ["gemm", "gemm+copy8", "copy8"]
    nvml, handle = _nvml(dc)
    fake = FakeTime()
    # Op windows: 10 iterations of 0.25 s; background windows: 4 of 1 s. After the six op windows
    # 21 s have gone, 4 s are left: less than a window (2.5 s) and 3 s of rounding and syncs.
    budget = dc.Budget(25, fake.clock)
    ran = []

    def run_for(window):
        ran.append(window.name)
        return lambda: fake.sleep(window.iteration_s(0.25))

    energy = dc.measure_energy_windows(nvml, handle, windows, run_for, lambda: None, budget, 2.5, 0.25,
                                       clock=fake.clock)
    assert ran == [w.name for w in windows[:6]] and fake.now == pytest.approx(21.0)
    assert energy["truncated"] == "budget: stopped before (no op) + copy on 8"
    assert energy["per_iteration"] == dc.ENERGY_PER_ITERATION and "copyK / spinK" in energy["per_iteration"]
    assert energy["add+copy32"]["power_w"] == pytest.approx(85.0, 1e-3)
    _no_writes()
