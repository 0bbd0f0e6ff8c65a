"""End to end across two real nodes: a pipeline-parallel job whose stages run on different nodes.

The quickstart's model on tensor parallel 2 × pipeline 2: an Indexed training Job of two pods, kept on
different nodes by the job's own pod anti-affinity (a `podTemplateOverrides` entry). Node rank 1 finds
rank 0 through the headless Service's DNS name (`<job>-train-0.<job>-train.<ns>.svc`, answered by CoreDNS)
and torch's gloo traffic crosses the pod network between the nodes' namespaces. The namespace enforces Pod
Security `restricted`.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
GROUP, VERSION, PLURAL, NS = "kareus.dev", "v1alpha1", "kareusjobs", "pipeline"
SETTINGS = {"RESYNC_S": "2", "BACKOFF_BASE_S": "1", "PROGRESS_INTERVAL_S": "0.5", "LEASE_DURATION_S": "4"}
STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


@pytest.fixture(scope="module")
def cluster(dev_cluster):
    second = dev_cluster.add_node(gpus=dev_cluster.gpus_per_node)
    objects = dev_cluster.install_operator("pipeline", "pipeline-system", watch_namespaces=[NS], settings=SETTINGS)
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core = client.CoreV1Api(api_client)
    core.patch_namespace(NS, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    yield client.CustomObjectsApi(api_client), core, second
    dev_cluster.uninstall(objects)
    dev_cluster.remove_node(second)


def two_node_job(name: str) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"]["name"] = name
    job["spec"]["parallelism"].update(tensor=2, pipeline=2)
    job["spec"]["training"].update(nodes=2, gpusPerNode=2, steps=STEPS)
    spread = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"kareus.dev/job-name": name, "kareus.dev/role": "train"}},
        "topologyKey": "kubernetes.io/hostname"}]}}
    job["spec"]["podTemplateOverrides"] = [{"roles": ["train"], "spec": {"affinity": spread}}]
    return job


def test_a_pipeline_across_two_nodes_trains_through_the_pod_network(cluster, dev_cluster):
    jobs, core, second = cluster
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, two_node_job("pipe"))
    done = wait_until(lambda: read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "pipe")),
                      lambda j: (j or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"), timeout_s=420,
                      what="the two-node job")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert done["status"]["measured"]["iterations"] == STEPS
    pods = core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=pipe,kareus.dev/role=train").items
    by_index = {int(p.metadata.labels["batch.kubernetes.io/job-completion-index"]): p for p in pods
                if p.status.phase == "Succeeded"}
    assert sorted(by_index) == [0, 1]
    nodes = {index: pod.spec.node_name for index, pod in by_index.items()}
    assert len(set(nodes.values())) == 2 and second in nodes.values(), nodes
    addresses = {index: ipaddress.ip_address(pod.status.pod_ip) for index, pod in by_index.items()}
    networks = {index: ipaddress.ip_network(f"{address}/24", strict=False) for index, address in addresses.items()}
    assert networks[0] != networks[1]  # each node's own pod range: the ranks talked across nodes
    service = core.read_namespaced_service("pipe-train", NS)
    assert service.spec.cluster_ip == "None"  # headless: the DNS name is the pod's own address
    env = {e.name: e.value for e in by_index[1].spec.containers[0].env if e.value is not None}
    assert env["MASTER_ADDR"] == f"pipe-train-0.pipe-train.{NS}.svc"
    log = core.read_namespaced_pod_log(by_index[0].metadata.name, NS)
    assert f"kareus train: {STEPS} steps" in log, log[-2000:]
