"""The pre-registered calibration (issue 30, item 3): every target row names its split, a row
registered held-out is never fitted, a label that changed after results were seen is recorded in
the file with its date and reason, and the shipped A100 file records its own history."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kareus.cli import main
from kareus.errors import KareusError
from kareus.sim import calibration
from kareus.sim.calibration import Target

SHIPPED = "kareus/sim/data/a100-targets.csv"
HEADER = "name,split,registered,probe,value,unit,gpu,model,tp,seq_len,micro_batch_size,work,partition,clock_mhz"
LAYOUT = "A100-SXM4-40GB,llama3.2-3b,4,4096,8,sequential:partition,fwd_attn"


def _row(name: str, split: str, registered: str = "", clock_mhz: int = 1200) -> str:
    return f"{name},{split},{registered},time_s,0.002,s,{LAYOUT},{clock_mhz}"


def _write(tmp_path, *lines: str):
    path = tmp_path / "targets.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_shipped_file_labels_every_row_and_records_its_history() -> None:
    loaded = calibration.read_target_file(SHIPPED)
    assert len(loaded.targets) == 32
    assert {t.split for t in loaded.targets} == {"fit", "holdout"}
    assert all(t.registered in calibration.SPLITS for t in loaded.targets)  # registered explicitly, row by row
    moved = [t for t in loaded.targets if t.split != t.registered]
    assert [(t.name, t.registered, t.split) for t in moved] == [
        ("single layer: best vs sequential, energy, 1410 MHz", "fit", "holdout")]
    (change,) = loaded.label_changes
    assert (change.row, change.from_split, change.to_split, change.date) == (moved[0].name, "fit", "holdout",
                                                                              "2026-12-01")
    assert "copy_l2_interference" in change.reason
    choices = {c.subject: c for c in loaded.model_choices}
    assert set(choices) == {"host_launch_s", "partition_join_s"}
    assert "left out" in choices["host_launch_s"].choice and "held-out" in choices["host_launch_s"].reason
    assert "53 %" in choices["partition_join_s"].reason and "in-sample" in choices["partition_join_s"].reason


def test_calibrate_refuses_a_held_out_row_labelled_fit(tmp_path, capsys) -> None:
    path = _write(tmp_path, HEADER, _row("a", "fit", "fit"), _row("b", "fit", "holdout", 1000),
                  _row("c", "holdout", "holdout", 900),
                  "# label-change: 2026-12-01 | b | holdout -> fit | looked better")
    assert main(["sim", "calibrate", "--targets", str(path), "--fit", "gemm_efficiency",
                 "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert "row 'b' is registered held-out" in err and "does not fit on held-out rows" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


def test_fit_refuses_a_held_out_row_given_in_code() -> None:
    target = Target(name="t", probe="time_s", value=2e-3, unit="s", model="llama3.2-3b", tp=4,
                    micro_batch_size=8, work="sequential:partition", partition="fwd_attn", clock_mhz=1200)
    smuggled = replace(target, name="smuggled", registered="holdout", clock_mhz=1000)
    with pytest.raises(KareusError, match="row 'smuggled' is registered held-out"):
        calibration.fit([target, smuggled, replace(target, name="h", split="holdout")], ["gemm_efficiency"])


def test_a_changed_label_needs_its_date_and_reason_in_the_file(tmp_path) -> None:
    unrecorded = _write(tmp_path, HEADER, _row("a", "fit", "fit"), _row("b", "holdout", "fit", 1000))
    with pytest.raises(KareusError) as error:
        calibration.read_target_file(unrecorded)
    message = str(error.value)
    assert "row 'b' was registered fit and is now holdout" in message
    assert "# label-change: DATE | b | fit -> holdout | REASON" in message
    recorded = _write(tmp_path, HEADER, _row("a", "fit", "fit"), _row("b", "holdout", "fit", 1000),
                      "# label-change: 2026-12-01 | b | fit -> holdout | it failed and the reason is known")
    loaded = calibration.read_target_file(recorded)
    assert [t.split for t in loaded.targets] == ["fit", "holdout"]
    assert loaded.history()["label_changes"] == [{"date": "2026-12-01", "row": "b", "from": "fit", "to": "holdout",
                                                  "reason": "it failed and the reason is known"}]


@pytest.mark.parametrize("lines,message", [
    ((HEADER, _row("a", "", "")), "row 'a' has no split"),
    ((HEADER, _row("a", "fit", "later")), "registered must be one of fit, holdout"),
    ((HEADER, _row("a", "fit"), "# label-change: 2026-12-01 | ghost | fit -> holdout | why"),
     "label change of 'ghost' (2026-12-01) names no row"),
    ((HEADER, _row("a", "fit"), "# label-change: yesterday | a | fit -> holdout | why"),
     "date must be YYYY-MM-DD, got 'yesterday'"),
    ((HEADER, _row("a", "fit"), "# label-change: 2026-12-01 | a | fit -> train | why"),
     "a label change is 'FROM -> TO'"),
    ((HEADER, _row("a", "fit"), "# model-choice: 2026-12-01 | host_launch_s | left out"),
     "a model-choice line is 'DATE | ' followed by 3 non-empty fields"),
])
def test_bad_history_is_refused_with_one_line(tmp_path, lines, message) -> None:
    with pytest.raises(KareusError) as error:
        calibration.read_target_file(_write(tmp_path, *lines))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_fit_record_carries_the_files_history(tmp_path, capsys) -> None:
    path = _write(tmp_path, HEADER, _row("a", "fit", "fit"), _row("b", "holdout", "fit", 1000),
                  _row("c", "holdout", "holdout", 900),
                  "# label-change: 2026-12-01 | b | fit -> holdout | it failed",
                  "# model-choice: 2026-12-01 | host_launch_s | left out | a held-out result moved")
    assert main(["sim", "calibrate", "--targets", str(path), "--evaluate", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["history"]["label_changes"][0]["row"] == "b"
    assert record["history"]["model_choices"][0]["subject"] == "host_launch_s"
    assert [t["registered"] for t in record["targets"]] == ["fit", "fit", "holdout"]
    assert main(["sim", "calibrate", "--targets", str(path), "--evaluate"]) == 0
    text = capsys.readouterr().out
    assert "label changed after results were seen (2026-12-01): b: fit -> holdout (it failed)" in text
    assert "model choice informed by results (2026-12-01): host_launch_s: left out" in text
    # A recorded relabel does not stop a fit, and the written file keeps the history.
    out = tmp_path / "p.json"
    assert main(["sim", "calibrate", "--targets", str(path), "--fit", "gemm_efficiency", "--max-evaluations", "3",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["fit"]["history"]["label_changes"][0]["row"] == "b"


def test_paper_table_prints_held_out_errors_with_the_relabelled_rows_marked(capsys) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    from kareus.sim import paramsfile

    script = Path(__file__).resolve().parents[1] / "bench" / "paper_table.py"
    spec = importlib.util.spec_from_file_location("paper_table", script)
    paper_table = importlib.util.module_from_spec(spec)
    sys.modules["paper_table"] = paper_table  # its dataclasses look their module up
    spec.loader.exec_module(paper_table)
    record = paper_table.calibration_errors(paramsfile.load_or_default(None), SHIPPED)
    shipped_fit = paramsfile.load(paramsfile.SHIPPED_PATH).fit
    # The errors as they come out of the shipped parameters: the shipped fit's own record.
    assert record["holdout_absolute_rms"] == pytest.approx(shipped_fit["holdout_absolute_rms"], rel=0.05)
    paper_table.print_calibration(record)
    out = capsys.readouterr().out
    held_out = out.split("Held-out set (never fitted)")[1]
    assert "* single layer: best vs sequential, energy, 1410 MHz" in held_out
    assert "  Perseus time 1350/1410 MHz" in held_out and "holdout_relative_rms" in out
    assert "model choice informed by results (2026-12-01): host_launch_s" in out
