"""Torch stand-ins for a partition's kernels, for measuring on a real GPU without a trainer.

A partition is emulated from its op list: every GEMM or attention op becomes a square bf16 matmul
with the op's FLOPs, every memory-bound op an elementwise add that moves the op's HBM bytes, and
the collective becomes a **copy kernel with k thread blocks of 1024 threads** (≈ k SMs) moving the
collective's payload through HBM — what a ring collective does on each GPU, minus the link. The
copy kernel is written in Triton when Triton is installed (the grid size is the SM knob, as with
a grid-size-controllable collective); without Triton a plain `copy_` on a side stream stands in
and the SM count is not enforced (`EmulatedPartition.sm_control` says which).

On CUDA the copy runs on its own stream, gated by an event recorded after the op before the launch
slot, and the partition ends with the compute stream waiting for it (DESIGN.md §2.8). On a CPU the
same code runs the ops in order, so the protocol around it can be tested without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from kareus.workload.ops import ComputeOp
from kareus.workload.partitions import PartitionType

THREADS_PER_BLOCK = 1024


def _torch() -> Any:
    import torch

    return torch


@functools.cache
def _triton_copy() -> Callable[..., None] | None:
    """A copy kernel whose grid (thread-block count) is chosen per launch; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        start = tl.program_id(0) * BLOCK
        for offset in range(start, n, PROGRAMS * BLOCK):
            index = offset + tl.arange(0, BLOCK)
            mask = index < n
            tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)

    def launch(src: Any, dst: Any, blocks: int) -> None:
        copy_kernel[(blocks,)](src, dst, src.numel(), BLOCK=THREADS_PER_BLOCK * 4, PROGRAMS=blocks, num_warps=32)

    return launch


def copy_with_sms(src: Any, dst: Any, comm_sms: int) -> bool:
    """Copy `src` into `dst` with `comm_sms` thread blocks; False when the SM count is not enforced."""
    launch = _triton_copy() if src.is_cuda else None
    if launch is None:
        dst.copy_(src)
        return False
    launch(src, dst, comm_sms)
    return True


def payload(payload_bytes: float, device: Any) -> Any:
    """A bf16 buffer of `payload_bytes` (at least 1024 elements): what a collective moves. bf16
    because the sizes are in 2-byte elements; an fp32 buffer would move twice the payload."""
    torch = _torch()
    return torch.randn(max(1024, round(payload_bytes / 2)), device=device).to(torch.bfloat16)


def _gemm(flops: float, device: Any) -> Callable[[], Any]:
    torch = _torch()
    n = max(16, round((flops / 2) ** (1 / 3)))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return lambda: a @ b


def _memory(hbm_bytes: float, device: Any) -> Callable[[], Any]:
    torch = _torch()
    numel = max(1024, round(hbm_bytes / 6))  # read two bf16 tensors, write one
    x, y, out = (torch.randn(numel, device=device).to(torch.bfloat16) for _ in range(3))
    return lambda: torch.add(x, y, out=out)


def emulate_op(op: ComputeOp, device: Any, scale: float = 1.0) -> Callable[[], Any]:
    """A kernel doing `scale` × the op's work: a matmul for GEMM/attention, an add for memory ops."""
    if op.kind == "memory":
        return _memory(op.hbm_bytes * scale, device)
    return _gemm(op.flops * scale, device)


class EmulatedPartition:
    """One partition type at one configuration on one device (see the module docstring)."""

    def __init__(self, ptype: PartitionType, launch_slot: str, comm_sms: int, device: Any,
                 scale: float = 1.0) -> None:
        torch = _torch()
        self.device = torch.device(device)
        self.ops = [emulate_op(op, self.device, scale) for op in ptype.compute_ops]
        self.launch_index = ptype.slot_op_index(launch_slot)
        self.comm_sms = comm_sms
        self.src = payload(ptype.comm.payload_bytes * scale, self.device)
        self.dst = torch.empty_like(self.src)
        self.sm_control = False
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def run(self) -> None:
        """One execution: compute ops in order, the copy launched at the slot, joined at the end."""
        torch = _torch()
        for index, op in enumerate(self.ops):
            if index == self.launch_index:
                self._launch_comm(torch)
            op()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _launch_comm(self, torch: Any) -> None:
        if self.stream is None:
            self.sm_control = copy_with_sms(self.src, self.dst, self.comm_sms)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.sm_control = copy_with_sms(self.src, self.dst, self.comm_sms)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            _torch().cuda.synchronize(self.device)


class EmulatedWork:
    """A stage's non-partition or sequential work: its ops in order, comm as plain copies."""

    def __init__(self, ops: tuple[Any, ...], device: Any, scale: float = 1.0) -> None:
        torch = _torch()
        self.device = torch.device(device)
        self.kernels: list[Callable[[], Any]] = []
        for op in ops:
            if isinstance(op, ComputeOp):
                self.kernels.append(emulate_op(op, self.device, scale))
            else:  # a CommOp: its payload copied through HBM
                src = payload(op.payload_bytes * scale, self.device)
                dst = torch.empty_like(src)
                self.kernels.append(functools.partial(dst.copy_, src))

    def run(self) -> None:
        for kernel in self.kernels:
            kernel()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            _torch().cuda.synchronize(self.device)
