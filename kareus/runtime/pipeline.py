"""One pipeline stage executing its instructions for one iteration.

The stage walks its instruction list through a `PlanFollower` (clock requests ahead, configs of
the running instruction). A forward receives its activation from the previous stage (or embeds
the tokens), runs the block in the instruction's mode and sends the result on (or computes the
loss); a backward receives the output gradient (or differentiates the loss), runs the block
backward and sends the input gradient back (or finishes in the embedding). Point to point goes
through a `StageLink` (`kareus.runtime.p2p`): a send leaves together with the next instruction's
receive from the same peer (one batched group, as Megatron-Core's `send_forward_recv_backward`),
so the 1F1B steady state cannot deadlock on NCCL; sends are awaited at the end of the iteration.
The loss stays on the device until the iteration ends (one host sync per step, not per microbatch).

Activation checkpointing (`CHECKPOINTING`): `layer` (what `activation_checkpointing=True` means)
keeps each layer's input, one [mbs, seq, hidden] tensor per layer, and the backward walks the layers
in reverse: recompute one layer from its input (partitioned: with the instruction's recompute
configs), differentiate it, drop it, go on — Megatron's and torchtitan's per-layer (full)
recompute: the backward's peak is the layer inputs plus one layer's activations. `stage` keeps only
the stage input and recomputes the whole stage before its backward (at PP1 that saves nothing: the
whole stage's activations are alive again). Both recompute one forward of every layer (the same
FLOPs, which is what the simulator's op graph prices as `recompute_instances`). `none`: the forward
keeps op records (partitioned) or the autograd graph (sequential), and the backward uses the
forward's mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime.comm import GroupComm
from kareus.runtime.engine import BlockContext, PartitionedBlock, SequentialBlock
from kareus.runtime.follower import PlanFollower
from kareus.runtime.layer_ops import sequence_consts
from kareus.runtime.model import StageModel
from kareus.runtime.p2p import StageLink
from kareus.runtime.parallel import DistContext
from kareus.runtime.schedule import RunInstruction

ACTIVATION_TAG = 1
GRADIENT_TAG = 2
CHECKPOINTING = ("none", "stage", "layer")


def checkpointing_mode(value: bool | str) -> str:
    """`True`/`False` are `layer`/`none`; else one of `CHECKPOINTING`."""
    if isinstance(value, bool):
        return "layer" if value else "none"
    if value not in CHECKPOINTING:
        raise KareusError(f"activation_checkpointing: {value!r} is not allowed; allowed: true, false, "
                          f"{', '.join(CHECKPOINTING)}", exit_code=EXIT_CONFIG)
    return value


@dataclass
class _Microbatch:
    tokens: Tensor
    targets: Tensor
    block: BlockContext | None = None
    embedded: Tensor | None = None  # first stage: embedding output with its graph
    head_input: Tensor | None = None  # last stage: block output leaf
    loss: Tensor | None = None


@dataclass
class StageExecutor:
    """Runs one stage's instructions. `seq_len` is the whole sequence; with context parallelism
    (`cp` > 1) this rank holds chunk `dist_ctx.cp_rank` of it."""

    model: StageModel
    dist_ctx: DistContext
    tp: GroupComm
    follower: PlanFollower
    seq_len: int
    micro_batch_size: int
    activation_checkpointing: bool | str = True  # see `checkpointing_mode`
    cp: GroupComm | None = None

    def __post_init__(self) -> None:
        shape = self.model.shape
        device = self.dist_ctx.device
        dtype = next(iter(self.model.parameters())).dtype
        cp = self.cp.size if self.cp else 1
        consts = sequence_consts(self.seq_len, cp, self.dist_ctx.cp_rank, shape.head_dim, shape.rope_theta, device,
                                 dtype, shape.rope_scaling)
        self.checkpointing = checkpointing_mode(self.activation_checkpointing)
        self.partitioned = PartitionedBlock(self.model, self.tp, consts, self.cp)
        self.layer_blocks = {layer: PartitionedBlock(self.model, self.tp, consts, self.cp, range(layer, layer + 1))
                             for layer in self.model.layout.layers} if self.checkpointing == "layer" else {}
        self.sequential = SequentialBlock(self.model, self.tp, consts, self.cp)
        activation_shape = (self.micro_batch_size, self.seq_len // cp, shape.hidden_size)
        self.link = StageLink(activation_shape, dtype, device)
        self.check_instructions(self.follower.instructions)

    def check_instructions(self, instructions: tuple[RunInstruction, ...]) -> None:
        """Raise `KareusError` unless this stage can run `instructions` (partition configs)."""
        for ins in instructions:
            where = f"schedule stage {self.follower.stage} {ins.kind} of microbatch {ins.microbatch}"
            self.partitioned.check_configs(ins.configs, forward=ins.kind == "forward", where=f"{where}: configs")
            self.partitioned.check_configs(ins.recompute_configs, forward=True, where=f"{where}: recompute_configs")

    def switch(self, instructions: tuple[RunInstruction, ...]) -> None:
        """Run `instructions` from the next iteration on (checked first)."""
        self.check_instructions(instructions)
        self.follower.switch(instructions)

    def run(self, batches: list[tuple[Tensor, Tensor]], loss_scale: float, step: int | None = None) -> float:
        """One iteration; returns the sum of this stage's (scaled) microbatch losses (0 if not last)."""
        mbs = [_Microbatch(tokens, targets) for tokens, targets in batches]
        self.follower.on_step_begin(step)
        losses: list[Tensor] = []
        for ins in self.follower.instructions:
            self.follower.on_instruction_begin(ins.kind, ins.microbatch)
            if ins.kind == "forward":
                self._forward(ins, mbs[ins.microbatch], loss_scale)
            else:
                loss = self._backward(ins, mbs[ins.microbatch])
                if loss is not None:
                    losses.append(loss)
            self.follower.on_instruction_end(ins.kind)
        self.link.finish()
        return float(torch.stack(losses).double().sum()) if losses else 0.0  # the step's only host sync

    # forward -----------------------------------------------------------------------------------
    def _forward(self, ins: RunInstruction, mb: _Microbatch, loss_scale: float) -> None:
        layout = self.model.layout
        if layout.is_first:
            mb.embedded = self.model.embed(mb.tokens)
            x = mb.embedded.detach()
        else:
            x = self.link.receive(self.dist_ctx.neighbour(-1), ACTIVATION_TAG)
        y = self._block_forward(ins, x, mb)
        if layout.is_last:
            mb.head_input = y.detach().requires_grad_()
            mb.loss = self.model.head_loss(mb.head_input, mb.targets, loss_scale)
        else:
            self.link.send(y, self.dist_ctx.neighbour(1), ACTIVATION_TAG)

    def _block_forward(self, ins: RunInstruction, x: Tensor, mb: _Microbatch) -> Tensor:
        if self.checkpointing == "layer":
            return self._layers_forward(ins, x, mb)
        keep = self.checkpointing == "none"
        if ins.mode == "partitioned":
            y, states = self.partitioned.forward(x, ins.configs, record=keep)
            mb.block = BlockContext("partitioned", (x,), tuple(states) if keep else ())
            return y
        if keep:
            leaf = x.detach().requires_grad_()
            with torch.enable_grad():
                out = self.sequential.forward(leaf)
            mb.block = BlockContext("sequential", (leaf,), output=out)
            return out.detach()
        with torch.no_grad():
            y = self.sequential.forward(x)
        mb.block = BlockContext("sequential", (x,))
        return y

    # backward ----------------------------------------------------------------------------------
    def _backward(self, ins: RunInstruction, mb: _Microbatch) -> Tensor | None:
        """Returns the (scaled) microbatch loss on the last stage, still on the device."""
        layout = self.model.layout
        loss_value = None
        if layout.is_last:
            mb.loss.backward()
            loss_value = mb.loss.detach()
            grad_y = mb.head_input.grad
        else:
            grad_y = self.link.receive(self.dist_ctx.neighbour(1), GRADIENT_TAG)
        grad_x = self._block_backward(ins, mb.block, grad_y)
        if layout.is_first:
            mb.embedded.backward(grad_x)
        else:
            self.link.send(grad_x, self.dist_ctx.neighbour(-1), GRADIENT_TAG)
        mb.block = mb.embedded = mb.head_input = mb.loss = None
        return loss_value

    def _layers_forward(self, ins: RunInstruction, x: Tensor, mb: _Microbatch) -> Tensor:
        """Layer checkpointing: run layer by layer without records or graph, keep each layer's input."""
        inputs = []
        for layer in self.model.layout.layers:
            inputs.append(x)
            if ins.mode == "partitioned":
                x, _ = self.layer_blocks[layer].forward(x, ins.configs, record=False)
            else:
                with torch.no_grad():
                    x = self.sequential.forward(x, range(layer, layer + 1))
        mb.block = BlockContext(ins.mode, tuple(inputs))
        return x

    def _layers_backward(self, ins: RunInstruction, block: BlockContext, grad_y: Tensor) -> Tensor:
        """Recompute and differentiate one layer at a time, last first; each input is dropped once used."""
        inputs = list(block.inputs)
        block.inputs = ()
        grad = grad_y
        for layer in reversed(self.model.layout.layers):
            x = inputs.pop()
            if ins.mode == "partitioned":
                _, states = self.layer_blocks[layer].forward(x, ins.recompute_configs, record=True)
                grad = self.layer_blocks[layer].backward(states, grad, ins.configs)
            else:
                leaf = x.detach().requires_grad_()
                with torch.enable_grad():
                    out = self.sequential.forward(leaf, range(layer, layer + 1))
                torch.autograd.backward(out, grad)
                grad = leaf.grad
        return grad

    def _block_backward(self, ins: RunInstruction, block: BlockContext, grad_y: Tensor) -> Tensor:
        if self.checkpointing == "layer":
            return self._layers_backward(ins, block, grad_y)
        if self.checkpointing == "stage":
            x = block.inputs[0]
            if ins.mode == "partitioned":
                _, states = self.partitioned.forward(x, ins.recompute_configs, record=True)
                return self.partitioned.backward(states, grad_y, ins.configs)
            leaf = x.detach().requires_grad_()
            with torch.enable_grad():
                out = self.sequential.forward(leaf)
            torch.autograd.backward(out, grad_y)
            return leaf.grad
        if block.mode == "partitioned":
            return self.partitioned.backward(list(block.states), grad_y, ins.configs)
        torch.autograd.backward(block.output, grad_y)
        return block.inputs[0].grad
