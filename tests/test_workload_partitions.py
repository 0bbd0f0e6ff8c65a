"""The op graph, partition types, instances and stage split of `kareus.workload`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.errors import KareusError
from kareus.workload.models import PRESETS, get_preset
from kareus.workload.ops import CommOp, ComputeOp
from kareus.workload.partitions import (
    PartitionConfig,
    build_workload,
    split_layers,
)

LLAMA3B = get_preset("llama3.2-3b")


def layer_params(shape) -> int:
    """Weights of one Llama layer (attention + SwiGLU MLP; norms are negligible)."""
    h = shape.hidden_size
    return h * (shape.q_size + 2 * shape.kv_size) + shape.q_size * h + 3 * h * shape.ffn_hidden_size


def gemm_flops(ops) -> float:
    return sum(op.flops for op in ops if isinstance(op, ComputeOp) and op.kind == "gemm")


def partition_flops(workload, stage, direction, kind="gemm") -> float:
    total = 0.0
    for name, count in stage.instances(direction).items():
        ptype = workload.partition_types[name]
        total += count * sum(op.flops for op in ptype.compute_ops if op.kind == kind)
    return total


def test_tp_only_partition_types_and_slots() -> None:
    workload = build_workload(LLAMA3B, tp=4, cp=1, pp=2, seq_len=4096, micro_batch_size=8)
    types = workload.partition_types
    assert list(types) == ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    expected = {
        "fwd_attn": (("norm_0", "linear_0", "rope_0", "attn_0"), ("norm_0", "norm_0", "norm_0", "linear_0",
                                                                  "rope_0", "rope_0", "attn_0", "linear_1")),
        "fwd_mlp": (("norm_0", "linear_0", "activation_0"),
                    ("norm_0", "norm_0", "norm_0", "linear_0", "activation_0", "linear_1")),
        "bwd_mlp": (("norm_0", "linear_0", "activation_0"),
                    ("norm_0", "norm_0", "norm_0", "linear_0", "activation_0", "linear_1")),
        "bwd_attn": (("norm_0", "linear_0", "attn_0", "rope_0"), ("norm_0", "norm_0", "norm_0", "linear_0",
                                                                  "attn_0", "rope_0", "rope_0", "linear_1")),
    }
    for name, (launch, slots) in expected.items():
        ptype = types[name]
        assert ptype.launch_slots == launch and ptype.slots == slots
        assert ptype.comm.collective == "all_reduce" and ptype.comm.group == "tp" and ptype.comm.group_size == 4
        assert ptype.comm_sms_grid == (3, 6, 9, 12, 15, 18, 21, 24, 27, 30)
        assert ptype.size_class == "large"
    # Every linear and attention op is its own slot; a slot's index is its first op.
    assert types["fwd_attn"].slot_op_index("linear_0") == 3
    assert types["fwd_attn"].slot_op_index("rope_0") == 4
    assert types["fwd_attn"].slot_op_index("attn_0") == 6
    assert [op.name for op in types["bwd_attn"].compute_ops][-1] == "qkv_bwd"
    assert all(op.backward for op in types["bwd_mlp"].compute_ops)
    with pytest.raises(KareusError, match="allowed: norm_0, linear_0, rope_0, attn_0"):
        types["fwd_attn"].slot_op_index("activation_0")
    # Hidden-state all-reduce of one nanobatch: 4 sequences × 4096 tokens × 3072 × bf16.
    assert types["fwd_attn"].comm.payload_bytes == 4 * 4096 * 3072 * 2
    assert types["fwd_attn"].grid_size == 40


def test_cp_tp_has_twelve_types_with_the_artifact_slots() -> None:
    workload = build_workload(get_preset("qwen3-1.7b"), tp=4, cp=2, pp=2, seq_len=4096, micro_batch_size=8)
    expected = {
        "fwd_qkv_ar": ("all_reduce", ("norm_0", "linear_0"), "medium"),
        "fwd_qkv_ag": ("all_gather", ("norm_0", "linear_0", "rope_0"), "medium"),
        "fwd_ao_ag": ("all_gather", ("attn_0", "linear_0"), "small"),
        "fwd_ao_ar": ("all_reduce", ("attn_0",), "small"),
        "fwd_mlp": ("all_reduce", ("norm_0", "linear_0", "activation_0"), "large"),
        "bwd_mlp": ("all_reduce", ("norm_0", "linear_0", "activation_0"), "large"),
        "bwd_o_ar": ("all_reduce", ("norm_0",), "small"),
        "bwd_o_ag": ("all_gather", ("norm_0", "linear_0"), "small"),
        "bwd_a_ag": ("all_gather", ("attn_0",), "small"),
        "bwd_a_rs": ("reduce_scatter", ("attn_0",), "small"),
        "bwd_qkv_rs": ("reduce_scatter", ("rope_0", "linear_0"), "medium"),
        "bwd_qkv_ar": ("all_reduce", ("rope_0", "linear_0"), "medium"),
    }
    assert set(workload.partition_types) == set(expected)
    for name, (collective, slots, size) in expected.items():
        ptype = workload.partition_types[name]
        assert (ptype.comm.collective, ptype.launch_slots, ptype.size_class) == (collective, slots, size)
        small_group = ptype.comm.group == "cp"
        assert ptype.comm.group_size == (2 if small_group else 4)
        assert ptype.comm_sms_grid == (tuple(range(1, 21)) if small_group else tuple(range(3, 31, 3)))
    stage = workload.stages[0]
    assert stage.num_layers == 15
    assert stage.forward_instances == {"fwd_qkv_ar": 15, "fwd_qkv_ag": 15, "fwd_ao_ag": 15, "fwd_ao_ar": 15,
                                       "fwd_mlp": 30}
    assert stage.backward_instances["bwd_mlp"] == 30 and stage.backward_instances["bwd_a_rs"] == 15
    # Qwen3's q/k norm makes the QKV post-process move data; Llama's split is a view.
    assert workload.partition_types["fwd_qkv_ar"].compute_ops[4].hbm_bytes > 0
    llama = build_workload(LLAMA3B, tp=4, cp=2, pp=1, seq_len=4096, micro_batch_size=8)
    assert llama.partition_types["fwd_qkv_ar"].compute_ops[4].hbm_bytes == 0


def test_instances_stage_split_and_nonpartition_work() -> None:
    workload = build_workload(LLAMA3B, tp=8, cp=1, pp=2, seq_len=4096, micro_batch_size=8)
    assert workload.stage_layers == (15, 13)
    first, last = workload.stages
    assert first.forward_instances == {"fwd_attn": 30, "fwd_mlp": 30}
    assert last.backward_instances == {"bwd_mlp": 26, "bwd_attn": 26}
    assert last.recompute_instances == {"fwd_attn": 26, "fwd_mlp": 26}
    assert last.instances("backward") == {"bwd_mlp": 26, "bwd_attn": 26, "fwd_attn": 26, "fwd_mlp": 26}
    assert [op.name for op in first.nonpartition_forward_ops] == ["embedding"]
    assert [op.name for op in last.nonpartition_forward_ops] == ["final_norm", "output", "loss"]
    assert [op.name for op in last.nonpartition_backward_ops] == ["loss_bwd", "output_bwd", "final_norm_bwd"]
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    no_ac = build_workload(LLAMA3B, tp=8, cp=1, pp=2, seq_len=4096, micro_batch_size=8,
                           activation_checkpointing=False)
    assert no_ac.stages[1].recompute_instances == {}
    assert len(no_ac.stages[1].sequential_backward_ops) < len(last.sequential_backward_ops)
    assert workload.nanobatch_size == 4 and workload.tokens_per_microbatch == 8 * 4096
    assert split_layers(80, 10) == (9,) + (8,) * 8 + (7,) and split_layers(32, 3) == (11, 11, 10)
    assert split_layers(28, 1) == (28,) and split_layers(4, 4) == (1, 1, 1, 1)
    custom = build_workload(LLAMA3B, tp=8, cp=1, pp=2, seq_len=4096, micro_batch_size=8, stage_layers=(16, 12))
    assert custom.stages[0].forward_instances["fwd_attn"] == 32


@pytest.mark.parametrize("tp,cp", [(4, 1), (8, 1), (4, 2), (2, 2)])
def test_flops_follow_the_6n_rule_and_sequential_matches_partitions(tp, cp) -> None:
    workload = build_workload(LLAMA3B, tp=tp, cp=cp, pp=1, seq_len=4096, micro_batch_size=8)
    stage = workload.stages[0]
    tokens = workload.micro_batch_size * workload.seq_len  # all GPUs of the TP×CP group together
    n_layers = layer_params(LLAMA3B) * LLAMA3B.num_layers
    forward = partition_flops(workload, stage, "forward") * tp * cp
    assert forward == pytest.approx(2 * n_layers * tokens, rel=1e-9)
    backward_own = sum(count * gemm_flops(workload.partition_types[name].compute_ops)
                       for name, count in stage.backward_instances.items()) * tp * cp
    assert forward + backward_own == pytest.approx(6 * n_layers * tokens, rel=1e-9)
    # Megatron-style op lists carry exactly the same work for a whole microbatch.
    assert gemm_flops(stage.sequential_forward_ops) == pytest.approx(partition_flops(workload, stage, "forward"))
    assert gemm_flops(stage.sequential_backward_ops) == pytest.approx(partition_flops(workload, stage, "backward"))
    attention = partition_flops(workload, stage, "forward", "attention")
    seq_attention = sum(op.flops for op in stage.sequential_forward_ops
                        if isinstance(op, ComputeOp) and op.kind == "attention")
    assert seq_attention == pytest.approx(attention)
    # Causal attention: 2 matmuls × 2 FLOPs × tokens × seq/2 × q, split over TP and CP.
    assert attention * tp * cp == pytest.approx(
        LLAMA3B.num_layers * 2 * 2 * tokens * 4096 / 2 * LLAMA3B.q_size, rel=1e-9)
    # Collective payloads agree too.
    seq_comm = sum(op.ring_bytes_per_gpu for op in stage.sequential_forward_ops if isinstance(op, CommOp))
    part_comm = sum(count * workload.partition_types[name].comm.ring_bytes_per_gpu
                    for name, count in stage.forward_instances.items())
    assert seq_comm == pytest.approx(part_comm)


def test_single_gpu_layout_has_no_partitions() -> None:
    workload = build_workload(get_preset("tiny"), tp=1, cp=1, pp=1, seq_len=64, micro_batch_size=2)
    assert workload.partition_types == {}
    assert workload.stages[0].forward_instances == {}
    assert not any(isinstance(op, CommOp) for op in workload.stages[0].sequential_forward_ops)
    tp2 = build_workload(get_preset("tiny"), tp=2, cp=1, pp=2, seq_len=64, micro_batch_size=2)
    assert tp2.partition_types["fwd_attn"].comm_sms_grid == tuple(range(1, 21))


def test_config_validation_and_default() -> None:
    ptype = build_workload(LLAMA3B, tp=4, cp=1, pp=1, seq_len=4096, micro_batch_size=8).partition_types["fwd_mlp"]
    ptype.validate_config(PartitionConfig("activation_0", 9))
    with pytest.raises(KareusError, match="launch_slot 'linear_1' not allowed"):
        ptype.validate_config(PartitionConfig("linear_1", 9))
    with pytest.raises(KareusError, match=r"comm_sms 4 not allowed; allowed: 3\.\.30 step 3"):
        ptype.validate_config(PartitionConfig("norm_0", 4))
    assert ptype.default_config() == PartitionConfig("norm_0", 30)


@pytest.mark.parametrize("kwargs,message", [
    ({"micro_batch_size": 3}, "micro_batch_size must be even"),
    ({"micro_batch_size": 0}, "micro_batch_size must be an integer >= 1"),
    ({"seq_len": 4095, "cp": 2}, "divisible by context parallelism"),
    ({"cp": 2, "tp": 1}, "context parallelism needs tensor parallelism"),
    ({"pp": 29}, "pipeline parallelism must be in 1..28"),
    ({"pp": 2, "stage_layers": (10, 10)}, "stage_layers must be 2 positive counts summing to 28"),
    ({"tp": True}, "tp must be an integer"),
])
def test_bad_layouts_name_the_field(kwargs, message) -> None:
    base = {"tp": 4, "cp": 1, "pp": 1, "seq_len": 4096, "micro_batch_size": 8}
    with pytest.raises(KareusError, match=message):
        build_workload(LLAMA3B, **{**base, **kwargs})


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 200), pp=st.integers(1, 64))
def test_layer_split_is_balanced_and_front_loaded(layers, pp) -> None:
    if pp > layers:
        with pytest.raises(KareusError):
            split_layers(layers, pp)
        return
    split = split_layers(layers, pp)
    assert sum(split) == layers and len(split) == pp and min(split) >= 1
    # Balanced once the last stage's output layer counts as one more layer.
    with_output = (*split[:-1], split[-1] + 1) if pp > 1 else split
    assert max(with_output) - min(with_output) <= 1 or max(split) - min(split) <= 1
    assert list(split) == sorted(split, reverse=True)


@settings(max_examples=15, deadline=None)
@given(preset=st.sampled_from(sorted(PRESETS)), tp=st.sampled_from([1, 2, 4, 8]), cp=st.sampled_from([1, 2]),
       pp=st.integers(1, 4), half_mbs=st.integers(1, 4), seq_exp=st.integers(6, 12))
def test_any_valid_layout_builds_consistent_workloads(preset, tp, cp, pp, half_mbs, seq_exp) -> None:
    shape = get_preset(preset)
    kwargs = {"tp": tp, "cp": cp, "pp": pp, "seq_len": 2 ** seq_exp, "micro_batch_size": 2 * half_mbs}
    if (cp > 1 and tp == 1) or pp > shape.num_layers:
        with pytest.raises(KareusError):
            build_workload(shape, **kwargs)
        return
    workload = build_workload(shape, **kwargs)
    assert sum(stage.num_layers for stage in workload.stages) == shape.num_layers
    for ptype in workload.partition_types.values():
        assert ptype.launch_slots and set(ptype.launch_slots) <= set(ptype.slots)
        assert all(op.flops >= 0 and op.hbm_bytes >= 0 for op in ptype.compute_ops)
        assert ptype.comm.payload_bytes > 0
        assert min(ptype.comm_sms_grid) >= 1 and max(ptype.comm_sms_grid) <= 30
    for stage in workload.stages:
        per_layer = {name: count / stage.num_layers for name, count in stage.forward_instances.items()}
        assert set(per_layer.values()) <= {1.0, 2.0}
        if workload.partition_types:
            assert partition_flops(workload, stage, "forward") == pytest.approx(
                gemm_flops(stage.sequential_forward_ops))
        else:
            assert stage.forward_instances == {} and gemm_flops(stage.sequential_forward_ops) > 0
