"""The `Simulator` API: accounting, composition vs whole instructions, noise, physics directions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.errors import KareusError
from kareus.sim import GPUS, Measurement, Simulator, combine, get_gpu
from kareus.workload.models import get_preset
from kareus.workload.partitions import PartitionConfig, build_workload

LLAMA3B = get_preset("llama3.2-3b")
WORKLOAD = build_workload(LLAMA3B, tp=4, cp=1, pp=2, seq_len=4096, micro_batch_size=8)
FWD_ATTN = WORKLOAD.partition_types["fwd_attn"]


@pytest.fixture(scope="module")
def sim() -> Simulator:
    return Simulator("A100-SXM4-40GB")


def test_gpu_presets_and_spellings() -> None:
    assert set(GPUS) >= {"A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB"}
    for spelling, name in [("NVIDIA-A100-SXM4-40GB", "A100-SXM4-40GB"), ("a100-sxm4-80gb", "A100-SXM4-80GB"),
                           ("H100-SXM", "H100-SXM5-80GB"), ("NVIDIA H200", "H200-SXM-141GB"),
                           ("H200-SXM-141GB", "H200-SXM-141GB")]:
        assert get_gpu(spelling).name == name
    a100 = get_gpu("A100")
    assert a100.sms == 108 and a100.supported_clocks_mhz[0] == 1410 and a100.supported_clocks_mhz[-1] == 210
    assert a100.search_clocks_mhz == tuple(range(1410, 899, -30))
    assert a100.flops_per_sm_cycle == pytest.approx(312e12 / (108 * 1410e6))
    assert a100.voltage_ratio(900) == a100.voltage_ratio(1000) < a100.voltage_ratio(1200) < a100.voltage_ratio(1410)
    with pytest.raises(KareusError, match="unknown GPU product 'V100'"):
        get_gpu("V100")


def test_measurement_accounting(sim) -> None:
    m = sim.partition(FWD_ATTN, 1200, 6, "linear_0")
    assert m.static_energy_j == pytest.approx(sim.p_static_w * m.time_s)
    assert m.dynamic_energy_j == pytest.approx(m.energy_j - m.static_energy_j)
    assert m.effective_energy_j == m.dynamic_energy_j > 0
    assert m.avg_power_w == pytest.approx(m.energy_j / m.time_s)
    assert m.avg_clock_mhz == pytest.approx(1200) and not m.throttled
    doubled = m.times(2)
    assert doubled.time_s == pytest.approx(2 * m.time_s) and doubled.avg_power_w == pytest.approx(m.avg_power_w)
    both = combine([m, doubled], sim.p_static_w)
    assert both.energy_j == pytest.approx(3 * m.energy_j) and both.avg_clock_mhz == pytest.approx(1200)
    assert set(m.to_dict()) >= {"time_s", "energy_j", "static_energy_j", "dynamic_energy_j", "exposed_comm_s",
                                "effective_energy_j", "avg_clock_mhz", "avg_power_w"}


def test_deterministic_without_noise_and_seeded_with_it() -> None:
    a, b = Simulator("A100"), Simulator("A100")
    assert a.partition(FWD_ATTN, 1200, 6, "rope_0") == b.partition(FWD_ATTN, 1200, 6, "rope_0")
    noisy1 = Simulator("A100", noise_std=0.02, seed=7)
    noisy2 = Simulator("A100", noise_std=0.02, seed=7)
    other = Simulator("A100", noise_std=0.02, seed=8)
    runs1 = [noisy1.partition(FWD_ATTN, 1200, 6, "rope_0") for _ in range(50)]
    runs2 = [noisy2.partition(FWD_ATTN, 1200, 6, "rope_0") for _ in range(50)]
    assert runs1 == runs2 and runs1 != [other.partition(FWD_ATTN, 1200, 6, "rope_0") for _ in range(50)]
    clean = a.partition(FWD_ATTN, 1200, 6, "rope_0")
    mean_time = sum(m.time_s for m in runs1) / len(runs1)
    assert mean_time == pytest.approx(clean.time_s, rel=0.02)
    assert len({m.time_s for m in runs1}) == 50
    with pytest.raises(KareusError, match="noise_std"):
        Simulator("A100", noise_std=-1)


def test_instruction_is_the_sum_of_its_partitions(sim) -> None:
    """Composition (what the optimizer does) and whole-instruction execution agree exactly."""
    configs = {"fwd_attn": PartitionConfig("rope_0", 6), "fwd_mlp": PartitionConfig("activation_0", 9),
               "bwd_mlp": PartitionConfig("linear_0", 12), "bwd_attn": PartitionConfig("attn_0", 6)}
    recompute = {"fwd_attn": PartitionConfig("linear_0", 3), "fwd_mlp": PartitionConfig("norm_0", 30)}
    for stage in WORKLOAD.stages:
        for clock in (1410, 1050):
            forward = sim.instruction(stage, "forward", clock, configs)
            parts = [sim.partition(WORKLOAD.partition_types[name], clock, configs[name].comm_sms,
                                   configs[name].launch_slot).times(count)
                     for name, count in stage.forward_instances.items()]
            parts.append(sim.sequential(stage.nonpartition_forward_ops, clock))
            composed = combine(parts, sim.p_static_w)
            assert forward.time_s == pytest.approx(composed.time_s, rel=1e-9)
            assert forward.energy_j == pytest.approx(composed.energy_j, rel=1e-9)
            assert forward.exposed_comm_s == pytest.approx(composed.exposed_comm_s, rel=1e-9, abs=1e-15)

            backward = sim.instruction(stage, "backward", clock, configs, recompute)
            parts = [sim.partition(WORKLOAD.partition_types[name], clock, configs[name].comm_sms,
                                   configs[name].launch_slot).times(count)
                     for name, count in stage.backward_instances.items()]
            parts += [sim.partition(WORKLOAD.partition_types[name], clock, recompute[name].comm_sms,
                                    recompute[name].launch_slot).times(count)
                      for name, count in stage.recompute_instances.items()]
            parts.append(sim.sequential(stage.nonpartition_backward_ops, clock))
            assert backward.energy_j == pytest.approx(combine(parts, sim.p_static_w).energy_j, rel=1e-9)


def test_sequential_instruction_and_config_forms(sim) -> None:
    stage = WORKLOAD.stages[1]
    seq = sim.instruction(stage, "forward", 1200, None)
    assert seq == sim.sequential(stage.sequential_forward_ops + stage.nonpartition_forward_ops, 1200)
    # Config as dicts or pairs; recompute falls back to `configs` for forward names.
    as_dicts = {"bwd_mlp": {"launch_slot": "linear_0", "comm_sms": 6}, "bwd_attn": ("attn_0", 6),
                "fwd_attn": ("linear_0", 6), "fwd_mlp": ("linear_0", 6)}
    backward = sim.instruction(stage, "backward", 1200, as_dicts)
    explicit = sim.instruction(stage, "backward", 1200, as_dicts,
                               {"fwd_attn": PartitionConfig("linear_0", 6), "fwd_mlp": PartitionConfig("linear_0", 6)})
    assert backward == explicit
    different = sim.instruction(stage, "backward", 1200, as_dicts, {"fwd_attn": ("norm_0", 3)})
    assert different.energy_j != backward.energy_j
    with pytest.raises(KareusError, match="recompute_configs: missing a config for partition type 'fwd_mlp'"):
        sim.instruction(stage, "backward", 1200, {"bwd_mlp": ("norm_0", 3), "bwd_attn": ("norm_0", 3)},
                        {"fwd_attn": ("norm_0", 3)})
    with pytest.raises(KareusError, match=r"configs\.fwd_attn: expected"):
        sim.instruction(stage, "forward", 1200, {"fwd_attn": 3, "fwd_mlp": ("norm_0", 3)})
    with pytest.raises(KareusError, match="direction"):
        sim.instruction(stage, "sideways", 1200, None)


def test_an_exposed_collective_alone_is_the_partitions_tail(sim) -> None:
    """Alone on its SMs a collective is all exposed (then the partition's join), and draws static
    power plus its own SMs' and traffic's: less than compute beside it."""
    alone = sim.exposed(FWD_ATTN.comm, 1410, 8)
    beside = sim.partition(FWD_ATTN, 1410, 8, "norm_0")
    assert 0 < alone.time_s < beside.time_s
    assert alone.exposed_comm_s + sim.params.partition_join_s == pytest.approx(alone.time_s, rel=1e-9)
    assert sim.p_static_w < alone.energy_j / alone.time_s < beside.energy_j / beside.time_s


def test_bad_arguments_name_what_is_allowed(sim) -> None:
    with pytest.raises(KareusError, match=r"outside A100-SXM4-40GB.s range 210\.\.1410"):
        sim.partition(FWD_ATTN, 1500, 6, "norm_0")
    with pytest.raises(KareusError, match=r"comm_sms must be an integer in 1\.\.107"):
        sim.partition(FWD_ATTN, 1200, 0, "norm_0")
    with pytest.raises(KareusError, match=r"comm_sms must be an integer in 1\.\.107"):
        sim.exposed(FWD_ATTN.comm, 1200, 108)
    with pytest.raises(KareusError, match=r"outside A100-SXM4-40GB.s range 210\.\.1410"):
        sim.exposed(FWD_ATTN.comm, 1500, 8)
    with pytest.raises(KareusError, match="unknown launch slot 'rope_7'"):
        sim.partition(FWD_ATTN, 1200, 6, "rope_7")
    with pytest.raises(KareusError, match="wobble_mhz"):
        sim.sequential(FWD_ATTN.compute_ops, 1200, wobble_mhz=-5)


def test_launching_at_the_last_linear_always_exposes_the_collective(sim) -> None:
    for sms in (3, 15, 30):
        assert sim.partition(FWD_ATTN, 1200, sms, "linear_1").exposed_comm_s > 0
        assert sim.partition(FWD_ATTN, 1200, sms, "norm_0").exposed_comm_s < \
            sim.partition(FWD_ATTN, 1200, sms, "linear_1").exposed_comm_s


def test_sequential_partition_is_reported_per_nanobatch(sim) -> None:
    seq = sim.sequential_partition(FWD_ATTN, 1200)
    whole = sim.sequential((*(op.scaled(2) for op in FWD_ATTN.compute_ops), FWD_ATTN.comm.scaled(2)), 1200)
    assert seq.time_s == pytest.approx(whole.time_s / 2) and seq.energy_j == pytest.approx(whole.energy_j / 2)
    assert seq.exposed_comm_s > 0  # Megatron-style: the collective never overlaps


@settings(max_examples=20, deadline=None)
@given(clock=st.sampled_from(get_gpu("A100").search_clocks_mhz), slot=st.sampled_from(FWD_ATTN.launch_slots),
       sms=st.integers(1, 29))
def test_physics_directions(clock, slot, sms) -> None:
    sim = Simulator("A100")
    here = sim.partition(FWD_ATTN, clock, sms, slot)
    more_sms = sim.partition(FWD_ATTN, clock, sms + 1, slot)
    assert more_sms.exposed_comm_s <= here.exposed_comm_s + 1e-12  # a faster collective hides better
    assert here.avg_power_w <= get_gpu("A100").power_limit_w + 1e-6
    assert here.time_s > 0 and here.dynamic_energy_j > 0
    if clock > 900:
        slower = sim.partition(FWD_ATTN, clock - 30, sms, slot)
        if not here.throttled:
            # Same work at a lower clock never costs more dynamic energy (f·V² per cycle); below
            # the voltage floor the energy per cycle is flat, and only where the collective's
            # overlap ends shifts (well under 0.1 %) ...
            assert slower.dynamic_energy_j <= here.dynamic_energy_j * (1 + 1e-3)
            if here.exposed_comm_s == 0:
                # ... and is never faster while compute bounds the partition. (When the collective
                # bounds it, slower memory-bound kernels leave it more HBM bandwidth.)
                assert slower.time_s >= here.time_s * (1 - 1e-9)
        # Throttled, a lower lock can even be faster: the controller's dither is capped at the
        # lock, so a lower cap wastes less power on f·V² convexity (Theorem 1).


def test_faster_gpus_run_the_same_work_faster() -> None:
    times = {name: Simulator(name).partition(FWD_ATTN, 1200, 9, "linear_0").time_s
             for name in ("A100-SXM4-40GB", "H100-SXM5-80GB")}
    assert times["H100-SXM5-80GB"] < times["A100-SXM4-40GB"]
    memory_op = FWD_ATTN.compute_ops[0]  # bias-dropout-add: bandwidth-bound
    h100, h200 = Simulator("H100"), Simulator("H200")
    assert h200.sequential([memory_op], 1500).time_s < h100.sequential([memory_op], 1500).time_s


def test_measurement_from_parts_handles_zero_time() -> None:
    empty = Measurement.from_parts(time_s=0.0, energy_j=0.0, p_static_w=85, exposed_comm_s=0, avg_clock_mhz=0)
    assert empty.avg_power_w == 0.0 and empty.effective_energy_j == 0.0


@pytest.mark.parametrize("gpu", ["A100-SXM4-80GB", "H200"])
def test_every_cp_tp_partition_is_physical(gpu) -> None:
    sim = Simulator(gpu)
    workload = build_workload(get_preset("qwen3-1.7b"), tp=4, cp=2, pp=2, seq_len=4096, micro_batch_size=8)
    top = sim.gpu.clock_max_mhz
    for ptype in workload.partition_types.values():
        for slot in ptype.launch_slots:
            for sms in (ptype.comm_sms_grid[0], ptype.comm_sms_grid[-1]):
                for clock in (top, top - 450):
                    m = sim.partition(ptype, clock, sms, slot)
                    assert 0 <= m.exposed_comm_s < m.time_s
                    assert m.energy_j > m.static_energy_j > 0
                    assert m.avg_clock_mhz <= clock + 1e-9
                    assert m.avg_power_w <= sim.gpu.power_limit_w + 1e-6
        seq = sim.sequential_partition(ptype, top)
        assert seq.exposed_comm_s > 0 and seq.time_s > 0
    for stage in workload.stages:
        configs = {name: p.default_config() for name, p in workload.partition_types.items()}
        for direction in ("forward", "backward"):
            partitioned = sim.instruction(stage, direction, top, configs)
            sequential = sim.instruction(stage, direction, top, None)
            assert partitioned.time_s > 0 and sequential.time_s > 0
