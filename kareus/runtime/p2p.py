"""Point-to-point between neighbouring pipeline stages, ordered so that NCCL cannot deadlock.

ProcessGroupNCCL runs both directions between two ranks on one communicator and one stream, and
an NCCL send does not complete until the peer's matching receive runs. In 1F1B steady state
stage s would queue [send A(m+1), recv G(m)] while stage s+1 queues [send G(m), recv A(m+1)]:
each send waits for a receive that sits behind the other side's send, so once a tensor exceeds
NCCL's internal buffers (any real model) both stages hang. gloo buffers sends, so it never shows.

`StageLink` does what Megatron-Core's `send_forward_recv_backward` / `send_backward_recv_forward`
do: an instruction's outgoing tensor is held until the next instruction asks for its input; when
that input comes from the same peer the send and the receive go out as one
`dist.batch_isend_irecv` group (one NCCL group: both directions progress together), otherwise
the send goes first, in a group of its own. Every send and every receive is batched: a plain
`dist.isend` is issued outside any NCCL group (ProcessGroupNCCL may run it on a different, two-rank
communicator and sequence than grouped ops), so a lone send facing a batched receive on the peer
is not guaranteed to match it. Everything is looked up on `torch.distributed` at call time, so a
test can put a backend shim in its place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class _Outgoing:
    tensor: Tensor
    dst: int
    tag: int


class StageLink:
    """This stage's sends and receives; receives block until their data is there, sends are
    awaited in `finish()` at the end of the iteration."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self._outgoing: _Outgoing | None = None
        self._in_flight: list[tuple[object, Tensor]] = []  # (work, tensor kept alive until it completes)

    def send(self, tensor: Tensor, dst: int, tag: int) -> None:
        """Queue `tensor` for `dst`; it leaves with the next `receive` from `dst`, or before any other."""
        self.flush()
        self._outgoing = _Outgoing(tensor.contiguous(), dst, tag)

    def receive(self, src: int, tag: int) -> Tensor:
        """The next tensor from `src`; a send queued for `src` goes out in the same group."""
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        ops = [dist.P2POp(dist.irecv, buffer, src, tag=tag)]
        out = self._outgoing
        if out is not None and out.dst == src:
            ops.insert(0, dist.P2POp(dist.isend, out.tensor, out.dst, tag=out.tag))
            self._outgoing = None
        else:
            self.flush()
        works = dist.batch_isend_irecv(ops)
        for work in works:  # NCCL returns one work for the group, gloo one per op
            work.wait()
        return buffer

    def flush(self) -> None:
        """Send the queued tensor now (the next instruction receives from elsewhere, or not at all)."""
        out, self._outgoing = self._outgoing, None
        if out is not None:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out.tensor, out.dst, tag=out.tag)])
            self._in_flight.extend((work, out.tensor) for work in works)

    def finish(self) -> None:
        """End of the iteration: send what is queued and wait for every send."""
        self.flush()
        for work, _tensor in self._in_flight:
            work.wait()
        self._in_flight.clear()
