"""The partitioned overlap engine in one process: structure, issue order, manual backward."""

from __future__ import annotations

import pytest
import torch

from kareus.errors import KareusError
from kareus.runtime import Schedule, TrainConfig, run_rank
from kareus.runtime.comm import CommHandle, GroupComm
from kareus.runtime.engine import PartitionedBlock, backward_segments, forward_segments, partitions_of
from kareus.runtime.layer_ops import LayerProgram, rope_tables
from kareus.runtime.model import StageLayout, StageModel, shard
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import Layout, init_distributed
from kareus.runtime.schedule import RunInstruction
from kareus.workload.models import ModelShape, get_preset
from kareus.workload.partitions import PartitionConfig, build_workload

torch.set_num_threads(1)
TINY = get_preset("tiny")
# Exercises q/k norm, tied embeddings and grouped-query attention in one small model.
QWENISH = ModelShape("qwenish", 3, 32, 48, 4, 2, 8, 256, qk_norm=True, tied_embeddings=True, rope_theta=10000.0)


@pytest.mark.parametrize("cp", [1, 2], ids=["tp", "cp+tp"])
def test_segments_match_the_workload_partition_types(cp):
    """The executed op runs and slot names are the ones the planner optimises."""
    workload = build_workload(TINY, tp=2, cp=cp, pp=1, seq_len=16, micro_batch_size=2)
    program = LayerProgram.llama(TINY.qk_norm)
    executed = {}
    for segment in forward_segments(program, range(4), cp) + backward_segments(program, range(4), cp):
        for key in segment.keys:
            if len(segment.steps) > len(executed.get(key, segment).steps) or key not in executed:
                executed[key] = segment
    assert set(executed) == set(workload.partition_types) | {"fwd_trail", "bwd_trail"}
    for name, ptype in workload.partition_types.items():
        ops = [s.op.name for s in executed[name].steps]
        assert ops == [op.name.removesuffix("_bwd") for op in ptype.compute_ops], name
        assert executed[name].slots == ptype.slots, name
        for slot in ptype.launch_slots:
            assert executed[name].slot_index(slot) == ptype.slot_op_index(slot)


def test_partitions_pair_each_comm_with_the_other_nanobatch():
    program = LayerProgram.llama(False)
    segments = forward_segments(program, range(2))
    parts = partitions_of(segments)
    assert [p.key for p in parts] == ["fwd_attn", "fwd_attn", "fwd_mlp", "fwd_mlp"] * 2 + ["fwd_trail"] * 2
    assert (parts[0].comm_nb, parts[1].comm_nb) == (None, 0)
    for p in parts[1:-1]:
        assert p.comm_nb == 1 - p.nb
    assert parts[-1].comm_nb is None  # nothing follows the last BDA
    # every segment's all-reduce is carried exactly once per nanobatch
    carried = sorted((p.comm_nb, p.comm_segment) for p in parts if p.comm_nb is not None)
    assert carried == sorted((nb, s) for s in range(len(segments) - 1) for nb in (0, 1))


class _OrderComm(GroupComm):
    """Pretends to be a 2-rank group; records launches and joins without reducing anything."""

    def __init__(self, log: list) -> None:
        super().__init__(None, 2)
        self.log = log

    def launch_all_reduce(self, tensor, comm_sms=None, finish=None):
        self.log.append(("launch", comm_sms))
        log = self.log

        class _Handle(CommHandle):
            def join(self) -> None:
                log.append(("join",))

        return _Handle(tensor, None)


@pytest.mark.parametrize("key,slot", [("fwd_attn", s) for s in ("norm_0", "linear_0", "rope_0", "attn_0")]
                         + [("fwd_mlp", s) for s in ("norm_0", "linear_0", "activation_0")]
                         + [("bwd_attn", s) for s in ("norm_0", "linear_0", "attn_0", "rope_0")]
                         + [("bwd_mlp", s) for s in ("norm_0", "linear_0", "activation_0")])
def test_collective_is_issued_right_before_the_launch_slot(key, slot):
    log: list = []
    model = StageModel(TINY, StageLayout.of(0, (2,)), tp=1)
    block = PartitionedBlock(model, _OrderComm(log), dict(zip(("rope_cos", "rope_sin"), rope_tables(8, 16, 1e4),
                                                                strict=True)))
    block.trace = []
    config = PartitionConfig(slot, 7)
    x = torch.randn(2, 8, TINY.hidden_size)
    _, states = block.forward(x, {key: config} if key.startswith("fwd") else {}, record=True)
    block.backward(states, torch.randn_like(x), {key: config} if key.startswith("bwd") else {})
    forward = key.startswith("fwd")
    segments = block.fwd_segments if forward else block.bwd_segments
    events = block.trace
    checked = 0
    for i, (event, is_forward, segment, nb, index) in enumerate(events):
        if event == "comm" and is_forward == forward and segments[segment].keys[nb] == key:
            assert segments[segment].slots[index] == slot
            assert events[i + 1] == ("op", forward, segment, nb, index)  # the slot's op runs right after
            assert index == 0 or events[i - 1] == ("op", forward, segment, nb, index - 1)
            checked += 1
    assert checked >= 2
    assert ("launch", 7) in log and log.count(("join",)) == sum(1 for e in log if e[0] == "launch")


def _run(shape, schedule, *, ac=True, steps=3, mbs=2, m=2, seed=3):
    config = TrainConfig(shape=shape, seq_len=16, micro_batch_size=mbs, num_microbatches=m, steps=steps, seed=seed,
                         recipe=OptimizerRecipe.constant("sgd", 0.5), activation_checkpointing=ac)
    ctx = init_distributed(config.layout, device="cpu")
    result, model = run_rank(ctx, config, schedule, keep_model=True)
    return result, {n: p.detach().clone() for n, p in model.named_model_params().items()}


@pytest.mark.parametrize("ac", [True, False])
def test_manual_backward_matches_autograd(ac):
    """Partitioned (op-by-op backward) == sequential (autograd), losses and parameter updates."""
    seq, seq_params = _run(QWENISH, Schedule.uniform(1, 2, mode="sequential"), ac=ac)
    part, part_params = _run(QWENISH, Schedule.uniform(1, 2, mode="partitioned"), ac=ac)
    torch.testing.assert_close(torch.tensor(part.losses), torch.tensor(seq.losses), rtol=1e-5, atol=0)
    init = StageModel(QWENISH, StageLayout.of(0, (3,)), seed=3).named_model_params()
    for name, value in seq_params.items():
        assert not torch.equal(value, init[name].detach()), f"{name} was not trained"
        torch.testing.assert_close(part_params[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_mixed_modes_per_microbatch():
    base = Schedule.uniform(1, 2, mode="partitioned")
    mixed = Schedule((tuple(i if i.microbatch == 0 else type(i)(i.kind, i.microbatch, mode="sequential")
                            for i in base.stages[0]),), 2)
    assert {i.mode for i in mixed.stages[0]} == {"partitioned", "sequential"}
    ref, _ = _run(QWENISH, Schedule.uniform(1, 2, mode="sequential"), steps=2)
    got, _ = _run(QWENISH, mixed, steps=2)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)


def test_initialisation_is_layout_independent():
    full = StageModel(TINY, StageLayout.of(0, (4,)), seed=11).named_model_params()
    for tp_rank in range(2):
        stage1 = StageModel(TINY, StageLayout.of(1, (2, 2)), tp=2, tp_rank=tp_rank, seed=11).named_model_params()
        assert "layers.2.qkv" in stage1 and "layers.1.qkv" not in stage1 and "embedding" not in stage1
        for name, value in stage1.items():
            torch.testing.assert_close(value, shard(name, full[name].detach(), TINY, tp_rank, 2), rtol=0, atol=0)


def test_tensor_parallel_must_divide_heads():
    with pytest.raises(KareusError, match="not divisible by tensor parallelism 3"):
        StageModel(TINY, StageLayout.of(0, (4,)), tp=3)


def test_odd_microbatch_needs_sequential_schedule():
    with pytest.raises(KareusError, match="microBatchSize must be even"):
        _run(TINY, Schedule.uniform(1, 1), mbs=3, m=1)
    result, _ = _run(TINY, Schedule.uniform(1, 1, mode="sequential"), mbs=3, m=1, steps=1)
    assert len(result.losses) == 1


def test_layout_coordinates_round_trip():
    layout = Layout(tp=2, pp=2, dp=2)
    for rank in range(layout.world_size):
        assert layout.rank_of(*layout.coords(rank)) == rank
    assert layout.tp_groups()[0] == (0, 1) and layout.grad_groups()[0] == (0, 4)
    assert layout.end_groups()[0] == (0, 2)
    with_cp = Layout(tp=2, pp=2, dp=1, cp=2)
    assert with_cp.coords(5) == (0, 1, 0, 1)
    assert with_cp.cp_groups()[0] == (0, 2) and with_cp.grad_groups()[0] == (0, 2)
    assert with_cp.tp_groups()[1] == (2, 3) and with_cp.end_groups()[0] == (0, 4)


def test_torchrun_world_size_must_match_the_layout(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(KareusError, match=r"WORLD_SIZE is 3 but the job needs tensor×context×pipeline×data = 2×1×1×1 = 2"):
        init_distributed(Layout(tp=2), device="cpu")


@pytest.mark.parametrize("configs,message", [
    ({"fwd_attn": PartitionConfig("attn_1", 3)}, r"fwd_attn.launch_slot: 'attn_1'.*allowed: norm_0, linear_0, "
                                                    r"rope_0, attn_0, linear_1"),
    ({"bwd_mlp": PartitionConfig("norm_0", 3)}, r"partition type 'bwd_mlp' is not run here"),
    ({"fwd_mlp": PartitionConfig("norm_0", 0)}, r"fwd_mlp.comm_sms: must be an integer >= 1"),
])
def test_schedule_configs_are_checked_against_the_executed_partitions(configs, message):
    bad = Schedule(((RunInstruction("forward", 0, configs=configs), RunInstruction("backward", 0)),), 1)
    with pytest.raises(KareusError, match=message):
        _run(TINY, bad, m=1, steps=1)


def _naive_llama_loss(p: dict, shape: ModelShape, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A textbook Llama forward (explicit softmax attention, repeated K/V heads), independent of the
    runtime's op functions, for checking them."""
    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + shape.norm_eps) * w

    def rotate(x, cos, sin):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)

    b, s = tokens.shape
    hd, nh, nkv = shape.head_dim, shape.num_heads, shape.num_kv_heads
    inv = 1.0 / shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = angles.cos(), angles.sin()
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    x = p["embedding"][tokens]
    for i in range(shape.num_layers):
        w = {k.split(".")[-1]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        q, k, v = (norm(x, w["norm_attn"]) @ w["qkv"].T).split((nh * hd, nkv * hd, nkv * hd), -1)
        q, k, v = (t.reshape(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
        if shape.qk_norm:
            q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = (q @ k.transpose(-1, -2) / hd ** 0.5).masked_fill(causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, nh * hd)
        x = x + attn @ w["proj"].T
        gate, up = (norm(x, w["norm_mlp"]) @ w["fc1"].T).chunk(2, -1)
        x = x + (gate * torch.sigmoid(gate) * up) @ w["fc2"].T
    out = p["embedding"] if shape.tied_embeddings else p["output"]
    logits = norm(x, p["final_norm"]) @ out.T
    return torch.nn.functional.cross_entropy(logits.reshape(b * s, -1), targets.reshape(-1))


@pytest.mark.parametrize("shape", [TINY, QWENISH], ids=["tiny", "qknorm-tied"])
def test_model_is_a_textbook_llama_in_both_modes(shape):
    """Loss and every parameter gradient (float64) equal an independent plain implementation."""
    from kareus.runtime.engine import SequentialBlock

    model = StageModel(shape, StageLayout.of(0, (shape.num_layers,)), seed=4, dtype=torch.float64)
    params = model.named_model_params()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (4, 12), generator=generator)
    targets = torch.randint(0, shape.vocab_size, (4, 12), generator=generator)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    reference = _naive_llama_loss(leaves, shape, tokens, targets)
    reference.backward()
    consts = dict(zip(("rope_cos", "rope_sin"),
                      rope_tables(12, shape.head_dim, shape.rope_theta, dtype=torch.float64), strict=True))
    scale = 1.0 / tokens.numel()
    for mode in ("sequential", "partitioned"):
        model.zero_grad(set_to_none=True)
        x = model.embed(tokens)
        if mode == "sequential":
            loss = model.head_loss(SequentialBlock(model, GroupComm(None, 1), consts).forward(x), targets, scale)
            loss.backward()
        else:
            block = PartitionedBlock(model, GroupComm(None, 1), consts)
            y, states = block.forward(x.detach(), {}, record=True)
            y = y.requires_grad_()
            loss = model.head_loss(y, targets, scale)
            loss.backward()
            x.backward(block.backward(states, y.grad, {}))
        torch.testing.assert_close(loss, reference, rtol=1e-12, atol=0)
        for name, p in params.items():
            torch.testing.assert_close(p.grad, leaves[name].grad, rtol=1e-9, atol=1e-13, msg=f"{mode}: {name}")
