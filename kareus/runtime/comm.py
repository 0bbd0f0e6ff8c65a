"""Tensor-parallel all-reduces: launched asynchronously by the overlap engine, joined at the end.

The overlap engine only needs two things from a communicator: `launch(tensor, comm_sms)` starts
an in-place all-reduce and returns a handle; `handle.join()` makes later computation wait for it.

- On CPU (gloo) the collective is an async `all_reduce`: the *order of issue* follows the launch
  slot exactly as on a GPU, the SM count is a no-op.
- On CUDA the collective runs on its own stream. It is gated by an event recorded on the compute
  stream when it is launched — i.e. right after the op before the launch slot was enqueued — and the
  join makes the compute stream wait on the comm's completion (DESIGN.md §2.8). NCCL fixes a
  communicator's CTA (SM) bounds at creation, so there is one communicator per SM count in use,
  all created up front (creating a group is collective over the whole world, so it cannot be lazy).
- A single-rank group has nothing to reduce; `standin=True` then runs an exact no-op kernel
  (`x *= 1`) on the comm stream so the stream/event machinery is exercised on one GPU.

`AllReduceForward`/`AllReduceBackward` are Megatron's g/f functions for the sequential
(standard-autograd) mode: all-reduce in forward / identity in backward, and the reverse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


class CommHandle:
    """A launched collective; `join()` orders later work after it."""

    def join(self) -> None:  # a completed no-op collective
        return None


@dataclass
class _AsyncWork(CommHandle):
    work: object

    def join(self) -> None:
        self.work.wait()


@dataclass
class _StreamWork(CommHandle):
    work: object | None
    done: torch.cuda.Event

    def join(self) -> None:
        if self.work is not None:
            self.work.wait()  # current (compute) stream waits on NCCL's stream
        torch.cuda.current_stream().wait_event(self.done)


class TPComm:
    """All-reduces over this rank's tensor-parallel group."""

    def __init__(self, group: object | None, size: int, *, cuda: bool = False, standin: bool = False,
                 groups_by_sms: dict[int, object] | None = None) -> None:
        self.group = group
        self.size = size
        self.cuda = cuda
        self.standin = standin and cuda and size == 1
        self.groups_by_sms = dict(groups_by_sms or {})
        self.stream = torch.cuda.Stream() if cuda else None
        self.launches = 0

    @property
    def active(self) -> bool:
        """Whether there is a collective at all (more than one rank, or a CUDA stand-in)."""
        return self.size > 1 or self.standin

    def launch(self, tensor: Tensor, comm_sms: int | None = None) -> CommHandle:
        """Start an in-place sum over the group of `tensor`."""
        if not self.active:
            return CommHandle()
        self.launches += 1
        if not self.cuda:
            return _AsyncWork(dist.all_reduce(tensor, group=self.group, async_op=True))
        return self._launch_on_stream(tensor, comm_sms)

    def _launch_on_stream(self, tensor: Tensor, comm_sms: int | None) -> CommHandle:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        self.stream.wait_event(ready)
        work = None
        with torch.cuda.stream(self.stream):
            if self.size > 1:
                group = self.groups_by_sms.get(comm_sms, self.group)
                work = dist.all_reduce(tensor, group=group, async_op=True)
            else:
                tensor.mul_(1.0)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)
        return _StreamWork(work, done)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Blocking in-place sum (the sequential mode)."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor


def nccl_groups_by_sms(tp_groups_ranks: Iterable[tuple[int, ...]], my_ranks: tuple[int, ...],
                       comm_sms: Iterable[int]) -> dict[int, object]:
    """One NCCL communicator per SM count for this rank's TP group, CTA-bounded where torch exposes
    `ProcessGroupNCCL.Options().config.{min,max}_ctas`; empty where it does not (default group).

    Every rank must call this with the same arguments: `new_group` is collective over the world.
    """
    options_cls = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if options_cls is None or not hasattr(options_cls(), "config"):
        return {}
    groups: dict[int, object] = {}
    for sms in sorted(set(comm_sms)):
        for ranks in tp_groups_ranks:
            options = options_cls()
            options.config.min_ctas = sms
            options.config.max_ctas = sms
            group = dist.new_group(list(ranks), backend="nccl", pg_options=options)
            if tuple(ranks) == tuple(my_ranks):
                groups[sms] = group
    return groups


class AllReduceForward(torch.autograd.Function):
    """Row-parallel output: sum over TP in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        return comm.all_reduce(x.clone()) if comm.size > 1 else x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class AllReduceBackward(torch.autograd.Function):
    """Column-parallel input: identity in forward, sum of the input gradient over TP in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.all_reduce(grad.clone()), None
