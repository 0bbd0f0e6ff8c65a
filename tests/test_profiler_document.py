"""The profile document (JSON round trip, per-clock frontiers, errors) and the profile key."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.job import describe_job
from kareus.profiler import (
    ClockCost,
    PartitionPoint,
    PartitionProfile,
    ProfileDocument,
    ProfileError,
    Provenance,
    profile_job,
    profile_key,
)
from kareus.spec import load_job

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "tests" / "data" / "tiny-tp2.yaml"  # a small valid job
LABEL_VALUE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")


def _document() -> ProfileDocument:
    job = load_job(QUICKSTART)
    points = (
        PartitionPoint(1410, 3, "norm_0", 1.0e-3, 0.300),  # eff 0.215
        PartitionPoint(1410, 6, "norm_0", 0.9e-3, 0.290),  # eff 0.2135: dominates the first
        PartitionPoint(1410, 9, "linear_0", 0.8e-3, 0.295),  # eff 0.227: fastest
        PartitionPoint(1380, 3, "norm_0", 1.1e-3, 0.200),
    )
    table = {0: {"forward": {1410: ClockCost(1e-4, 0.02), 1380: ClockCost(1.1e-4, 0.018)},
                 "backward": {1410: ClockCost(2e-4, 0.04), 1380: ClockCost(2.2e-4, 0.036)}}}
    return ProfileDocument(
        key=profile_key(job), gpu="A100-SXM4-40GB", p_static_w=85.0, clocks_mhz=(1410, 1380),
        job=describe_job(job), partitions={"fwd_mlp": PartitionProfile(points, 4, 1080)},
        nonpartition=table, sequential=table, provenance=Provenance("0.1.0", "default", 0, "sim"))


def test_frontier_at_a_clock_is_pareto_on_time_and_effective_energy():
    doc = _document()
    frontier = doc.frontier_at("fwd_mlp", 1410)
    assert [(p.comm_sms, p.launch_slot) for p in frontier] == [(9, "linear_0"), (6, "norm_0")]
    assert doc.frontier_at("fwd_mlp", 1380)[0].energy_j == 0.200
    assert doc.frontier_at("fwd_mlp", 1200) == ()
    assert len(doc.frontier("fwd_mlp")) == 3
    assert frontier[0].effective_energy_j(85.0) == pytest.approx(0.295 - 85.0 * 0.8e-3)


def test_json_round_trip_keeps_every_field_and_integer_keys(tmp_path):
    doc = _document()
    path = tmp_path / "profile.json"
    doc.save(path)
    data = json.loads(path.read_text())
    assert data["apiVersion"] == "kareus.dev/v1alpha1" and data["kind"] == "KareusProfile"
    loaded = ProfileDocument.load(path)
    assert loaded == doc
    assert loaded.nonpartition[0]["forward"][1410] == (1e-4, 0.02)
    assert loaded.job.gpus_per_stage == 2 and loaded.job.stage_layers == (4,)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(kind="KareusPlan"), "apiVersion/kind"),
    (lambda d: d.pop("clocks_mhz"), r"profile.clocks_mhz: required"),
    (lambda d: d["nonpartition"]["0"].update(sideways={}), "direction must be one of"),
    (lambda d: d["partitions"]["fwd_mlp"]["measured"][0].pop("time_s"), "malformed"),
])
def test_bad_documents_are_one_clear_error(mutate, message):
    data = _document().to_dict()
    mutate(data)
    with pytest.raises(ProfileError, match=message):
        ProfileDocument.from_dict(data)


def test_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        ProfileDocument.load(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        ProfileDocument.load(tmp_path / "x.json")


def _with_parallelism(job, **changes):
    spec = job.spec
    return dataclasses.replace(spec, parallelism=dataclasses.replace(spec.parallelism, **changes))


def test_key_is_stable_label_safe_and_covers_what_measurements_depend_on():
    job = load_job(QUICKSTART)
    key = profile_key(job)
    assert key == profile_key(job.spec) == profile_key(load_job(QUICKSTART))
    assert LABEL_VALUE.match(key) and len(key) <= 63
    assert key.startswith("sim-tiny-a100-sxm4-40gb-tp2cp1pp1-s64-b4-")  # the quickstart profiles the simulator
    # The same job measured on a real GPU has another key: a simulated profile never passes for it.
    real = profile_key(job, simulated=False)
    assert real.startswith("tiny-a100-sxm4-40gb-tp2cp1pp1-s64-b4-") and real != key
    assert profile_key(job, simulated=False, gpu_product="NVIDIA H100 80GB HBM3").startswith("tiny-h100-80gb-hbm3-")
    others = {
        profile_key(_with_parallelism(job, micro_batch_size=8)),
        profile_key(_with_parallelism(job, activation_checkpointing=False)),
        profile_key(dataclasses.replace(job.spec, sequence_length=128)),
        profile_key(dataclasses.replace(job.spec, gpu_product="H100-SXM5-80GB")),
        profile_key(job, software_version="9.9.9"),
    }
    assert key not in others and len(others) == 5
    # What is chosen, not what is measured, leaves the key alone.
    assert profile_key(dataclasses.replace(job.spec, suspend=True)) == key


@settings(max_examples=40, deadline=None)
@given(name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_. ", min_size=1, max_size=120))
def test_key_is_label_safe_for_any_gpu_product(name):
    job = load_job(QUICKSTART)
    key = profile_key(dataclasses.replace(job.spec, gpu_product=name))
    assert LABEL_VALUE.match(key), key
    assert len(key) <= 63


def test_profile_job_gives_every_partition_type_points_at_every_clock():
    doc = profile_job(load_job(QUICKSTART), backend="sim", preset="default", seed=3)
    assert set(doc.partitions) == {"fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"}
    assert doc.clocks_mhz[0] == 1410 and doc.clocks_mhz[-1] == 900 and len(doc.clocks_mhz) == 18
    for name, profile in doc.partitions.items():
        assert profile.evaluations == len(profile.measured) <= 0.2 * profile.grid_size
        for clock in doc.clocks_mhz:
            assert doc.frontier_at(name, clock), (name, clock)
    for table in (doc.nonpartition, doc.sequential):
        assert set(table[0]) == {"forward", "backward"}
        assert set(table[0]["forward"]) == set(doc.clocks_mhz)
    # the same instruction at a lower clock takes longer
    seq = doc.sequential[0]["forward"]
    assert seq[900].time_s > seq[1410].time_s
    assert doc.provenance.backend == "sim" and doc.provenance.preset == "default"
    assert ProfileDocument.from_dict(json.loads(json.dumps(doc.to_dict()))) == doc
