"""The simulated GPU as one device shared by the node agent and the pods allocated it
(`kareus.gpu.simdevice`): concurrent writers lose no update, readers agree with them, the agent's
exported counter is the workers' energy, and a lock set through one process is every process's."""

from __future__ import annotations

import json
import multiprocessing
import types

import pytest
import torch
import yaml
from kareus_node.main import _open_gpus, build_parser
from kareus_node.metrics import DaemonMetrics
from prometheus_client.parser import text_string_to_metric_families

from kareus import metric_names
from kareus.cli import main as cli_main
from kareus.gpu import SimulatedGPU, discover
from kareus.gpu.simdevice import POWER_WINDOW_S, SharedSimulatedGPU, SimDeviceFile
from kareus.runtime.energy import TwinEnergy
from kareus.runtime.schedule import Schedule
from kareus.runtime.trainer import TrainConfig, _simulated_energy
from kareus.sim import Measurement
from kareus.spec import parse_job

torch.set_num_threads(1)
NODE = "twin-node"
PRODUCT = "A100-SXM4-40GB"
STEPS_PER_WRITER = 200
STEP_J = (0.25, 0.5)  # each writer's energy per step: distinct, so a lost update shows in the sum


class ManualClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def _write_steps(directory: str, uuid: str, step_j: float, laps_path: str) -> None:
    """One rank in its own process: account a step, lap the counter, STEPS_PER_WRITER times."""
    twin = TwinEnergy(SharedSimulatedGPU(PRODUCT, 0, device_dir=directory, uuid=uuid))
    laps = [twin.step_j(step_j, 0.001) for _ in range(STEPS_PER_WRITER)]
    with open(laps_path, "w") as handle:
        json.dump(laps, handle)


def test_two_writers_and_a_reader_agree_without_losing_an_update(tmp_path):
    """Two processes account on one GPU at the same time; the reader's counter is their sum to the
    last update, and its busy time every step's modelled time."""
    reader = discover("sim", count=1, product=PRODUCT, node=NODE, device_dir=tmp_path)[0]
    assert isinstance(reader, SharedSimulatedGPU) and reader.energy_j() == 0.0
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_steps, args=(str(tmp_path), reader.uuid, j, str(tmp_path / f"laps{i}")))
               for i, j in enumerate(STEP_J)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    expected_j = STEPS_PER_WRITER * sum(STEP_J)
    assert reader.energy_j() == pytest.approx(expected_j, rel=1e-12)
    assert reader.busy_s() == pytest.approx(2 * STEPS_PER_WRITER * 0.001, rel=1e-12)
    # A writer's laps read the counter, so on a shared GPU they include the other's work (as NVML's
    # would): together they are exactly the counter's rise.
    laps = [json.loads((tmp_path / f"laps{i}").read_text()) for i in range(2)]
    assert sum(map(sum, laps)) >= expected_j * (1 - 1e-12)
    assert all(lap >= min(STEP_J) * (1 - 1e-9) for lap in laps[0] + laps[1])


def test_a_held_step_puts_its_energy_on_the_counter_as_its_modelled_time_passes(tmp_path):
    """NVML's counter rises while the GPU works: a 5.2 s step whose CPU part took 0.3 s shows
    0.3/5.2 of its energy at once, then at most a slice's share per slice, the whole at the end."""
    [gpu] = discover("sim", count=1, product=PRODUCT, node=NODE, device_dir=tmp_path)
    twin = TwinEnergy(SharedSimulatedGPU(PRODUCT, 0, device_dir=tmp_path, uuid=gpu.uuid))
    clock, seen = ManualClock(100.3), []

    def sleep(seconds: float) -> None:
        seen.append((clock.now_s - 100.0, gpu.energy_j()))
        clock.now_s += seconds

    wall_s, step_j = twin.run_step(100.0, 4100.0, 5.2, slice_s=0.5, now=clock, sleep=sleep)
    assert wall_s == pytest.approx(5.2) and step_j == pytest.approx(4100.0, rel=1e-12)
    assert gpu.energy_j() == pytest.approx(4100.0, rel=1e-12) and gpu.busy_s() == pytest.approx(5.2, rel=1e-12)
    assert seen[0] == pytest.approx((0.3, 4100.0 * 0.3 / 5.2))
    assert [round(t, 6) for t, _ in seen] == [round(0.3 + 0.5 * k, 6) for k in range(10)]
    assert all(j == pytest.approx(4100.0 * t / 5.2, rel=1e-9) for t, j in seen)  # the modelled power, all along
    clock.now_s = 200.0  # a step the CPU took longer than modelled: all of it at once, no wait
    assert twin.run_step(190.0, 10.0, 5.2, now=clock, sleep=sleep) == (10.0, pytest.approx(10.0))
    assert len(seen) == 10


def test_one_writer_per_gpu_reads_back_exactly_its_own_energy(tmp_path):
    gpus = discover("sim", count=2, product=PRODUCT, node=NODE, device_dir=tmp_path)
    ranks = [TwinEnergy(SharedSimulatedGPU(PRODUCT, g.index, device_dir=tmp_path, uuid=g.uuid)) for g in gpus]
    steps_j = [[ranks[r].step_j(0.68 + 0.01 * s + r, 0.0037) for s in range(5)] for r in range(2)]
    for r in range(2):
        assert steps_j[r] == pytest.approx([0.68 + 0.01 * s + r for s in range(5)], rel=1e-12)
        assert gpus[r].energy_j() == pytest.approx(sum(steps_j[r]), rel=1e-12)


def test_time_is_modelled_time_no_idle_energy_and_power_is_the_counters_rate(tmp_path):
    """Wall time adds nothing to a shared GPU's counter (its time is the modelled time); power is the
    energy accounted in the last POWER_WINDOW_S of wall time, so integrating it gives the counter's rise."""
    clock = ManualClock()
    gpu = SharedSimulatedGPU(PRODUCT, 0, device_dir=tmp_path, node=NODE, clock=clock)
    clock.now_s += 60.0
    assert gpu.energy_j() == 0.0 and gpu.power_w() == 0.0
    assert gpu.sm_clock_mhz() == 210  # parked while idle and unlocked
    for _ in range(4):  # four steps of 1.5 J, a quarter second apart
        gpu.account_work(1.5, 0.0037)
        clock.now_s += 0.25
    assert gpu.energy_j() == pytest.approx(6.0)
    clock.now_s -= 0.25
    assert gpu.power_w() == pytest.approx(6.0 / POWER_WINDOW_S)
    assert gpu.sm_clock_mhz() == 1410  # the work ran unlocked, at the maximum clock
    clock.now_s += 3600.0
    assert gpu.energy_j() == pytest.approx(6.0) and gpu.power_w() == 0.0
    work = Measurement.from_parts(time_s=0.5, energy_j=20.0, p_static_w=85.0, exposed_comm_s=0.0, avg_clock_mhz=1200.0)
    gpu.account(work)  # the profiler's way in
    assert gpu.energy_j() == pytest.approx(26.0) and gpu.busy_s() == pytest.approx(4 * 0.0037 + 0.5)
    assert gpu.sm_clock_mhz() == 1200


def test_a_lock_through_the_agent_is_the_devices_for_every_process(tmp_path):
    agent = discover("sim", count=2, product=PRODUCT, node=NODE, device_dir=tmp_path)
    agent[1].lock_sm_clock(1005, 1005)
    rank = SharedSimulatedGPU(PRODUCT, 1, device_dir=tmp_path, uuid=agent[1].uuid)
    assert rank.locked_clock_mhz() == 1005 and rank.run_clock_mhz() == 1005
    rank.account_work(1.0, 0.004)
    assert agent[1].sm_clock_mhz() == 1005  # the work ran at the agent's lock
    # A restarted agent sees the device still locked (the lock is the GPU's), until it resets it.
    again = discover("sim", count=2, product=PRODUCT, node=NODE, device_dir=tmp_path)
    assert again[1].locked_range_mhz() == (1005, 1005) and again[0].locked_clock_mhz() is None
    again[1].reset_sm_clock()
    assert rank.locked_clock_mhz() is None and rank.run_clock_mhz() == 1410
    assert SimDeviceFile(tmp_path, agent[1].uuid).read()["energy_j"] == pytest.approx(1.0)


def test_without_a_device_directory_nothing_changes(tmp_path):
    assert TwinEnergy.from_env(PRODUCT, {}) is None
    assert TwinEnergy.from_env(PRODUCT, {"KAREUS_SIM_GPU_DIR": str(tmp_path)}) is None  # no GPU named
    assert TwinEnergy.from_env(PRODUCT, {"KAREUS_SIM_GPU_DIR": str(tmp_path), "NVIDIA_VISIBLE_DEVICES": "all"}) is None
    one = discover("sim", count=1, product=PRODUCT, node=NODE)[0].uuid
    # A second local rank with no GPU of its own would double-count the first's: modelled energy instead.
    assert TwinEnergy.from_env(PRODUCT, {"KAREUS_SIM_GPU_DIR": str(tmp_path), "NVIDIA_VISIBLE_DEVICES": one,
                                         "LOCAL_RANK": "1"}) is None
    twin = TwinEnergy.from_env(PRODUCT, {"KAREUS_SIM_GPU_DIR": str(tmp_path), "NVIDIA_VISIBLE_DEVICES": one})
    assert twin is not None and twin.uuid == one
    assert type(discover("sim", count=1)[0]) is SimulatedGPU  # the process's own GPU, idle power over wall time
    args = build_parser().parse_args(["--backend", "sim", "--sim-gpus", "2", "--state-dir", str(tmp_path / "state"),
                                      "--node-name", NODE])
    assert all(type(g) is SimulatedGPU for g in _open_gpus(args))


def _agent_counters_j(gpus) -> dict[str, float]:
    """`kareus_gpu_energy_joules_total` per GPU as the node agent's /metrics renders it."""
    from prometheus_client import generate_latest

    metrics = DaemonMetrics()
    metrics.watch(types.SimpleNamespace(gpus={g.uuid: g for g in gpus}, leases={}, workers={}, node_name=NODE))
    text = generate_latest(metrics.registry).decode()
    return {s.labels["gpu_uuid"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == metric_names.GPU_ENERGY_JOULES_TOTAL}


def test_the_agents_series_is_the_workers_energy(tmp_path, monkeypatch):
    """`kareus train` with two ranks on two of the node's shared GPUs (as the emulated device plugin
    sets them up): the node agent's exported counters sum to the job's energy in train.jsonl, each
    GPU holds its rank's modelled share, and the per-step numbers are the modelled ones (the counter
    only carries them, it adds nothing)."""
    device_dir = tmp_path / "dev"
    steps = 3
    manifest = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "twin"},
                "spec": {"model": {"preset": "tiny"}, "sequenceLength": 16,
                         "parallelism": {"tensor": 2, "pipeline": 1, "context": 1, "data": 1,
                                         "microBatchSize": 2, "numMicroBatches": 2},
                         "objective": {"maxThroughput": {}},
                         "training": {"image": "x", "steps": steps, "gpusPerNode": 2, "nodes": 1}}}
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(manifest))
    args = build_parser().parse_args(["--backend", "sim", "--sim-gpus", "4", "--sim-product", PRODUCT,
                                      "--state-dir", str(tmp_path / "state"), "--node-name", NODE,
                                      "--sim-device-dir", str(device_dir)])
    agent = _open_gpus(args)
    pod_gpus = [agent[2].uuid, agent[3].uuid]  # the device plugin gave the pod two of the four
    monkeypatch.setenv("KAREUS_SIM_GPU_DIR", str(device_dir))
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", ",".join(pod_gpus))
    assert cli_main(["train", str(job_path), "--nproc", "2", "--out", str(tmp_path / "out"), "--json"]) == 0

    lines = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    workers_j = sum(line["energy_j"] for line in lines)
    config = TrainConfig.from_job(parse_job(manifest))
    schedule = Schedule.uniform(1, 2, mode="partitioned")
    modelled = _simulated_energy(config, schedule).replica
    per_gpu_j = modelled.stage_gpu_energy_j()[0]
    counters = _agent_counters_j(agent)
    print(f"\nagent counters {counters}; workers' train.jsonl {workers_j:.9g} J; modelled {per_gpu_j:.9g} J per GPU-step")
    assert len(lines) == steps
    assert [line["energy_j"] for line in lines] == pytest.approx([2 * per_gpu_j] * steps, rel=1e-9)
    assert sum(counters.values()) == pytest.approx(workers_j, rel=1e-9)
    assert [counters[u] for u in pod_gpus] == pytest.approx([steps * per_gpu_j] * 2, rel=1e-9)
    assert counters[agent[0].uuid] == counters[agent[1].uuid] == 0.0  # nobody's: no modelled time passed
    assert agent[2].busy_s() == pytest.approx(steps * modelled.time_s, rel=1e-9)


