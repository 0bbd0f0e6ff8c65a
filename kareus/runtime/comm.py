"""Collectives of the overlap engine: launched asynchronously, joined at the partition end.

`GroupComm` wraps one process group (the TP group, or the CP group). The engine only needs
`launch_*` — start an all-reduce (in place), an all-gather or a reduce-scatter (along dim 0) and
return a handle — and `handle.join()`, which makes later work wait for it and then hands the
result to a `finish` callback (e.g. to put gathered K/V into the other nanobatch's channels).

- On CPU (gloo) the collective is issued with `async_op`: the *order of issue* follows the launch
  slot exactly as on a GPU; the SM count is a no-op.
- On CUDA the collective runs on the comm stream (high priority, so the comm kernel's CTAs are
  scheduled ahead of queued GEMM CTAs and the launch slot means what it says). It is gated by an
  event recorded on the compute stream when it is launched — i.e. right after the op before the
  launch slot was enqueued — and the join makes the compute stream wait for it (DESIGN.md §2.8).
  NCCL fixes a communicator's CTA bounds at creation (`ProcessGroupNCCL.Options().config.min_ctas/
  max_ctas`), so there is one communicator per SM count in use, created up front and eagerly
  (`device_id`: split from the default communicator, initialised now rather than inside step 0;
  creating a group is collective over the whole world, so it cannot be lazy). The SM count is
  enforced or refused: a torch without `Options.config`, or a launch with an SM count that has no
  communicator, is a `CommSmsError` — never a silent fallback to the default communicator.
- A single-rank group has nothing to exchange; with `standin=True` on CUDA an exact no-op kernel
  (`x *= 1`) runs on the comm stream instead, so one GPU exercises the stream/event machinery.

Sequential (standard autograd) mode uses the blocking forms through Megatron-style autograd
functions: `AllReduceForward` (row-parallel output: sum / identity), `AllReduceBackward`
(column-parallel input: identity / sum) and `GatherSequence` (context parallelism: all-gather the
sequence / reduce-scatter its gradient).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from kareus.errors import KareusError

Finish = Callable[[Tensor], None]
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommSmsError(KareusError):
    """A partition's comm SM count cannot be enforced."""


class CommHandle:
    """A launched collective; `join()` orders later work after it and delivers its result."""

    def __init__(self, result: Tensor, finish: Finish | None, work: object | None = None,
                 done: object | None = None) -> None:
        self._result, self._finish, self._work, self._done = result, finish, work, done

    def join(self) -> None:
        if self._work is not None:
            self._work.wait()  # on CUDA: the current (compute) stream waits for NCCL's stream
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        if self._finish is not None:
            self._finish(self._result)


class GroupComm:
    """Collectives over one process group (None for a single rank)."""

    def __init__(self, group: object | None, size: int, *, cuda: bool = False, standin: bool = False,
                 groups_by_sms: dict[int, object] | None = None, stream: object | None = None) -> None:
        self.group = group
        self.size = size
        self.cuda = cuda
        self.standin = standin and cuda and size == 1
        self.groups_by_sms = dict(groups_by_sms or {})
        self.stream = stream if stream is not None else (comm_stream() if cuda else None)
        self.launches = 0

    def group_for(self, comm_sms: int | None) -> object | None:
        """The communicator that runs a collective on `comm_sms` SMs (None: the default one).
        On gloo SM counts mean nothing, so every count runs on the group itself."""
        if comm_sms is None or not self.cuda or self.size == 1:
            return self.group
        if comm_sms not in self.groups_by_sms:
            have = ", ".join(str(n) for n in sorted(self.groups_by_sms)) or "none"
            raise CommSmsError(f"no NCCL communicator bounded to {comm_sms} SMs (created: {have}); refusing to run "
                               f"the collective unbounded on the default communicator")
        return self.groups_by_sms[comm_sms]

    @property
    def active(self) -> bool:
        """Whether anything runs at all (more than one rank, or a CUDA stand-in)."""
        return self.size > 1 or self.standin

    # asynchronous ------------------------------------------------------------------------------
    def launch_all_reduce(self, tensor: Tensor, comm_sms: int | None = None, finish: Finish | None = None) -> CommHandle:
        """Sum `tensor` in place over the group."""
        return self._launch(tensor, tensor, lambda g: dist.all_reduce(tensor, group=g, async_op=True),
                            comm_sms, finish)

    def launch_all_gather(self, tensor: Tensor, comm_sms: int | None = None, finish: Finish | None = None) -> CommHandle:
        """Concatenate every rank's `tensor` along dim 0 (rank order)."""
        if self.size == 1:
            return self._launch(tensor, tensor, None, comm_sms, finish)
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        return self._launch(tensor, out, lambda g: _all_gather(out, tensor, group=g, async_op=True), comm_sms, finish)

    def launch_reduce_scatter(self, tensor: Tensor, comm_sms: int | None = None,
                              finish: Finish | None = None) -> CommHandle:
        """Sum over the group and keep this rank's slice of dim 0."""
        if self.size == 1:
            return self._launch(tensor, tensor, None, comm_sms, finish)
        out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        return self._launch(tensor, out, lambda g: _reduce_scatter(out, tensor, group=g, async_op=True), comm_sms,
                            finish)

    def _launch(self, tensor: Tensor, out: Tensor, op, comm_sms: int | None, finish: Finish | None) -> CommHandle:
        if not self.active:
            return CommHandle(out, finish)
        self.launches += 1
        if not self.cuda:
            return CommHandle(out, finish, op(self.group))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        self.stream.wait_event(ready)
        work = None
        with torch.cuda.stream(self.stream):
            if op is not None and self.size > 1:
                work = op(self.group_for(comm_sms))
            else:
                tensor.mul_(1.0)  # the stand-in: an exact no-op kernel on the comm stream
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in (tensor, out):
            t.record_stream(self.stream)
        return CommHandle(out, finish, work, done)

    # blocking (sequential mode) ----------------------------------------------------------------
    def all_reduce(self, tensor: Tensor) -> Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        if self.size == 1:
            return tensor
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        _all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        if self.size == 1:
            return tensor
        out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        _reduce_scatter(out, tensor.contiguous(), group=self.group)
        return out


def pack_kv(k: Tensor, v: Tensor) -> Tensor:
    """K and V `[b, heads, seq, d]` as one `[seq, 2, b, heads, d]` buffer: one fused collective
    along the sequence (dim 0)."""
    return torch.stack((k, v)).permute(3, 0, 1, 2, 4).contiguous()


def unpack_kv(packed: Tensor) -> tuple[Tensor, Tensor]:
    kv = packed.permute(1, 2, 3, 0, 4)
    return kv[0].contiguous(), kv[1].contiguous()


def comm_stream() -> object:
    """The comm stream: the highest priority CUDA offers."""
    _lowest, highest = torch.cuda.Stream.priority_range()  # lower numbers run first
    return torch.cuda.Stream(priority=highest)


# NCCL reads these when a communicator is created and they override every communicator's config.
CTA_OVERRIDES = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS")


def nccl_options(comm_sms: int) -> object:
    """ProcessGroupNCCL options for a communicator on exactly `comm_sms` CTAs (one per SM), on a
    high-priority NCCL stream; `CommSmsError` when this torch cannot bound CTAs, or when the
    environment's NCCL_MIN_CTAS/NCCL_MAX_CTAS would silently override the bound."""
    overrides = [f"{name}={os.environ[name]}" for name in CTA_OVERRIDES if name in os.environ]
    if overrides:
        raise CommSmsError(f"{' and '.join(overrides)} in the environment would override every communicator's "
                           f"comm SM bound ({comm_sms} SMs asked for); unset {' and '.join(CTA_OVERRIDES)}, "
                           f"or use --schedule sequential")
    options_cls = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    options = options_cls() if options_cls is not None else None
    config = getattr(options, "config", None)
    if config is None or not hasattr(config, "min_ctas") or not hasattr(config, "max_ctas"):
        raise CommSmsError("this torch's ProcessGroupNCCL.Options has no config.min_ctas/max_ctas, so comm SM "
                           "counts cannot be enforced; use torch >= 2.6 with NCCL >= 2.17, or --schedule sequential")
    config.min_ctas = comm_sms
    config.max_ctas = comm_sms
    options.is_high_priority_stream = True
    return options


def nccl_groups_by_sms(groups_ranks: Iterable[tuple[int, ...]], my_ranks: tuple[int, ...],
                       comm_sms: Iterable[int], device: torch.device | None = None) -> dict[int, object]:
    """One NCCL communicator per SM count for this rank's group, CTA-bounded (`nccl_options`) and,
    with `device`, initialised eagerly on it (split from the default communicator where the default
    group was bound to the device).

    Every rank must call this with the same arguments: `new_group` is collective over the world.
    """
    groups_ranks = list(groups_ranks)
    groups: dict[int, object] = {}
    extra = {} if device is None else {"device_id": device}
    for sms in sorted(set(comm_sms)):
        for ranks in groups_ranks:
            group = dist.new_group(list(ranks), backend="nccl", pg_options=nccl_options(sms), **extra)
            if tuple(ranks) == tuple(my_ranks):
                groups[sms] = group
    return groups


class AllReduceForward(torch.autograd.Function):
    """Row-parallel output: sum over TP in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm) -> Tensor:
        return comm.all_reduce(x.clone()) if comm.size > 1 else x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class AllReduceBackward(torch.autograd.Function):
    """Column-parallel input: identity in forward, sum of the input gradient over TP in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.all_reduce(grad.clone()), None


class GatherSequence(torch.autograd.Function):
    """Context parallelism: all-gather `[b, heads, seq, d]` along seq; reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm) -> Tensor:
        ctx.comm = comm
        if comm.size == 1:
            return x.view_as(x)
        return comm.all_gather(x.movedim(2, 0).contiguous()).movedim(0, 2).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.comm.size == 1:
            return grad, None
        return ctx.comm.reduce_scatter(grad.movedim(2, 0).contiguous()).movedim(0, 2).contiguous(), None
