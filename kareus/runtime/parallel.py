"""Where a rank sits in the TP × PP × DP grid, its process groups, and how ranks start.

Rank order is tensor-parallel fastest, then context, then pipeline, then data:
`rank = ((dp_rank · pp + pp_rank) · cp + cp_rank) · tp + tp_rank`, so a TP group is a run of
consecutive ranks (one node's GPUs in the usual layout). `init_distributed` reads the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or takes a store from `spawn_local`, which starts
N processes on this machine joined by a file store (no TCP port to pick; gloo pinned to loopback).
With one process and no environment nothing is initialised and every collective is skipped.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kareus.errors import KareusError
from kareus.runtime import stopping


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of a job; `world_size = tp · cp · pp · dp`."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_rank, pp_rank, cp_rank, tp_rank) of `rank`."""
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        return rest // self.pp, rest % self.pp, cp_rank, tp_rank

    def rank_of(self, dp_rank: int, pp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def _grid(self) -> list[tuple[int, int, int, int]]:
        return [(d, p, c, t) for d in range(self.dp) for p in range(self.pp) for c in range(self.cp)
                for t in range(self.tp)]

    def _groups(self, key) -> list[tuple[int, ...]]:
        groups: dict[tuple, list[int]] = {}
        for coords in self._grid():
            groups.setdefault(key(*coords), []).append(self.rank_of(*coords))
        return [tuple(g) for g in groups.values()]

    def tp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(lambda d, p, c, t: (d, p, c))

    def cp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(lambda d, p, c, t: (d, p, t))

    def grad_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding the same parameters (data and context parallel replicas)."""
        return self._groups(lambda d, p, c, t: (p, t))

    def end_groups(self) -> list[tuple[int, ...]]:
        """First and last stage ranks that share a tied embedding."""
        return [(self.rank_of(d, 0, c, t), self.rank_of(d, self.pp - 1, c, t)) for d in range(self.dp)
                for c in range(self.cp) for t in range(self.tp)]


@dataclass
class DistContext:
    """This rank's place and groups. Groups are None when they have a single member."""

    layout: Layout
    rank: int
    device: torch.device
    tp_group: object | None = None
    cp_group: object | None = None
    grad_group: object | None = None
    end_group: object | None = None
    tp_ranks: tuple[int, ...] = (0,)
    cp_ranks: tuple[int, ...] = (0,)

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def cp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[3]

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    def neighbour(self, offset: int) -> int:
        dp_rank, pp_rank, cp_rank, tp_rank = self.layout.coords(self.rank)
        return self.layout.rank_of(dp_rank, pp_rank + offset, cp_rank, tp_rank)


def init_distributed(layout: Layout, *, rank: int | None = None, store: object | None = None,
                     device: str = "auto") -> DistContext:
    """Join (or skip, for one process) the process group and create the TP/DP/embedding groups."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if store is None and env_world != layout.world_size and (env_world > 1 or layout.world_size > 1):
        raise KareusError(f"WORLD_SIZE is {env_world} but the job needs tensor×context×pipeline×data = "
                          f"{layout.tp}×{layout.cp}×{layout.pp}×{layout.dp} = {layout.world_size} processes")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank % max(torch.cuda.device_count(), 1))))
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    ctx = DistContext(layout, rank, dev)
    if layout.world_size == 1:
        return ctx
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        kwargs = {"store": store} if store is not None else {"init_method": "env://"}
        if use_cuda:  # binds the communicator to the GPU: eager init, and new groups split from it
            kwargs["device_id"] = dev
        dist.init_process_group(backend, rank=rank, world_size=layout.world_size, **kwargs)
    ctx.tp_group, ctx.tp_ranks = _my_group(layout.tp_groups(), rank)
    ctx.cp_group, ctx.cp_ranks = _my_group(layout.cp_groups(), rank)
    ctx.grad_group, _ = _my_group(layout.grad_groups(), rank)
    if layout.pp > 1:
        ctx.end_group, _ = _my_group(layout.end_groups(), rank)
    return ctx


def _my_group(all_ranks: list[tuple[int, ...]], rank: int) -> tuple[object | None, tuple[int, ...]]:
    """Create every group (collective: all ranks, same order) and return this rank's."""
    mine: object | None = None
    my_ranks: tuple[int, ...] = (rank,)
    for ranks in all_ranks:
        group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        if rank in ranks:
            mine, my_ranks = group, ranks
    return mine, my_ranks


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# How long the ranks of a multi-node job wait for each other at the rendezvous (torchrun's default
# join timeout); the operator sets KAREUS_RENDEZVOUS_TIMEOUT_S from its rendezvous_timeout_s.
RENDEZVOUS_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class NodeGroup:
    """This node's share of a multi-node job started without torchrun (the training pods' env:
    NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, KAREUS_RENDEZVOUS_TIMEOUT_S): processes
    `node_rank·nproc …` of `nnodes·nproc`, which wait up to `rendezvous_timeout_s` for each other."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S

    @classmethod
    def from_env(cls) -> NodeGroup:
        env = os.environ
        try:
            nnodes, node_rank = int(env.get("NNODES", "1")), int(env.get("NODE_RANK", "0"))
            port = int(env.get("MASTER_PORT", "0"))
        except ValueError as error:
            raise KareusError(f"NNODES, NODE_RANK and MASTER_PORT must be integers: {error}") from None
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise KareusError(f"NODE_RANK must be in 0..NNODES-1, got NODE_RANK={node_rank} NNODES={nnodes}")
        if nnodes > 1 and (not env.get("MASTER_ADDR") or not port):
            raise KareusError("a multi-node run (NNODES > 1) needs MASTER_ADDR and MASTER_PORT")
        raw = env.get("KAREUS_RENDEZVOUS_TIMEOUT_S", "")
        try:
            timeout_s = float(raw) if raw else RENDEZVOUS_TIMEOUT_S
        except ValueError:
            timeout_s = math.nan
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise KareusError(f"KAREUS_RENDEZVOUS_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
        return cls(nnodes, node_rank, env.get("MASTER_ADDR", "127.0.0.1"), port, timeout_s)


def spawn_local(nproc: int, fn: Callable, *args, nodes: NodeGroup | None = None) -> None:
    """Run `fn(rank, store, *args)` in `nproc` fresh processes of this node.

    One node: a file store, and gloo pinned to the loopback interface, so nothing listens beyond
    this machine. Several nodes: global ranks `node_rank·nproc + local rank`, rendezvous at
    MASTER_ADDR:MASTER_PORT (rank 0 hosts the store), as torchrun would do.
    """
    if nproc < 1:
        raise KareusError(f"--nproc must be >= 1, got {nproc}")
    nodes = nodes or NodeGroup()
    if nodes.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="kareus-spawn-") as tmp:
        try:
            context = mp.start_processes(_spawned, args=(nproc, nodes, tmp, fn, args), nprocs=nproc, join=False,
                                         start_method="spawn")
            # The pod's SIGTERM (through PID 1) reaches every rank, which stops after its step.
            stopping.forward_to(lambda: [p.pid for p in context.processes if p.pid is not None])
            while not context.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            # A user-caused error in a rank reaches the user as that one line, not a traceback.
            messages = sorted(Path(tmp).glob("error-*.txt"))
            if messages:  # its exit code too: the pod failure policy tells retryable from not by it
                code, _, message = messages[0].read_text().partition("\n")
                raise KareusError(message, exit_code=int(code)) from None
            raise


def _spawned(local_rank: int, nproc: int, nodes: NodeGroup, tmp: str, fn: Callable, args: tuple) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    os.environ["LOCAL_RANK"] = str(local_rank)
    stopping.on_sigterm()
    torch.set_num_threads(1)
    world = nodes.nnodes * nproc
    rank = nodes.node_rank * nproc + local_rank
    if nodes.nnodes == 1:
        store = dist.FileStore(str(Path(tmp) / "store"), world)
    else:
        store = dist.TCPStore(nodes.master_addr, nodes.master_port, world, is_master=rank == 0,
                              timeout=timedelta(seconds=nodes.rendezvous_timeout_s))
    try:
        fn(rank, store, *args)
    except KareusError as error:
        (Path(tmp) / f"error-{rank:05d}.txt").write_text(f"{error.exit_code}\nrank {rank}: {error}")
        raise
    finally:
        shutdown()
