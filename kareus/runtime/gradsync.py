"""Summing gradients over data-parallel replicas, one bucket at a time.

Copying every gradient into one flat buffer before the all-reduce doubles a rank's gradient memory
for a moment (a 70B stage at TP8 holds gigabytes of gradients). Instead parameters are grouped, in
order, into buckets of at most `bucket_bytes` (torch DDP's default: 25 MiB); each bucket is packed,
summed and unpacked before the next one is packed, so the extra memory is one bucket. A gradient
larger than a bucket is summed in place, alone, with no copy at all. Buckets never mix dtypes or
devices (a packed buffer has one of each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_BYTES = 25 * 2**20


def buckets(tensors: Sequence[Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[Tensor]]:
    """`tensors` in order, grouped into runs of one dtype and device of at most `bucket_bytes`
    (a tensor larger than that is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        last = out[-1] if out else None
        fits = last is not None and size + nbytes <= bucket_bytes and (
            last[0].dtype == tensor.dtype and last[0].device == tensor.device)
        if fits:
            last.append(tensor)
            size += nbytes
        else:
            out.append([tensor])
            size = nbytes
    return out


def all_reduce_bucketed(tensors: Sequence[Tensor], group: object | None, bucket_bytes: int | None = None) -> None:
    """Sum every tensor in place over `group`, holding at most one bucket's copy at a time
    (`bucket_bytes`: `BUCKET_BYTES` unless given)."""
    for bucket in buckets(tensors, BUCKET_BYTES if bucket_bytes is None else bucket_bytes):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            tensor.copy_(part.view_as(tensor))
        del flat
