"""Two operator replicas: exactly one leads (a Lease), the leader's death hands over, no child twice.

The replicas run on two emulated nodes (each node has its own loopback address, so both can serve
metrics on the chart's port); a required pod anti-affinity keeps them apart, as a platform team
would. The leader is force-deleted while a job trains: a surviving replica must take the Lease
within a bounded time and finish the job without creating any child a second time. Which survivor
wins is a race the design allows: the follower, or the replacement pod the ReplicaSet starts while
the dead leader's container is still shutting down (a real kubelet gives a force-deleted pod its
grace period) — both are candidates, and the Lease decides.
"""

from __future__ import annotations

import time

import pytest
from kube_helpers import PodRecorder, wait_until
from kubernetes import client, config
from operator_fakes import conditions, fake_manifest, settings_env

NS, RELEASE = "ha", "ha"
GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
SELECTOR = f"app.kubernetes.io/component=operator,app.kubernetes.io/instance={RELEASE}"
LEASE_S = 4.0

pytestmark = pytest.mark.timeout(300)

SPREAD = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
    {"topologyKey": "kubernetes.io/hostname",
     "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                       "app.kubernetes.io/instance": RELEASE}}}]}}


@pytest.fixture
def second_node(dev_cluster):
    name = dev_cluster.add_node()
    yield name
    dev_cluster.remove_node(name)


def holder(coordination: client.CoordinationV1Api) -> str:
    return coordination.read_namespaced_lease(f"{RELEASE}-kareus-operator", f"{RELEASE}-system").spec.holder_identity


def operator_pods(core: client.CoreV1Api) -> list:
    return [p for p in core.list_namespaced_pod(f"{RELEASE}-system", label_selector=SELECTOR).items
            if p.metadata.deletion_timestamp is None]


def test_one_leader_and_a_bounded_handover(dev_cluster, second_node, tmp_path):
    settings = settings_env(tmp_path, step_s=0.3, steps=40) | {"KAREUS_OPERATOR_LEASE_DURATION_S": str(LEASE_S)}
    objects = dev_cluster.install_operator(RELEASE, f"{RELEASE}-system", watch_namespaces=[NS], settings=settings,
                                           operator_values={"replicas": 2, "affinity": SPREAD})
    api = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core, jobs = client.CoreV1Api(api), client.CustomObjectsApi(api)
    coordination = client.CoordinationV1Api(api)
    try:
        pods = operator_pods(core)
        assert len(pods) == 2 and len({p.spec.node_name for p in pods}) == 2
        leader = wait_until(lambda: holder_or_none(coordination), bool, timeout_s=60, what="a Lease holder")
        names = {p.metadata.name for p in pods}
        assert leader in names
        (follower,) = names - {leader}
        wait_log(core, follower, "waiting for the Lease")

        with PodRecorder(core, NS) as seen:
            job = fake_manifest()
            del job["spec"]["training"]["command"]
            jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
            wait_phase(jobs, "Training")
            core.delete_namespaced_pod(leader, f"{RELEASE}-system", grace_period_seconds=0)
            deleted_s, timeline = time.monotonic(), []

            def successor() -> str | None:
                who = holder_or_none(coordination)
                live = {p.metadata.name for p in operator_pods(core)} - {leader}
                if not timeline or timeline[-1][1:] != (who, sorted(live)):
                    timeline.append((round(time.monotonic() - deleted_s, 1), who, sorted(live)))
                return who if who in live else None

            # The handover is bounded: the dead leader releases the Lease when its container stops,
            # and at worst its record expires a lease duration after its last renewal.
            try:
                new_leader = wait_until(successor, bool, timeout_s=3 * LEASE_S + 10,
                                        what="a surviving replica taking the Lease")
            except AssertionError as error:
                raise AssertionError(f"{error}; (s after the delete, holder, live replicas): {timeline}") from None
            final = wait_phase(jobs, "Succeeded", "Failed", timeout_s=180)
        assert final["status"]["phase"] == "Succeeded"
        assert conditions(final)["Complete"] == ("True", "Completed") and final["status"]["restarts"] == 0
        assert sorted(seen) == ["quickstart-optimize", "quickstart-profile", "quickstart-train-0"]  # by role and index
        assert all(len(uids) == 1 for uids in seen.values()), dict(seen)
        # Of the two live replicas (the follower and the ReplicaSet's replacement), the one that did
        # not win is a candidate, not a second actor.
        live = {p.metadata.name for p in operator_pods(core)}
        assert len(live) == 2 and follower in live and holder(coordination) == new_leader
        (candidate,) = live - {new_leader}
        wait_log(core, candidate, "waiting for the Lease")
    finally:
        dev_cluster.uninstall(objects)


def holder_or_none(coordination: client.CoordinationV1Api) -> str | None:
    try:
        return holder(coordination) or None
    except client.ApiException:
        return None


def wait_log(core: client.CoreV1Api, pod: str, text: str, timeout_s: float = 30.0) -> None:
    wait_until(lambda: core.read_namespaced_pod_log(pod, f"{RELEASE}-system"), lambda log: text in log,
               timeout_s=timeout_s, what=f"{text!r} in the log of {pod}")


def wait_phase(jobs: client.CustomObjectsApi, *phases: str, timeout_s: float = 90.0) -> dict:
    return wait_until(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "quickstart"),
                      lambda job: (job.get("status") or {}).get("phase") in phases, timeout_s=timeout_s,
                      what=f"phase {'/'.join(phases)}")
