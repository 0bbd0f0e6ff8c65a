"""`kareus sim mbo --json` and `kareus profile`: output shape, errors without tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

from kareus.cli import main
from kareus.profiler import ProfileDocument

ROOT = Path(__file__).resolve().parents[1]
MBO = ["sim", "mbo", "--model", "qwen3-1.7b", "--tp", "4", "--cp", "2", "--seq", "4096", "--mbs", "8",
       "--partition", "fwd_ao_ar"]


def test_sim_mbo_json_has_the_sweep_point_fields(capsys):
    assert main([*MBO, "--noise", "0.01", "--seed", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"measured", "frontier", "evaluations", "grid_size"} <= set(out)
    assert out["grid_size"] == 18 * 10 and out["evaluations"] == len(out["measured"]) <= 36
    assert main(["sim", "sweep", *MBO[2:], "--clocks", "1410:1410", "--sms", "3:3", "--json"]) == 0
    sweep_fields = set(json.loads(capsys.readouterr().out)[0])
    assert all(set(point) == sweep_fields for point in out["measured"] + out["frontier"])
    keys = [(p["clock_mhz"], p["comm_sms"], p["launch_slot"]) for p in out["measured"]]
    assert len(keys) == len(set(keys))
    assert {(p["clock_mhz"], p["comm_sms"], p["launch_slot"]) for p in out["frontier"]} <= set(keys)
    times = [p["time_s"] for p in out["frontier"]]
    assert times == sorted(times)


def test_sim_mbo_paper_preset_spends_the_small_budget(capsys):
    assert main([*MBO, "--preset", "paper", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evaluations"] <= 36 + 3 * 16


def test_sim_mbo_errors_are_one_line(capsys):
    assert main([*MBO[:-1], "fwd_attn", "--json"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kareus: error: --partition: 'fwd_attn' is not a partition type") and "Traceback" not in err
    assert main([*MBO, "--noise", "-1"]) == 1
    assert "--noise: must be >= 0" in capsys.readouterr().err


def test_profile_cli_writes_a_loadable_document(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(["profile", str(ROOT / "examples" / "quickstart.yaml"), "--backend", "sim", "--out", str(out),
                 "--store", str(tmp_path / "store"), "--quiet"])
    assert code == 0
    doc = ProfileDocument.load(out)
    assert doc.provenance.backend == "sim" and doc.provenance.preset == "default"
    assert f"profile {doc.key}:" in capsys.readouterr().out
    assert list((tmp_path / "store").glob(f"{doc.key}.jsonl"))
    assert main(["profile", str(tmp_path / "missing.yaml"), "--out", str(out)]) == 1
    assert capsys.readouterr().err.startswith("kareus: error: ")
