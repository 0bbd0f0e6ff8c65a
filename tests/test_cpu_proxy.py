"""`spec.training.cpuProxy`: on CPU the runtime trains a narrow stand-in in the job's layout and
schedule, while time, energy and tokens stay the job's model's on the simulated GPU."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from kareus.cli import main as cli_main
from kareus.runtime import TrainConfig, train
from kareus.runtime.schedule import Schedule
from kareus.runtime.trainer import _simulated_energy
from kareus.sim import paramsfile
from kareus.spec import SpecError, parse_job
from kareus.workload.models import PRESETS

torch.set_num_threads(1)
PROXY = {"layers": 2, "hidden": 64, "ffnHidden": 176, "heads": 4, "kvHeads": 2, "vocab": 256, "sequenceLength": 32}


def manifest(model: str = "llama3.2-3b", proxy: dict | None = PROXY, tp: int = 2, seq: int = 2048) -> dict:
    training = {"image": "x", "steps": 2, "gpusPerNode": tp, "nodes": 1}
    if proxy is not None:
        training["cpuProxy"] = dict(proxy)
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "proxy"},
            "spec": {"model": {"preset": model}, "sequenceLength": seq,
                     "parallelism": {"tensor": tp, "pipeline": 1, "context": 1, "data": 1, "microBatchSize": 2,
                                     "numMicroBatches": 2},
                     "objective": {"maxThroughput": {}}, "training": training}}


def test_the_proxy_keeps_the_models_structure_and_round_trips():
    job = parse_job(manifest("qwen3-1.7b"))
    proxy = job.spec.cpu_proxy_shape()
    qwen = PRESETS["qwen3-1.7b"]
    assert (proxy.num_layers, proxy.hidden_size, proxy.ffn_hidden_size, proxy.vocab_size) == (2, 64, 176, 256)
    assert proxy.head_dim == 16  # hidden / heads, not the model's 128
    assert (proxy.qk_norm, proxy.tied_embeddings, proxy.rope_theta, proxy.norm_eps) == \
        (qwen.qk_norm, qwen.tied_embeddings, qwen.rope_theta, qwen.norm_eps)
    assert job.spec.cpu_proxy_sequence_length == 32 and job.spec.sequence_length == 2048
    assert parse_job(job.to_dict()) == job
    without = parse_job(manifest(proxy={k: v for k, v in PROXY.items() if k != "sequenceLength"})).spec
    assert without.cpu_proxy_sequence_length == 2048  # the job's, when the proxy does not set one
    assert parse_job(manifest(proxy=None)).spec.cpu_proxy_shape() is None


def test_a_proxy_may_change_sizes_only():
    bad = manifest()
    bad["spec"]["training"]["cpuProxy"]["qkNorm"] = True
    with pytest.raises(SpecError) as caught:
        parse_job(bad)
    [error] = caught.value.errors
    assert error.path == "spec.training.cpuProxy.qkNorm"
    assert "unknown field; allowed here: ffnHidden, headDim, heads, hidden, kvHeads, layers, sequenceLength, vocab" \
        in error.message


def test_the_proxy_must_fit_the_jobs_layout():
    bad = manifest(tp=4)
    bad["spec"]["training"]["cpuProxy"].update(hidden=96, heads=6, kvHeads=3)
    with pytest.raises(SpecError) as caught:
        parse_job(bad)
    assert sorted(e.path for e in caught.value.errors) == ["spec.training.cpuProxy.heads",
                                                           "spec.training.cpuProxy.kvHeads"]


def test_the_proxy_trains_on_cpu_and_the_full_model_on_a_gpu():
    config = TrainConfig.from_job(parse_job(manifest()))
    on_cpu, on_gpu = config.trained_model(cuda=False), config.trained_model(cuda=True)
    assert on_cpu.proxy and (on_cpu.shape.hidden_size, on_cpu.seq_len, on_cpu.layers_per_stage) == (64, 32, (2,))
    assert not on_gpu.proxy and (on_gpu.shape, on_gpu.seq_len, on_gpu.layers_per_stage) == \
        (PRESETS["llama3.2-3b"], 2048, (28,))


def test_a_cpu_run_trains_the_proxy_and_accounts_the_jobs_model(tmp_path):
    job = parse_job(manifest())
    result = train(job, None, steps=3, out_dir=str(tmp_path))
    config = TrainConfig.from_job(job)
    schedule = Schedule.uniform(1, 2, mode="partitioned")
    expected = _simulated_energy(config, schedule).result  # llama3.2-3b, 2048 tokens, TP2 on the A100
    assert result.cpu_proxy and result.energy_source == "simulated"
    assert result.modelled_time_s == pytest.approx(expected.time_s)
    assert result.energy_j == pytest.approx((expected.energy_j,) * 3)
    assert result.tokens_per_step == 2 * 2 * 2048  # the job's tokens, not the proxy's 2 × 2 × 32
    assert result.losses[-1] < result.losses[0]  # the proxy learns
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert records[0]["tokens"] == 8192 and records[0]["tokens_per_joule"] == pytest.approx(8192 / expected.energy_j)
    # Without the proxy the same accounting would need the full model in memory: 3B parameters.
    assert expected.energy_j > 100


def test_sim_params_reach_the_runtimes_accounting(tmp_path):
    config = TrainConfig.from_job(parse_job(manifest()))
    schedule = Schedule.uniform(1, 2, mode="partitioned")
    shipped = _simulated_energy(config, schedule).result
    calibration = paramsfile.shipped()
    hotter = copy.deepcopy(calibration.to_dict())
    hotter["params"]["partition_join_s"] = 5e-4
    path = tmp_path / "params.json"
    path.write_text(json.dumps(hotter))
    slower = _simulated_energy(TrainConfig.from_job(parse_job(manifest()), sim_params=str(path)), schedule).result
    assert slower.time_s > shipped.time_s  # every partition pays the longer join


def test_kareus_train_refuses_a_bad_params_file_before_training(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest()))
    (tmp_path / "params.json").write_text(json.dumps({"params": {"no_such_parameter": 1.0}}))
    code = cli_main(["train", str(path), "--sim-params", str(tmp_path / "params.json"), "--out", str(tmp_path)])
    assert code != 0
    assert "no_such_parameter" in capsys.readouterr().err
    assert not (tmp_path / "train.jsonl").exists()  # refused before any process started
