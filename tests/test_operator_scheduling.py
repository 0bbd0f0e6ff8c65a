"""Scheduling as GPU clusters need it, on the real scheduler: a job that pins no GPU product runs on
a node of another product (an emulated H100 with GPU Feature Discovery's labels) even when the node
carries the `nvidia.com/gpu` taint, and the job records the product it ran on. Pod-template
overrides reach the pods (here a nodeSelector that sends them to that node).
"""

from __future__ import annotations

import pytest
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from operator_fakes import fake_manifest, settings_env

GROUP, VERSION, PLURAL, NS = "kareus.dev", "v1alpha1", "kareusjobs", "sched"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def h100_node(dev_cluster):
    name = dev_cluster.add_node(gpus=4, gpu_product="H100-SXM5-80GB", taint=True)
    yield name
    dev_cluster.remove_node(name)


@pytest.fixture(scope="module")
def api(dev_cluster, h100_node, tmp_path_factory):
    objects = dev_cluster.install_operator("sched", "sched-system", watch_namespaces=[NS],
                                           settings=settings_env(tmp_path_factory.mktemp("fakes")))
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    yield client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    dev_cluster.uninstall(objects)


def test_an_unpinned_job_runs_on_a_tainted_node_of_another_product(api, h100_node):
    core, jobs = api
    node = core.read_node(h100_node)
    assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-SXM5-80GB"
    assert [t.key for t in node.spec.taints or []] == ["nvidia.com/gpu"]
    job = fake_manifest()
    job["metadata"] = {"name": "anygpu", "namespace": NS}
    del job["spec"]["training"]["command"]  # the fake train command
    del job["spec"]["gpu"]  # no product: any GPU node will do
    job["spec"]["podTemplateOverrides"] = [{"roles": ["profile", "train"],
                                            "spec": {"nodeSelector": {"kubernetes.io/hostname": h100_node}}}]
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    done = wait_until(lambda: read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL,
                                                                                    "anygpu")),
                      lambda j: j is not None and (j.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
                      timeout_s=180, what="KareusJob anygpu", interval_s=0.5)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert done["status"]["gpuProduct"] == "NVIDIA-H100-SXM5-80GB"
    pods = core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=anygpu").items
    gpu_pods = [p for p in pods if p.metadata.labels["kareus.dev/role"] in ("profile", "train")]
    assert gpu_pods and all(p.spec.node_name == h100_node for p in gpu_pods)
    assert all("nvidia.com/gpu.product" not in (p.spec.node_selector or {}) for p in gpu_pods)
