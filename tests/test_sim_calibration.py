"""The simulator against its calibration (issues 2 and 20): Perseus' curve on its own workload, the
paper's single-layer study, and Theorem 1 — all from the global physical model with the shipped
(fitted) presets, no per-case constants. docs/simulator.md has the fit and held-out tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.sim import Simulator, get_gpu
from kareus.sim.sweep import sweep
from kareus.workload.models import get_preset, get_shape
from kareus.workload.ops import LayerDims, layer_sequential_forward
from kareus.workload.partitions import build_workload

A100 = get_gpu("A100-SXM4-40GB")
LLAMA3B = get_preset("llama3.2-3b")

# Perseus' A100 GPT-3 175B stage forward: (time, energy) over their 1410 MHz values
# (calibration/a100_perseus_layer_curve.csv).
PERSEUS_RATIOS = {1350: (1.012, 0.971), 1305: (1.036, 0.932), 1260: (1.068, 0.874), 1200: (1.118, 0.809),
                  1140: (1.174, 0.771), 1080: (1.237, 0.736), 1020: (1.306, 0.739), 960: (1.385, 0.750),
                  855: (1.550, 0.766)}


@pytest.fixture(scope="module")
def simulator() -> Simulator:
    return Simulator(A100)


@pytest.fixture(scope="module")
def layer_curve(simulator):
    ops = layer_sequential_forward(LayerDims(LLAMA3B, tp=8, cp=1, batch=8, seq_local=4096))
    return {clock: simulator.sequential(ops, clock) for clock in A100.supported_clocks_mhz if clock >= 855}


@pytest.fixture(scope="module")
def perseus_curve():
    """Perseus' own workload: one GPT-3 175B stage (12 layers, TP8, one 2048-token sequence) on the
    500 W A100-SXM it was measured on."""
    simulator = Simulator(get_gpu("A100-SXM4-80GB"), power_limit_w=500)
    ops = layer_sequential_forward(LayerDims(get_shape("gpt3-175b"), tp=8, cp=1, batch=1, seq_local=2048)) * 12
    return {clock: simulator.sequential(ops, clock) for clock in get_gpu("A100-SXM4-80GB").supported_clocks_mhz
            if clock >= 855}


def test_perseus_curve_is_reproduced_on_its_own_workload_within_3_percent(perseus_curve) -> None:
    top = perseus_curve[1410]
    for clock, (time_ratio, energy_ratio) in PERSEUS_RATIOS.items():
        assert perseus_curve[clock].time_s / top.time_s == pytest.approx(time_ratio, rel=0.03), clock
        assert perseus_curve[clock].energy_j / top.energy_j == pytest.approx(energy_ratio, rel=0.03), clock


def test_the_energy_minimum_clock_is_predicted_not_a_parameter(perseus_curve) -> None:
    """Perseus measured the minimum at 1080 MHz (1020 within 0.4 %); the fitted model predicts it on
    the 15 MHz grid from its voltage curve and static and memory power."""
    best_clock = min(perseus_curve, key=lambda clock: perseus_curve[clock].energy_j)
    assert 1020 <= best_clock <= 1110
    grid = {clock: m for clock, m in perseus_curve.items() if clock in PERSEUS_RATIOS or clock == 1410}
    assert min(grid, key=lambda clock: grid[clock].energy_j) == 1080
    assert perseus_curve[best_clock].energy_j < perseus_curve[855].energy_j
    assert perseus_curve[best_clock].energy_j < perseus_curve[1305].energy_j


def test_layer_energy_curve_on_the_400_w_part(layer_curve) -> None:
    top = layer_curve[1410]
    best_clock = min(layer_curve, key=lambda clock: layer_curve[clock].energy_j)
    assert 1000 <= best_clock <= 1150
    assert 0.68 <= layer_curve[best_clock].energy_j / top.energy_j <= 0.85
    assert 1.25 <= layer_curve[855].time_s / top.time_s <= 1.7
    assert layer_curve[1305].energy_j < layer_curve[1410].energy_j
    assert layer_curve[855].energy_j > layer_curve[best_clock].energy_j


def test_power_limit_makes_the_top_clocks_buy_little_time(layer_curve) -> None:
    top = layer_curve[1410]
    assert top.throttled and top.avg_clock_mhz < 1400
    assert not layer_curve[1200].throttled and layer_curve[1200].avg_clock_mhz == pytest.approx(1200)
    # 8 % more clock from 1305 to 1410 buys less than 2.5 % time; lower down it buys ~proportionally more.
    assert layer_curve[1305].time_s / top.time_s < 1.025
    assert layer_curve[1095].time_s / layer_curve[1200].time_s > 1.03
    assert max(m.avg_power_w for m in layer_curve.values()) <= A100.power_limit_w


@pytest.fixture(scope="module")
def fwd_attn_study(simulator):
    """fwd_attn of Llama 3.2 3B, TP4, seq 4096, mbs 8: every slot × 1..30 SMs at 1410 and 1100 MHz."""
    workload = build_workload(LLAMA3B, tp=4, cp=1, pp=1, seq_len=4096, micro_batch_size=8)
    points = list(sweep(simulator, workload, "fwd_attn", clocks_mhz=(1410, 1100), comm_sms=range(1, 31)))
    sequential = {p["clock_mhz"]: p for p in sweep(simulator, workload, "sequential:fwd_attn",
                                                   clocks_mhz=(1410, 1100))}
    return points, sequential


def _at(points, clock, slot=None):
    return [p for p in points if p["clock_mhz"] == clock and (slot is None or p["launch_slot"] == slot)]


def _best(points, key="energy_j"):
    return min(points, key=lambda p: p[key])


def test_too_few_sms_expose_the_collective_and_too_many_slow_compute(fwd_attn_study) -> None:
    points, _ = fwd_attn_study
    linear = {p["comm_sms"]: p for p in _at(points, 1410, "linear_0")}
    best = _best(linear.values())
    assert linear[2]["exposed_comm_s"] > 0
    assert linear[2]["time_s"] > _best(linear.values(), "time_s")["time_s"]
    assert 3 <= best["comm_sms"] <= 10
    assert any(linear[k]["energy_j"] <= 1.005 * best["energy_j"] for k in range(3, 9))
    assert linear[20]["time_s"] > best["time_s"] and linear[20]["energy_j"] > best["energy_j"]


def test_launching_beside_the_norm_loses_to_hbm_contention(fwd_attn_study) -> None:
    points, _ = fwd_attn_study
    assert _best(_at(points, 1410, "norm_0"))["energy_j"] > _best(_at(points, 1410, "linear_0"))["energy_j"]


def test_at_1100_mhz_the_best_launch_is_late(fwd_attn_study) -> None:
    points, _ = fwd_attn_study
    everything = _at(points, 1100)
    optimum = _best(everything)
    assert optimum["launch_slot"] in ("linear_0", "rope_0", "attn_0")
    # The paper measured rope_0 as the optimum; the model puts it within 0.6 % (held-out table).
    assert _best(_at(points, 1100, "rope_0"))["energy_j"] <= 1.006 * optimum["energy_j"]
    assert _best(_at(points, 1100, "norm_0"))["energy_j"] > optimum["energy_j"]
    worst = max(everything, key=lambda p: p["energy_j"])
    # The paper's schedules differ up to 3.29x; the fitted model's spread is ~1.4x (held-out table:
    # exposed collectives draw too little power here to make the worst schedules that costly).
    assert worst["energy_j"] / optimum["energy_j"] > 1.35


@pytest.mark.parametrize("clock", [1410, 1100])
def test_best_overlap_beats_sequential_execution(fwd_attn_study, clock) -> None:
    points, sequential = fwd_attn_study
    best = _best(_at(points, clock))
    assert best["time_s"] < sequential[clock]["time_s"]
    assert best["energy_j"] < sequential[clock]["energy_j"]


def test_lower_clock_trades_time_for_energy(fwd_attn_study) -> None:
    points, _ = fwd_attn_study
    fast, slow = _best(_at(points, 1410)), _best(_at(points, 1100))
    assert slow["energy_j"] < 0.85 * fast["energy_j"] and slow["time_s"] > fast["time_s"]
    assert fast["throttled"] and not slow["throttled"]


# -- Theorem 1 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemm_layer():
    return layer_sequential_forward(LayerDims(get_preset("qwen3-1.7b"), tp=8, cp=1, batch=4, seq_local=2048))


@settings(max_examples=30, deadline=None)
@given(mean=st.integers(700, 1340), wobble=st.integers(1, 60))
def test_theorem1_a_wobbling_clock_never_saves_energy(gemm_layer, mean, wobble) -> None:
    simulator = Simulator(A100)
    locked = simulator.sequential(gemm_layer, mean)
    wobbling = simulator.sequential(gemm_layer, mean, wobble_mhz=wobble)
    if locked.throttled or wobbling.throttled:
        return  # the power controller, not the wobble, sets the clock there
    assert wobbling.time_s == pytest.approx(locked.time_s, rel=1e-12)
    assert wobbling.energy_j >= locked.energy_j * (1 - 1e-12)
    knee = A100.voltage_floor_mhz
    if mean - wobble < knee < mean + wobble:
        assert wobbling.energy_j > locked.energy_j * (1 + 1e-6)
    if mean + wobble <= knee:  # V flat below the floor: f·V² is linear, the wobble costs nothing
        assert wobbling.energy_j == pytest.approx(locked.energy_j, rel=1e-9)


def test_theorem1_knee_crossing_is_strict() -> None:
    simulator = Simulator(A100)
    ops = layer_sequential_forward(LayerDims(LLAMA3B, tp=4, cp=1, batch=4, seq_local=4096))
    knee = A100.voltage_floor_mhz
    locked = simulator.sequential(ops, knee)
    crossing = simulator.sequential(ops, knee, wobble_mhz=90)
    below = simulator.sequential(ops, knee - 150, wobble_mhz=90)
    assert crossing.time_s == pytest.approx(locked.time_s)
    assert crossing.dynamic_energy_j > locked.dynamic_energy_j * 1.001
    assert below.energy_j == pytest.approx(simulator.sequential(ops, knee - 150).energy_j, rel=1e-9)


def test_locking_at_the_throttled_mean_is_as_fast_and_cheaper() -> None:
    """The paper's §6.2.1 observation: overlap "at 1410 MHz" throttles to ~1350 MHz on average;
    the same schedule locked at 1350 MHz is about as fast and uses less energy. The fitted model
    throttles this partition's GEMM phases to ~1300 MHz on average (fit table: −3.9 %), and a lock
    below 1410 MHz still leaves them power-limited, so the lock buys energy for ~1 % of time."""
    simulator = Simulator(A100)
    workload = build_workload(get_preset("qwen3-1.7b"), tp=8, cp=1, pp=2, seq_len=4096, micro_batch_size=8)
    ptype = workload.partition_types["fwd_mlp"]
    requested = simulator.partition(ptype, 1410, 6, "linear_0")
    assert requested.throttled and 1270 < requested.avg_clock_mhz < 1380
    near = simulator.partition(ptype, 1380, 6, "linear_0")
    assert near.time_s <= requested.time_s * 1.01 and near.energy_j < requested.energy_j * 0.995
    locked = simulator.partition(ptype, 1350, 6, "linear_0")
    assert locked.time_s <= requested.time_s * 1.015
    assert locked.energy_j < requested.energy_j * 0.99


def test_megatron_throughput_is_near_the_papers_99_tflops() -> None:
    """Table 1's setup (Qwen3 1.7B, 16 A100s, CP2·TP4·PP2, mbs 8, seq 4096): Megatron-LM reaches
    ~99 TFLOP/s of model FLOPs per GPU. Steady-state 1F1B throughput (bubble excluded): the slowest
    stage's forward + backward (with recompute) per microbatch."""
    shape = get_preset("qwen3-1.7b")
    workload = build_workload(shape, tp=4, cp=2, pp=2, seq_len=4096, micro_batch_size=8)
    simulator = Simulator(A100)
    tokens = 8 * 4096
    h = shape.hidden_size
    layer = h * (shape.q_size + 2 * shape.kv_size) + shape.q_size * h + 3 * h * shape.ffn_hidden_size
    attention = 2 * 2 * tokens * 4096 / 2 * shape.q_size * shape.num_layers
    model_flops = 6 * layer * shape.num_layers * tokens + 6 * h * shape.vocab_size * tokens + 3 * attention
    stage_s = max(simulator.instruction(stage, "forward", 1410, None).time_s
                  + simulator.instruction(stage, "backward", 1410, None).time_s for stage in workload.stages)
    tflops_per_gpu = model_flops / stage_s / 16 / 1e12
    assert 80 <= tflops_per_gpu <= 120


@pytest.mark.parametrize("model,mbs,seq,partitioned_wins", [
    ("llama3.2-3b", 8, 4096, True),   # big GEMMs: hiding the all-reduces pays
    ("qwen3-1.7b", 2, 1024, False),   # small work: halving it costs efficiency and launches
    ("tiny", 2, 64, False),
])
def test_splitting_small_microbatches_loses(model, mbs, seq, partitioned_wins) -> None:
    """DESIGN §2.2: sequential execution stays a candidate because nanobatching small work loses."""
    simulator = Simulator(A100)
    workload = build_workload(get_preset(model), tp=8 if model != "tiny" else 2, cp=1, pp=1, seq_len=seq,
                              micro_batch_size=mbs)
    best = {name: min(((slot, sms) for slot in p.launch_slots for sms in p.comm_sms_grid),
                      key=lambda c, p=p: simulator.partition(p, 1410, c[1], c[0]).energy_j)
            for name, p in workload.partition_types.items()}
    stage = workload.stages[0]
    partitioned = simulator.instruction(stage, "forward", 1410, best)
    sequential = simulator.instruction(stage, "forward", 1410, None)
    assert (partitioned.energy_j < sequential.energy_j) is partitioned_wins


@pytest.mark.parametrize("clock", [1410, 1100])
def test_single_layer_study_against_the_paper(fwd_attn_study, simulator, clock) -> None:
    """§3.3: the energy-optimal overlapped schedule at 1410 MHz beats sequential execution by
    24.3 % energy and 12.3 % time. Time must be within the ±5-point window. Energy is held to the
    bound physics puts on it rather than to the paper's number (which the model misses, held-out
    table): compute's dynamic energy per cycle does not depend on the schedule, only on the voltage
    it runs at (the paper's own premise, at a fixed clock), so overlap can save at most static power
    over the time it saves, the whole dynamic energy of sequential execution's exposed collective,
    and what a lower voltage takes off compute's dynamic energy:

        saved <= P_static * dT + E_exposed_dynamic + (1 - V_low^2 / V_seq^2) * E_compute_dynamic,

    V_low the voltage of the overlapped run's lowest clock (its throttled mean less the controller's
    dither), V_seq that of sequential's clock (equal when neither throttles). Copy interference
    only adds to the overlapped schedule's energy (docs/simulator.md)."""
    points, sequential = fwd_attn_study
    best = _best(_at(points, clock))
    seq = sequential[clock]
    time_reduction = 1 - best["time_s"] / seq["time_s"]
    energy_reduction = 1 - best["energy_j"] / seq["energy_j"]
    if clock == 1410:
        assert 0.07 <= time_reduction <= 0.18
    workload = build_workload(LLAMA3B, tp=4, cp=1, pp=1, seq_len=4096, micro_batch_size=8)
    comm = workload.partition_types["fwd_attn"].comm.scaled(2.0)  # sequential runs the microbatch's collective
    exposed = simulator.sequential([comm], clock).times(0.5)  # per nanobatch, as the study reports
    assert exposed.time_s == pytest.approx(seq["exposed_comm_s"], rel=1e-6)  # the same phase
    gpu = simulator.gpu
    low_mhz = best["avg_clock_mhz"] - (simulator.params.throttle_wobble_mhz if best["throttled"] else 0.0)
    voltage_ratio = (gpu.voltage_ratio(low_mhz) / gpu.voltage_ratio(seq["avg_clock_mhz"])) ** 2
    compute_dynamic_j = seq["dynamic_energy_j"] - exposed.dynamic_energy_j
    saved_bound_j = (simulator.p_static_w * (seq["time_s"] - best["time_s"]) + exposed.dynamic_energy_j
                     + max(0.0, 1 - voltage_ratio) * compute_dynamic_j)
    assert (0.05 if clock == 1410 else 0.0) < energy_reduction <= saved_bound_j / seq["energy_j"]


@pytest.mark.parametrize("model,tp,cp,slower", [
    ("qwen3-1.7b", 4, 2, True),    # the paper's fallback: nanobatching slows computation there
    ("llama3.2-3b", 8, 1, False),  # big GEMMs: hiding the all-reduces pays
])
def test_plain_nanobatching_loses_only_where_the_paper_falls_back(model, tp, cp, slower) -> None:
    simulator = Simulator(A100)
    workload = build_workload(get_preset(model), tp=tp, cp=cp, pp=2, seq_len=4096, micro_batch_size=8)
    stage = workload.stages[0]
    configs = {name: p.default_config() for name, p in workload.partition_types.items()}
    split = sum(simulator.instruction(stage, d, 1410, configs).time_s for d in ("forward", "backward"))
    whole = sum(simulator.instruction(stage, d, 1410, None).time_s for d in ("forward", "backward"))
    assert (split > whole) is slower
