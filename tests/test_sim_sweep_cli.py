"""`kareus sim sweep`: flags, JSON fields, sequential targets, table output and errors."""

from __future__ import annotations

import json

import pytest

from kareus.cli import main
from kareus.errors import KareusError
from kareus.sim.sweep import parse_range

BASE = ["sim", "sweep", "--gpu", "A100-SXM4-40GB", "--model", "llama3.2-3b", "--tp", "4", "--cp", "1",
        "--seq", "4096", "--mbs", "8"]
FIELDS = {"clock_mhz", "comm_sms", "launch_slot", "time_s", "energy_j", "static_energy_j", "dynamic_energy_j",
          "exposed_comm_s"}


def run_json(capsys, *extra: str) -> list[dict]:
    assert main([*BASE, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_partition_sweep_covers_the_grid(capsys) -> None:
    points = run_json(capsys, "--partition", "fwd_attn", "--clocks", "900:1410:255", "--sms", "1:30:10",
                      "--slots", "all")
    assert len(points) == 3 * 4 * 3  # clocks 900, 1155, 1410 × 4 slots × SMs 1, 11, 21
    assert all(set(p) >= FIELDS for p in points)
    assert {p["clock_mhz"] for p in points} == {900, 1155, 1410}
    assert {p["launch_slot"] for p in points} == {"norm_0", "linear_0", "rope_0", "attn_0"}
    assert {p["comm_sms"] for p in points} == {1, 11, 21}
    for p in points:
        assert p["energy_j"] == pytest.approx(p["static_energy_j"] + p["dynamic_energy_j"])
        assert p["static_energy_j"] == pytest.approx(85.0 * p["time_s"])


def test_defaults_are_the_types_search_space(capsys) -> None:
    points = run_json(capsys, "--partition", "fwd_mlp")
    assert len(points) == 18 * 3 * 10
    assert {p["comm_sms"] for p in points} == set(range(3, 31, 3))
    assert {p["launch_slot"] for p in points} == {"norm_0", "linear_0", "activation_0"}


def test_named_slots_and_sequential_targets(capsys) -> None:
    points = run_json(capsys, "--partition", "fwd_attn", "--clocks", "1410", "--sms", "4", "--slots", "rope_0",
                      "linear_1")
    assert [p["launch_slot"] for p in points] == ["rope_0", "linear_1"]
    assert points[1]["exposed_comm_s"] > 0  # the last linear always exposes the collective

    sequential = run_json(capsys, "--partition", "sequential:fwd_attn", "--clocks", "1200:1410:210")
    assert [p["clock_mhz"] for p in sequential] == [1200, 1410]
    assert all(p["comm_sms"] is None and p["launch_slot"] is None and p["exposed_comm_s"] > 0 for p in sequential)

    layer = run_json(capsys, "--partition", "sequential:layer", "--clocks", "1410")
    assert layer[0]["comm_sms"] is None and layer[0]["launch_slot"] is None
    assert layer[0]["time_s"] > 2 * sequential[1]["time_s"]  # a whole layer of a whole microbatch


def test_noise_is_seeded(capsys) -> None:
    args = ("--partition", "fwd_attn", "--clocks", "1410", "--sms", "6", "--slots", "linear_0", "--noise", "0.05")
    first = run_json(capsys, *args, "--seed", "3")
    again = run_json(capsys, *args, "--seed", "3")
    clean = run_json(capsys, "--partition", "fwd_attn", "--clocks", "1410", "--sms", "6", "--slots", "linear_0")
    assert first == again and first[0]["time_s"] != clean[0]["time_s"]


def test_table_without_json(capsys) -> None:
    assert main([*BASE, "--partition", "fwd_attn", "--clocks", "1410", "--sms", "4:6:2", "--slots", "linear_0"]) == 0
    out = capsys.readouterr().out
    assert "clock MHz" in out and "linear_0" in out and "least energy:" in out


@pytest.mark.parametrize("extra,message", [
    (["--partition", "fwd_nope"], "--partition: unknown partition 'fwd_nope'; allowed: fwd_attn"),
    (["--partition", "fwd_attn", "--clocks", "1500:1410"], "--clocks: start 1500 must be <= stop 1410"),
    (["--partition", "fwd_attn", "--clocks", "1410:1500"], "--clocks: 1411 MHz outside"),
    (["--partition", "fwd_attn", "--sms", "0:3"], "--sms: 0 outside 1..107"),
    (["--partition", "fwd_attn", "--slots", "activation_0"], "--slots: 'activation_0' is not a slot of fwd_attn"),
    (["--partition", "fwd_attn", "--clocks", "a:b"], "--clocks: expected start:stop"),
    (["--partition", "fwd_attn", "--noise", "-1"], "--noise must be >= 0"),
])
def test_errors_are_one_line_without_traceback(capsys, extra, message) -> None:
    assert main([*BASE, *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kareus: error: ") and message in err and "Traceback" not in err


def test_bad_layouts_and_models_are_user_errors(capsys) -> None:
    args = ["sim", "sweep", "--model", "llama9", "--seq", "4096", "--mbs", "8", "--partition", "fwd_attn"]
    assert main(args) == 1
    assert "unknown model preset 'llama9'" in capsys.readouterr().err
    args = ["sim", "sweep", "--model", "tiny", "--seq", "64", "--mbs", "3", "--tp", "2", "--partition", "fwd_attn"]
    assert main(args) == 1
    assert "micro_batch_size must be even" in capsys.readouterr().err


def test_parse_range() -> None:
    assert parse_range("900:1410:30")[:2] == (900, 930) and parse_range("900:1410:30")[-1] == 1410
    assert parse_range("1:3") == (1, 2, 3) and parse_range("7") == (7,)
    for bad in ("1:2:0", "1:2:3:4", "x"):
        with pytest.raises(KareusError):
            parse_range(bad, "--sms")
