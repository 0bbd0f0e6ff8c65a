"""The GPU interface: the simulated backend and the NVML backend driven by a fake `pynvml`."""

from __future__ import annotations

import pytest
from fakes import fake_pynvml

from kareus.errors import KareusError
from kareus.gpu import GPUDevice, SimulatedGPU, discover, sim_uuid
from kareus.gpu.nvml import NVMLGPU, discover_nvml
from kareus.sim import Measurement, get_gpu


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


# -- simulated backend -------------------------------------------------------------------------
def test_discover_sim_gives_distinct_addressable_gpus() -> None:
    gpus = discover("sim", count=3, product="NVIDIA-A100-SXM4-40GB")
    assert [gpu.index for gpu in gpus] == [0, 1, 2]
    assert all(isinstance(gpu, GPUDevice) for gpu in gpus)
    assert len({gpu.uuid for gpu in gpus}) == 3 and len({gpu.pci_bus_id for gpu in gpus}) == 3
    assert all(gpu.uuid.startswith(f"GPU-sim-{gpu.index}-") for gpu in gpus)
    assert gpus[0].sm_count == 108 and gpus[0].name == "NVIDIA A100-SXM4-40GB"
    # Deterministic per node: the same node sees the same UUIDs, another node different ones.
    assert [g.uuid for g in discover("sim", count=3)] == [g.uuid for g in gpus]
    assert discover("sim", count=1, node="other")[0].uuid != gpus[0].uuid
    assert sim_uuid("n", "A100-SXM4-40GB", 0) == sim_uuid("n", "A100-SXM4-40GB", 0)


def test_sim_lock_is_validated_against_supported_clocks() -> None:
    gpu = SimulatedGPU("H100-SXM")
    clocks = gpu.supported_sm_clocks_mhz()
    assert clocks[0] == 1980 and clocks[-1] == 345 and clocks == tuple(sorted(clocks, reverse=True))
    gpu.lock_sm_clock(1500, 1500)
    assert gpu.locked_clock_mhz() == 1500
    for bad in ((1501, 1501), (1500, 2000), (1600, 1500), (100, 1500)):
        with pytest.raises(KareusError, match="mhz"):
            gpu.lock_sm_clock(*bad)
    assert gpu.locked_clock_mhz() == 1500  # a refused request changes nothing
    gpu.reset_sm_clock()
    assert gpu.locked_clock_mhz() is None
    assert gpu.lock_changes == 2


def test_sim_energy_counter_runs_at_idle_power_and_accounts_work() -> None:
    clock = ManualClock()
    gpu = SimulatedGPU("A100-SXM4-40GB", clock=clock)
    idle_w = get_gpu("A100-SXM4-40GB").p_static_w
    start = gpu.energy_j()
    clock.now_s += 2.0
    assert gpu.energy_j() - start == pytest.approx(2.0 * idle_w)
    assert gpu.power_w() == pytest.approx(idle_w)
    assert gpu.sm_clock_mhz() == 210  # parked while idle and unlocked

    work = Measurement.from_parts(time_s=1.0, energy_j=300.0, p_static_w=idle_w, exposed_comm_s=0.0,
                                  avg_clock_mhz=1200.0)
    before = gpu.energy_j()
    gpu.account(work)
    assert gpu.energy_j() - before == pytest.approx(300.0)
    clock.now_s += 0.5  # still busy: power is the work's, no idle energy is added
    assert gpu.power_w() == pytest.approx(300.0)
    assert gpu.sm_clock_mhz() == 1200
    assert gpu.energy_j() - before == pytest.approx(300.0)
    clock.now_s += 1.5  # busy until +1.0, idle for the remaining 1.0 s
    assert gpu.energy_j() - before == pytest.approx(300.0 + idle_w * 1.0)
    assert gpu.power_w() == pytest.approx(idle_w)


def test_sim_lock_persists_across_processes(tmp_path) -> None:
    first = discover("sim", count=2, state_dir=tmp_path)
    first[1].lock_sm_clock(1200, 1305)
    again = discover("sim", count=2, state_dir=tmp_path)  # a restarted daemon
    assert again[1].locked_clock_mhz() == 1305 and again[1].locked_range_mhz() == (1200, 1305)
    assert again[0].locked_clock_mhz() is None
    again[1].reset_sm_clock()
    assert discover("sim", count=2, state_dir=tmp_path)[1].locked_clock_mhz() is None


def test_sim_mig_and_unknown_backend() -> None:
    gpus = discover("sim", count=2, mig_indices=(1,))
    assert [g.is_mig_enabled() for g in gpus] == [False, True]
    assert gpus[1].info().mig_enabled
    with pytest.raises(KareusError, match="allowed: nvml, sim"):
        discover("cuda")
    with pytest.raises(KareusError, match="unknown GPU product"):
        discover("sim", product="Z100")


# -- NVML backend with the fake pynvml ---------------------------------------------------------
@pytest.fixture
def nvml():
    fake_pynvml.reset(count=2)
    return fake_pynvml


def test_nvml_discovery_reads_identity(nvml) -> None:
    gpus = discover("nvml", module=nvml)
    assert all(isinstance(g, NVMLGPU) for g in gpus)
    assert [g.uuid for g in gpus] == [d.uuid for d in nvml.devices()]
    assert gpus[1].pci_bus_id == "00000000:17:00.0"
    assert gpus[0].name == "NVIDIA A100-SXM4-40GB" and gpus[0].sm_count == 108
    assert nvml.calls_of("nvmlInit")


def test_nvml_clock_control_and_readings(nvml) -> None:
    gpu = discover_nvml(nvml)[0]
    assert gpu.supported_sm_clocks_mhz()[:2] == (1410, 1395)
    gpu.lock_sm_clock(1200, 1200)
    assert nvml.devices()[0].locked_mhz == (1200, 1200) and gpu.locked_clock_mhz() == 1200
    assert gpu.sm_clock_mhz() == 1200
    with pytest.raises(KareusError, match="min_mhz 1201"):
        gpu.lock_sm_clock(1201, 1300)
    assert len(nvml.calls_of("nvmlDeviceSetGpuLockedClocks")) == 1  # validated before NVML is called
    gpu.reset_sm_clock()
    assert nvml.devices()[0].locked_mhz is None and gpu.locked_clock_mhz() is None

    nvml.devices()[0].power_w = 250.0
    start = gpu.energy_j()
    nvml.advance(2.0)
    assert gpu.energy_j() - start == pytest.approx(500.0)
    assert gpu.power_w() == pytest.approx(250.0)


def test_nvml_failures_become_kareus_errors(nvml) -> None:
    gpu = discover_nvml(nvml)[0]
    nvml.fail("nvmlDeviceSetGpuLockedClocks", nvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(KareusError, match=r"nvmlDeviceSetGpuLockedClocks failed on GPU-fake-0000.*Insufficient"):
        gpu.lock_sm_clock(1200, 1200)
    assert gpu.locked_clock_mhz() is None  # nothing recorded when NVML refused
    gpu.lock_sm_clock(1200, 1200)  # the injected failure was one-shot
    assert gpu.locked_clock_mhz() == 1200


def test_nvml_mig_mode(nvml) -> None:
    devices = nvml.devices()
    devices[0].mig_enabled = True
    devices[1].mig_supported = False
    gpus = discover_nvml(nvml)
    assert gpus[0].is_mig_enabled() is True
    assert gpus[1].is_mig_enabled() is False  # NotSupported means "no MIG"


def test_nvml_missing_driver_is_a_clear_error(nvml) -> None:
    nvml.fail_init()
    with pytest.raises(KareusError, match="NVML is not available"):
        discover("nvml", module=nvml)
    with pytest.raises(KareusError, match="nvidia-ml-py"):
        discover("nvml", module="kareus_no_such_pynvml_module")


def test_numpy_integers_are_accepted(tmp_path) -> None:
    np = pytest.importorskip("numpy")
    gpu = discover("sim", count=1, state_dir=tmp_path)[0]
    gpu.lock_sm_clock(np.int64(1200), np.int64(1305))
    assert gpu.locked_range_mhz() == (1200, 1305) and type(gpu.locked_range_mhz()[0]) is int
    assert discover("sim", count=1, state_dir=tmp_path)[0].locked_clock_mhz() == 1305


def _kareus_imports(path) -> set[str]:
    """Every `kareus.…` module a source file imports, at any depth (lazy imports included)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("kareus")}


def test_the_simulated_gpu_modules_import_one_way() -> None:
    """`kareus.gpu.sim` sits under `kareus.gpu.simdevice`: the shared device builds on the simulated
    GPU, never the reverse (not even lazily), and every public name stays where it was."""
    from pathlib import Path

    import kareus.gpu.sim as sim
    import kareus.gpu.simdevice as simdevice

    assert "kareus.gpu.simdevice" not in _kareus_imports(Path(sim.__file__))
    assert "kareus.gpu.sim" in _kareus_imports(Path(simdevice.__file__))
    for name in ("SimulatedGPU", "discover_sim", "sim_uuid"):
        assert hasattr(sim, name)
    for name in ("SharedSimulatedGPU", "SimDeviceFile", "POWER_WINDOW_S", "SIM_GPU_DIR_ENV", "VISIBLE_DEVICES_ENV",
                 "recent_work", "visible_uuids", "sim_index", "discover_shared"):
        assert hasattr(simdevice, name)
    assert issubclass(simdevice.SharedSimulatedGPU, sim.SimulatedGPU)


def test_discover_with_a_device_directory_gives_the_shared_gpus(tmp_path) -> None:
    from kareus.gpu.simdevice import SharedSimulatedGPU

    shared = discover("sim", count=2, product="A100-SXM4-40GB", node="n", mig_indices=(1,),
                      state_dir=tmp_path / "state", device_dir=tmp_path / "dev")
    assert [type(g) for g in shared] == [SharedSimulatedGPU, SharedSimulatedGPU]
    assert [g.uuid for g in shared] == [g.uuid for g in discover("sim", count=2, node="n")]
    assert [g.is_mig_enabled() for g in shared] == [False, True]
    shared[0].lock_sm_clock(1005, 1005)
    assert not (tmp_path / "state").exists()  # the lock went to the device, not the state directory
    assert discover("sim", count=1, node="n", device_dir=tmp_path / "dev")[0].locked_range_mhz() == (1005, 1005)


# -- the board power limit ---------------------------------------------------------------------
def test_sim_power_limit_is_checked_against_the_board_and_persists(tmp_path) -> None:
    gpu = discover("sim", count=2, state_dir=tmp_path)[1]
    assert (gpu.power_limit_range_w(), gpu.default_power_limit_w(), gpu.power_limit_w()) == ((100.0, 400.0), 400.0, 400.0)
    for bad in (99.0, 401, True, "300"):
        with pytest.raises(KareusError, match="outside the settable range 100–400 W"):
            gpu.set_power_limit_w(bad)
    gpu.set_power_limit_w(250)
    assert gpu.power_limit_w() == 250.0 and gpu.run_power_limit_w() == 250.0
    again = discover("sim", count=2, state_dir=tmp_path)  # a restarted daemon sees the board still limited
    assert again[1].power_limit_w() == 250.0 and again[0].power_limit_w() == 400.0
    assert again[1].locked_clock_mhz() is None  # a limit is not a lock
    again[1].reset_power_limit()
    assert discover("sim", count=2, state_dir=tmp_path)[1].power_limit_w() == 400.0


def test_a_shared_simulated_gpu_limited_by_one_process_is_limited_for_all(tmp_path) -> None:
    from kareus.gpu.simdevice import SharedSimulatedGPU

    agent = discover("sim", count=1, device_dir=tmp_path)[0]
    rank = SharedSimulatedGPU("A100-SXM4-40GB", 0, device_dir=tmp_path, uuid=agent.uuid)  # a training pod's view
    agent.lock_sm_clock(1200, 1200)
    agent.set_power_limit_w(200)
    assert rank.run_power_limit_w() == 200.0 and rank.locked_clock_mhz() == 1200
    agent.reset_sm_clock()  # the clock and the limit are separate: resetting one keeps the other
    assert rank.run_power_limit_w() == 200.0 and rank.locked_clock_mhz() is None
    agent.reset_power_limit()
    assert rank.run_power_limit_w() is None and rank.power_limit_w() == 400.0


def test_the_simulated_gpu_draws_less_under_a_power_limit() -> None:
    from kareus.runtime.energy import SimulatedEnergy
    from kareus.runtime.schedule import Schedule
    from kareus.workload.models import get_preset
    from kareus.workload.partitions import build_workload

    workload = build_workload(get_preset("llama3.2-3b"), tp=1, cp=1, pp=1, seq_len=2048, micro_batch_size=4)
    schedule = Schedule.uniform(1, 2, clock_mhz=1410)
    free = SimulatedEnergy(workload, "A100-SXM4-40GB", schedule, 1).result
    capped = SimulatedEnergy(workload, "A100-SXM4-40GB", schedule, 1, power_limit_w=200.0).result
    free_w, capped_w = free.energy_j / free.time_s, capped.energy_j / capped.time_s
    assert free_w > 250.0  # the unlimited board draws well above the limit at its top clock
    assert capped_w <= 200.0 + 1e-6 < free_w  # the power controller throttles every phase to the limit
    assert capped.time_s > free.time_s  # by running slower
    with pytest.raises(KareusError, match=r"outside A100-SXM4-40GB's settable range 100\.\.400 W"):
        SimulatedEnergy(workload, "A100-SXM4-40GB", schedule, 1, power_limit_w=50.0)


def test_nvml_power_limit_in_milliwatts(nvml) -> None:
    gpu = discover_nvml(nvml)[0]
    device = nvml.devices()[0]
    assert (gpu.power_limit_range_w(), gpu.default_power_limit_w(), gpu.power_limit_w()) == ((100.0, 400.0), 400.0, 400.0)
    gpu.set_power_limit_w(212.5)
    assert device.power_limit_mw == 212_500 and gpu.power_limit_w() == 212.5
    with pytest.raises(KareusError, match="outside the settable range 100–400 W"):
        gpu.set_power_limit_w(450)
    assert len(nvml.calls_of("nvmlDeviceSetPowerManagementLimit")) == 1  # validated before NVML is called
    gpu.reset_power_limit()
    assert device.power_limit_mw == 400_000
    assert nvml.calls_of("nvmlDeviceSetPowerManagementLimit")[-1][2] == (400_000,)  # the board's default
    nvml.fail("nvmlDeviceSetPowerManagementLimit", nvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(KareusError, match=r"nvmlDeviceSetPowerManagementLimit failed on GPU-fake-0000.*Insufficient"):
        gpu.set_power_limit_w(300)
