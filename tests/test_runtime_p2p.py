"""Pipeline point to point under NCCL's rule, on CPU: a send completes only once the peer has
posted the matching receive.

gloo buffers sends, so a pipeline whose sends would block each other on NCCL still passes on
gloo. `RendezvousP2P` replaces `torch.distributed`'s point-to-point functions in each spawned rank
with ones that make a send wait until the peer has posted its receive (counted per pair of
ranks, in order, as NCCL matches them; the tags must agree, since NCCL has none). Ops of one
`batch_isend_irecv` group post their receives before any send waits, as an NCCL group does. A
send that is never matched raises after a timeout; the schedule under test must never get there.
Ops outside a group (a plain `isend`/`irecv`) are matched on a channel of their own: NCCL gives no
guarantee that a lone send meets a grouped receive, so in the shim it never does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kareus.runtime import Schedule, TrainConfig, run_rank
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed, spawn_local
from kareus.workload.models import get_preset

torch.set_num_threads(1)
TINY = get_preset("tiny")
UNMATCHED_TIMEOUT_S = 30  # far beyond any honest wait of the tiny model; only a deadlock reaches it


class Deadlock(RuntimeError):
    pass


@dataclass
class _Op:
    """What `dist.P2POp` holds (the real one refuses the shim's functions)."""

    op: object
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0


class RendezvousP2P:
    """NCCL's send/receive matching for one rank, enforced through the store."""

    def __init__(self, store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.real_isend, self.real_irecv = dist.isend, dist.irecv
        self.sent: Counter[tuple[int, str]] = Counter()  # by (peer, channel)
        self.posted: Counter[tuple[int, str]] = Counter()
        self.groups = 0  # batch_isend_irecv calls with a send and a receive
        self.lone_sends = 0  # sends issued outside any group

    def install(self, monkeypatch) -> None:
        for name, fn in (("isend", self.isend), ("irecv", self.irecv), ("P2POp", _Op),
                         ("batch_isend_irecv", self.batch_isend_irecv)):
            monkeypatch.setattr(dist, name, fn)

    def irecv(self, tensor, src, group=None, tag=0):
        self._post(src, tag, "lone")
        return self.real_irecv(tensor, src, group, tag)

    def isend(self, tensor, dst, group=None, tag=0):
        self._await_receiver(dst, tag, "lone")
        return self.real_isend(tensor, dst, group, tag)

    def batch_isend_irecv(self, ops):
        recvs = [op for op in ops if op.op.__name__ == "irecv"]
        sends = [op for op in ops if op.op.__name__ == "isend"]
        self.groups += bool(recvs and sends)
        for op in recvs:
            self._post(op.peer, op.tag, "group")
        works = [self.real_irecv(op.tensor, op.peer, op.group, op.tag) for op in recvs]
        for op in sends:
            self._await_receiver(op.peer, op.tag, "group")
            works.append(self.real_isend(op.tensor, op.peer, op.group, op.tag))
        return works

    def _post(self, src: int, tag: int, channel: str) -> None:
        n = self.posted[src, channel]
        self.posted[src, channel] += 1
        self.store.set(f"p2p/{channel}/{src}->{self.rank}/{n}", str(tag))

    def _await_receiver(self, dst: int, tag: int, channel: str) -> None:
        n = self.sent[dst, channel]
        self.sent[dst, channel] += 1
        self.lone_sends += channel == "lone"
        key = f"p2p/{channel}/{self.rank}->{dst}/{n}"
        try:
            self.store.wait([key], timedelta(seconds=UNMATCHED_TIMEOUT_S))
        except Exception as error:  # the store's timeout error type differs between stores
            raise Deadlock(f"rank {self.rank}: {channel} send #{n} to rank {dst} (tag {tag}) was never matched by "
                           f"a {channel} receive: the pipeline would hang on NCCL") from error
        posted_tag = int(self.store.get(key))
        if posted_tag != tag:
            raise Deadlock(f"rank {self.rank}: send #{n} to rank {dst} has tag {tag}, the receive it meets on "
                           f"NCCL expects tag {posted_tag}")


def _config(pp: int, m: int) -> TrainConfig:
    return TrainConfig(shape=TINY, seq_len=16, pp=pp, micro_batch_size=2, num_microbatches=m, steps=2, seed=3,
                       recipe=OptimizerRecipe.constant("sgd", 0.5), device="cpu")


def _worker(rank: int, store, pp: int, m: int, out: str) -> None:
    config = _config(pp, m)
    shim = RendezvousP2P(store, rank)
    with pytest.MonkeyPatch.context() as monkeypatch:
        shim.install(monkeypatch)
        ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
        result, _ = run_rank(ctx, config, Schedule.uniform(pp, m, mode="sequential"))
    torch.save({"losses": result.losses, "groups": shim.groups, "lone_sends": shim.lone_sends},
               Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4)], ids=["pp2", "pp4"])
def test_1f1b_completes_when_sends_wait_for_their_receives(tmp_path, pp, m):
    """Fails on issue-one-at-a-time P2P (in steady state both neighbours' sends wait forever), and
    where a send goes out alone, outside a group, while the peer's receive is grouped."""
    spawn_local(pp, _worker, pp, m, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(pp)]
    reference, _ = run_rank(init_distributed(_config(1, m).layout, device="cpu"), _config(1, m),
                            Schedule.uniform(1, m, mode="sequential"))
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(reference.losses), rtol=1e-5, atol=1e-7)
    # Steady-state exchanges went out as send+receive groups on every stage.
    assert all(saved["groups"] > 0 for saved in ranks)
    assert [saved["lone_sends"] for saved in ranks] == [0] * pp
