"""The rendezvous timeout of multi-node training: what the operator puts in a training pod's
environment is what `kareus train`'s own rendezvous (a TCPStore at MASTER_ADDR:MASTER_PORT) and
torchrun's (`--rdzv-conf` from PET_RDZV_CONF, static and c10d backends) wait for."""

from __future__ import annotations

from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from kareus.errors import KareusError  # noqa: E402
from kareus.runtime import parallel  # noqa: E402
from kareus.runtime.parallel import RENDEZVOUS_TIMEOUT_S, NodeGroup  # noqa: E402

ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "KAREUS_RENDEZVOUS_TIMEOUT_S", "RANK", "WORLD_SIZE",
       "LOCAL_RANK")


@pytest.fixture
def pod_env(monkeypatch):
    """A training pod's environment: node 1 of 2 (set more with monkeypatch)."""
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "job-train-0.job-train.ns.svc",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(var, value)
    return monkeypatch


def test_the_node_group_reads_the_timeout(pod_env):
    assert NodeGroup.from_env().rendezvous_timeout_s == RENDEZVOUS_TIMEOUT_S == 600.0
    pod_env.setenv("KAREUS_RENDEZVOUS_TIMEOUT_S", "1800")
    assert NodeGroup.from_env() == NodeGroup(2, 1, "job-train-0.job-train.ns.svc", 29500, 1800.0)
    for raw in ("0", "-1", "soon", "nan", "inf"):
        pod_env.setenv("KAREUS_RENDEZVOUS_TIMEOUT_S", raw)
        with pytest.raises(KareusError, match="KAREUS_RENDEZVOUS_TIMEOUT_S must be a positive number"):
            NodeGroup.from_env()


def test_every_rank_waits_that_long_at_the_store(pod_env, monkeypatch, tmp_path):
    stores: list[dict] = []

    def fake_store(host, port, world_size, *, is_master, timeout):
        stores.append({"host": host, "port": port, "world": world_size, "master": is_master, "timeout": timeout})
        return "store"

    monkeypatch.setattr(parallel.dist, "TCPStore", fake_store)
    monkeypatch.setattr(parallel.torch, "set_num_threads", lambda n: None)
    pod_env.setenv("LOCAL_RANK", "0")
    pod_env.setenv("KAREUS_RENDEZVOUS_TIMEOUT_S", "1800")
    nodes = NodeGroup.from_env()
    seen = []
    for local_rank in (0, 1):
        parallel._spawned(local_rank, 2, nodes, str(tmp_path), lambda rank, store: seen.append((rank, store)), ())
    assert seen == [(2, "store"), (3, "store")]  # node 1's ranks of 2 × 2
    assert stores == [{"host": "job-train-0.job-train.ns.svc", "port": 29500, "world": 4, "master": False,
                       "timeout": timedelta(seconds=1800)}] * 2


def test_torchrun_reads_the_operator_environment(monkeypatch):
    """torchrun takes --rdzv-conf from PET_RDZV_CONF: the static rendezvous (torchrun's default with
    MASTER_ADDR/MASTER_PORT) reads `timeout`, c10d `join_timeout`."""
    kareus_operator = pytest.importorskip("kareus_operator.manifests")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.run import get_args_parser

    env = kareus_operator.rendezvous_env(1800.0)
    monkeypatch.setenv("PET_RDZV_CONF", env["PET_RDZV_CONF"])
    args = get_args_parser().parse_args(["train.py"])
    assert args.rdzv_backend == "static"
    config = _parse_rendezvous_config(args.rdzv_conf)
    assert config == {"timeout": "1800", "join_timeout": "1800"}
    static = create_rdzv_handler(RendezvousParameters("static", "job-train-0:29500", "job", 2, 2, rank=0, **config))
    assert static.timeout == timedelta(seconds=1800)
    c10d = RendezvousParameters("c10d", "job-train-0:29500", "job", 2, 2, **config)
    assert c10d.get_as_int("join_timeout") == 1800
