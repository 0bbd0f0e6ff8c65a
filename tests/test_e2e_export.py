"""End to end with the real runtime: published weights in, a model others can load out (issue 43).

The session's dev cluster gets an operator release watching namespace `e2e-export` (Pod Security
`restricted`). The test makes a tiny random Hugging Face Llama with `transformers` (the `tiny`
preset's shape: vocabulary 256, so the built-in byte corpus trains it), binds a claim with a pod
that does nothing and writes the model into that claim's directory on the node (the local-path
provisioner's host path). The job is the tests' small one (tensor parallel 2 on CPU, simulated GPU
energy) with `spec.model.pretrained` on that claim, checkpoints on a second claim and
`spec.training.export: {}`. Its training pods run the real `kareus train --init-from … --export-dir …`.

Checked: the job succeeds; `status.export.path` is `<claim>:<job uid>/export` and `kubectl get kj -o
wide` shows it; the runtime logged that it started from the pretrained directory; the directory on
the claim loads with `transformers.AutoModelForCausalLM` and its logits are the trained checkpoint's
(read with the runtime's own checkpoint reader in this process, at TP1) within 1e-5, and not the
starting model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config

GROUP, VERSION, PLURAL, NS = "kareus.dev", "v1alpha1", "kareusjobs", "e2e-export"
TINY = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-tp2.yaml"
SETTINGS = {"RESYNC_S": "2", "BACKOFF_BASE_S": "1", "PROGRESS_INTERVAL_S": "0.5", "LEASE_DURATION_S": "4"}
MODELS, CHECKPOINTS, MODEL_DIR, JOB = "models", "checkpoints", "tiny-llama", "tiny-export"
STEPS, EVERY, SEQ = 6, 4, 64
# The tiny preset as a Hugging Face config (`kareus model from-hf` prints `preset: tiny` for it).
HF_CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
             "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False}
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
              "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}}

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(dev_cluster):
    objects = dev_cluster.install_operator("e2e-export", "e2e-export-system", watch_namespaces=[NS],
                                           settings=SETTINGS)
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core = client.CoreV1Api(api_client)
    core.patch_namespace(NS, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    for claim in (MODELS, CHECKPOINTS):
        core.create_namespaced_persistent_volume_claim(NS, {
            "metadata": {"name": claim}, "spec": {"accessModes": ["ReadWriteOnce"],
                                                  "resources": {"requests": {"storage": "1Gi"}}}})
    yield dev_cluster, client.CustomObjectsApi(api_client), core
    dev_cluster.uninstall(objects)


def claim_dir(dev_cluster, core, claim: str) -> Path:
    """The claim's directory on its node, as the test process sees it."""
    name = core.read_namespaced_persistent_volume_claim(claim, NS).spec.volume_name
    volume = core.read_persistent_volume(name)
    [node] = volume.spec.node_affinity.required.node_selector_terms[0].match_expressions[0].values
    return dev_cluster.node(node).root / volume.spec.local.path.lstrip("/")


def bind(core, claim: str, image: str) -> None:
    """A claim of a WaitForFirstConsumer class gets its volume when a pod that mounts it is scheduled."""
    core.create_namespaced_pod(NS, {
        "metadata": {"name": f"bind-{claim}"},
        "spec": {"restartPolicy": "Never", "securityContext": {"fsGroup": 65532},
                 "containers": [{"name": "bind", "image": image, "imagePullPolicy": "IfNotPresent",
                                 "command": ["true"], "securityContext": RESTRICTED,
                                 "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                 "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}]}})
    wait_until(lambda: core.read_namespaced_persistent_volume_claim(claim, NS).spec.volume_name, bool,
               timeout_s=120, what=f"claim {claim} bound")


def make_hf(directory: Path) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
    with torch.no_grad():  # random norms: a misplaced one would show in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # read by the pods' non-root user


def status_of(jobs, name: str) -> dict:
    job = read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name))
    return (job or {}).get("status") or {}


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def checkpoint_logits(step_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The trained checkpoint's logits, computed by the runtime itself (TP1, one process)."""
    from kareus.runtime.comm import GroupComm
    from kareus.runtime.engine import SequentialBlock
    from kareus.runtime.init_from import find_source, stage_params
    from kareus.runtime.layer_ops import rms_norm, sequence_consts
    from kareus.runtime.model import StageLayout, StageModel

    source = find_source(step_dir)
    shape = source.shape
    layout = StageLayout(0, 1, 0, shape.num_layers)
    model = StageModel(shape, layout, params=stage_params(source, shape, layout, 1, 0))
    consts = sequence_consts(tokens.shape[1], 1, 0, shape.head_dim, shape.rope_theta)
    with torch.no_grad():
        hidden = SequentialBlock(model, GroupComm(None, 1), consts).forward(model.embed(tokens))
        return F.linear(rms_norm(hidden, model.param("final_norm"), shape.norm_eps), model.param("output"))


def test_pretrained_weights_in_and_a_transformers_model_out(cluster, tmp_path):
    dev_cluster, jobs, core = cluster
    job = yaml.safe_load(TINY.read_text())
    bind(core, MODELS, job["spec"]["training"]["image"])
    make_hf(tmp_path / "hf")
    target = claim_dir(dev_cluster, core, MODELS) / MODEL_DIR
    target.mkdir(parents=True)
    for path in (tmp_path / "hf").iterdir():
        (target / path.name).write_bytes(path.read_bytes())
        (target / path.name).chmod(0o644)
    target.chmod(0o755)

    job["metadata"] = {"name": JOB, "namespace": NS}
    job["spec"]["model"] = {"preset": "tiny", "pretrained": {"claimName": MODELS, "path": MODEL_DIR}}
    job["spec"]["training"] |= {"steps": STEPS, "checkpoint": {"everySteps": EVERY, "claimName": CHECKPOINTS},
                                "export": {}}
    created = jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    uid = created["metadata"]["uid"]
    final = wait_until(lambda: status_of(jobs, JOB), lambda s: s.get("phase") in ("Succeeded", "Failed"),
                       timeout_s=500, what="the job finishing", interval_s=0.5)
    assert final["phase"] == "Succeeded", final
    assert final["export"] == {"path": f"{CHECKPOINTS}:{uid}/export"}
    kubectl = dev_cluster.control_plane.run_kubectl
    wide = kubectl("get", "kj", JOB, "-n", NS, "-o", "wide").stdout
    assert f"{CHECKPOINTS}:{uid}/export" in wide and "EXPORT" in wide.splitlines()[0]
    assert f"{CHECKPOINTS}:{uid}/export" not in kubectl("get", "kj", JOB, "-n", NS).stdout  # -o wide only

    pods = core.list_namespaced_pod(NS, label_selector=f"kareus.dev/job-name={JOB},kareus.dev/role=train").items
    log = "".join(core.read_namespaced_pod_log(p.metadata.name, NS, container="kareus") for p in pods)
    assert "initialising the weights from" in log and f"/var/kareus/pretrained/{MODEL_DIR}" in log, log[-3000:]

    on_claim = claim_dir(dev_cluster, core, CHECKPOINTS)
    export = on_claim / uid / "export"
    assert not (on_claim / uid / "export.partial").exists()
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert index["metadata"]["kareus_step"] == STEPS
    step_dir = on_claim / JOB / f"step-{STEPS:08d}"  # the final step's checkpoint, saved for the export
    assert json.loads((step_dir / "kareus-checkpoint.json").read_text())["reason"] == "final"

    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    exported, trained = hf_logits(export, tokens), checkpoint_logits(step_dir, tokens)
    assert (exported - trained).abs().max() < 1e-5  # 6.6e-7 measured
    assert (exported - hf_logits(tmp_path / "hf", tokens)).abs().max() > 1e-3  # it trained from there (1.73)
