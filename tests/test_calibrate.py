"""`kareus sim calibrate` (issue 20): recovers known parameters from the simulator's own
measurements, reports the held-out error, reads the device-check JSON and profile stores, rejects bad
input with one line; the shipped presets are the shipped fit; `--sim-params` reaches the simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kareus.cli import main
from kareus.errors import KareusError
from kareus.sim import calibration, paramsfile
from kareus.sim.calibration import Target
from kareus.sim.gpus import get_gpu
from kareus.sim.paramsfile import SimCalibration
from kareus.sim.physics import SimParams

GPU = "A100-SXM4-40GB"
LAYOUT = {"gpu": GPU, "model": "llama3.2-3b", "tp": 4, "cp": 1, "pp": 1, "seq_len": 4096, "micro_batch_size": 8}
TRUTH_VALUES = {"gemm_efficiency": 0.70, "activity_comm": 0.40, "gpu.sm_dynamic_w_at_max": 400.0,
                "gpu.hbm_pj_per_byte": 35.0}


def _truth() -> SimCalibration:
    return calibration.with_values(SimCalibration(), list(TRUTH_VALUES), TRUTH_VALUES.values(), [GPU])


def _synthetic_targets(truth: SimCalibration) -> list[Target]:
    """Times and energies the `truth` simulator measures: a Megatron-style layer (GEMM speed and SM
    power), a memory-bound-heavy partition beside an exposed collective (HBM and copy-kernel power),
    at clocks below the power limit."""
    shapes = []
    for clock in (900, 1050, 1200):
        shapes.append({"work": "sequential:layers", "clock_mhz": clock, "name": f"layer {clock}"})
        shapes.append({"work": "partition", "partition": "fwd_mlp", "launch_slot": "linear_0", "comm_sms": 2,
                       "clock_mhz": clock, "name": f"fwd_mlp 2 SMs {clock}"})
        shapes.append({"work": "sequential:partition", "partition": "fwd_attn", "clock_mhz": clock,
                       "name": f"sequential fwd_attn {clock}"})
    targets = []
    for index, shape in enumerate(shapes):
        split = "holdout" if index % 3 == 2 else "fit"
        for probe, unit in (("time_s", "s"), ("energy_j", "J")):
            targets.append(Target(**LAYOUT, **shape | {"name": f"{shape['name']} {probe}"}, probe=probe, value=1.0,
                                  unit=unit, split=split))
    predicted = calibration.predict_all(truth, targets)
    return [replace(t, value=v) for t, v in zip(targets, predicted, strict=True)]


def test_fit_recovers_known_parameters_within_2_percent() -> None:
    targets = _synthetic_targets(_truth())
    result = calibration.fit(targets, list(TRUTH_VALUES), SimCalibration(), max_evaluations=200)
    for name, true_value in TRUTH_VALUES.items():
        assert result.fitted[name] == pytest.approx(true_value, rel=0.02), name
    summary = result.summary()
    assert summary["fit_relative_rms"] < 1e-3
    # The held-out measurements were not seen and are predicted as well.
    assert summary["holdout_relative_max"] < 0.01
    assert {row.target.split for row in result.rows} == {"fit", "holdout"}
    # The fitted file carries the fit record and moves the simulator.
    assert result.calibration.fit["holdout_relative_rms"] == summary["holdout_relative_rms"]
    assert result.calibration.gpu(GPU).sm_dynamic_w_at_max == pytest.approx(400.0, rel=0.02)


def test_calibrate_command_writes_a_params_file_and_reports_held_out_error(tmp_path, capsys) -> None:
    targets = _synthetic_targets(_truth())
    csv_path = tmp_path / "points.csv"
    header = [f for f in Target.__dataclass_fields__ if f != "clocks_mhz"]
    lines = [",".join(header)] + [",".join("" if getattr(t, f) is None else str(getattr(t, f)) for f in header)
                                  for t in targets]
    csv_path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "params.json"
    code = main(["sim", "calibrate", "--targets", str(csv_path), "--fit", ",".join(TRUTH_VALUES),
                 "--out", str(out), "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.split("\nwritten:")[0])
    assert record["holdout_relative_max"] < 0.01
    assert record["fitted"]["gemm_efficiency"] == pytest.approx(0.70, rel=0.02)
    loaded = paramsfile.load(out)
    assert loaded.params.gemm_efficiency == pytest.approx(0.70, rel=0.02)
    # Every simulator command takes the file.
    assert main(["sim", "sweep", "--model", "llama3.2-3b", "--tp", "4", "--seq", "4096", "--mbs", "8",
                 "--partition", "fwd_attn", "--clocks", "1200", "--sms", "4", "--slots", "linear_0", "--json",
                 "--sim-params", str(out)]) == 0
    fitted = json.loads(capsys.readouterr().out)[0]
    assert main(["sim", "sweep", "--model", "llama3.2-3b", "--tp", "4", "--seq", "4096", "--mbs", "8",
                 "--partition", "fwd_attn", "--clocks", "1200", "--sms", "4", "--slots", "linear_0", "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)[0]
    assert fitted["time_s"] > shipped["time_s"] * 1.03  # GEMMs at 0.70 instead of the shipped 0.77


@pytest.mark.parametrize("row,message", [
    ({"name": "x", "probe": "time_s", "value": "1", "unit": "ms"}, "unit of probe time_s must be 's'"),
    ({"name": "x", "probe": "latency", "value": "1", "unit": "s"}, "probe 'latency' unknown"),
    ({"name": "x", "probe": "time_s", "value": "1", "unit": "s", "colour": "red"}, "unknown field 'colour'"),
    ({"name": "x", "probe": "time_s", "value": "fast", "unit": "s"}, "value must be a float"),
    ({"name": "x", "probe": "time_s", "value": "1", "unit": "s", "split": "train"}, "split must be one of"),
    ({"name": "x", "probe": "time_s", "value": "1", "unit": "s", "gpu": "V100"}, "unknown GPU product"),
])
def test_bad_targets_are_refused_with_one_line_naming_the_field(tmp_path, row, message) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(",".join(row) + "\n" + ",".join(row.values()) + "\n")
    with pytest.raises(KareusError) as error:
        calibration.read_csv(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_empty_sets_and_unknown_parameters_are_refused() -> None:
    target = Target(**LAYOUT, name="t", probe="time_s", value=1e-3, unit="s", work="sequential:partition",
                    partition="fwd_attn")
    with pytest.raises(KareusError, match="held-out set is empty"):
        calibration.fit([target], ["gemm_efficiency"])
    with pytest.raises(KareusError, match="fit set is empty"):
        calibration.fit([replace(target, split="holdout")], ["gemm_efficiency"])
    with pytest.raises(KareusError, match="'nccl_channels' is not a fittable parameter; allowed: gemm_efficiency"):
        calibration.fit([target, replace(target, split="holdout")], ["nccl_channels"])
    with pytest.raises(KareusError, match=r"'gpu\.sms' is not a fittable GPU field"):
        calibration.fit([target, replace(target, split="holdout")], ["gpu.sms"])


def test_calibrate_cli_reports_bad_input_as_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("name,probe,value,unit\n")
    assert main(["sim", "calibrate", "--targets", str(path), "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert "no targets" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("document,message", [
    ({"params": {"gemm_efficency": 0.7}}, "params.gemm_efficency is not a simulator parameter; allowed:"),
    ({"params": {"gemm_efficiency": "high"}}, "params.gemm_efficiency: must be a number"),
    ({"gpus": {"V100": {}}}, "gpus.V100 is not a GPU preset"),
    ({"gpus": {GPU: {"sms": 100}}}, f"gpus.{GPU}.sms is not a calibrated GPU field"),
    ({"kind": "KareusPlan"}, "kind/apiVersion must be KareusSimParams"),
    ({"extra": 1}, "unknown field 'extra'"),
])
def test_bad_params_files_are_refused(tmp_path, document, message) -> None:
    path = tmp_path / "params.json"
    path.write_text(json.dumps(document))
    with pytest.raises(KareusError) as error:
        paramsfile.load(path)
    assert message in str(error.value)


def test_shipped_presets_are_the_shipped_fit() -> None:
    """The defaults of `SimParams` and the A100 presets are the fit stored in kareus/sim/data."""
    shipped = paramsfile.load(paramsfile.SHIPPED_PATH)
    for name, value in shipped.fit["fitted"].items():
        current = calibration.current_value(SimCalibration(), name, GPU)
        assert current == pytest.approx(value, rel=0.01, abs=2e-3 if name == "copy_l2_interference" else 0), name
    for gpu in ("A100-SXM4-40GB", "A100-SXM4-80GB"):
        for field, value in shipped.gpus[gpu].items():
            assert getattr(get_gpu(gpu), field) == pytest.approx(value, rel=0.01), (gpu, field)
    assert shipped.fit["holdout_relative_rms"] > 0  # the held-out errors are part of the record


def test_device_check_json_is_read(tmp_path) -> None:
    """bench/device_check.py's profiler section: one time and one energy target per emulated
    partition with an energy window; every third measurement held out."""
    rows = [{"type": "fwd_attn", "launch_slot": slot, "comm_sms": sms, "time_s": 2e-3 + 1e-4 * i,
             "window": {"energy_j": 0.5 + 0.01 * i, "time_s": 2e-3, "sm_clock_mhz_inside": [1980, 1965, 1980]},
             "simulated": {"gpu": "H200-SXM-141GB", "clock_mhz": 1980, "time_s": 1e-3, "energy_j": 0.4}}
            for i, (slot, sms) in enumerate([("norm_0", 30), ("norm_0", 3), ("linear_0", 3)])]
    rows.append({"type": "fwd_mlp", "truncated": "budget"})
    report = {"schema": "kareus.device_check", "schema_version": 2, "cuda_device_0": "NVIDIA H200",
              "sections": {"profiler": {"status": "ok", "result": {"preset": "llama3.1-8b", "rows": rows}}}}
    path = tmp_path / "device_check.json"
    path.write_text(json.dumps(report))
    targets = calibration.from_device_check(path)
    assert len(targets) == 6
    assert {t.gpu for t in targets} == {"H200-SXM-141GB"} and {t.clock_mhz for t in targets} == {1980}
    assert [t.split for t in targets].count("holdout") == 2
    assert {t.probe for t in targets} == {"time_s", "energy_j"}
    assert all(p > 0 for p in calibration.predict_all(SimCalibration(), targets))
    skipped = dict(report, sections={"profiler": {"status": "skipped", "reason": "no kareus"}})
    path.write_text(json.dumps(skipped))
    with pytest.raises(KareusError, match="profiler section did not run"):
        calibration.from_device_check(path)
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(KareusError, match="not a device-check report"):
        calibration.from_device_check(path)


def test_profile_store_is_read(tmp_path) -> None:
    from kareus.spec import load_job

    job = load_job("examples/quickstart.yaml")
    store = tmp_path / "key.jsonl"
    records = [{"kind": "header", "key": "key"},
               {"kind": "partition", "type": "fwd_attn", "clock_mhz": 1410, "comm_sms": 3, "launch_slot": "norm_0",
                "time_s": 1e-3, "energy_j": 0.3},
               {"kind": "work", "what": "sequential", "stage": 0, "direction": "forward", "clock_mhz": 1410,
                "time_s": 1e-2, "energy_j": 3.0},
               {"kind": "work", "what": "nonpartition", "stage": 0, "direction": "forward", "clock_mhz": 1410,
                "time_s": 1e-3, "energy_j": 0.1}]
    store.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    targets = calibration.from_profile_store(store, job)
    assert [t.work for t in targets] == ["partition", "partition", "instruction", "instruction"]
    assert all(p > 0 for p in calibration.predict_all(SimCalibration(), targets))


def test_fit_bounds_are_physical() -> None:
    """Every fittable parameter's default lies within its bounds."""
    defaults = SimParams()
    for name, (low, high) in calibration.FITTABLE.items():
        assert low <= getattr(defaults, name) <= high, name
    for name, (low, high) in calibration.GPU_FITTABLE.items():
        assert low <= getattr(get_gpu(GPU), name) <= high, name
