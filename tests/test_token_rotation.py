"""A training pod's node-agent token, rotated by the real kubelet, on the dev cluster: the lease on
the GPU's clock outlives the token it was taken with.

The GPU pods get a projected ServiceAccount token (audience kareus-node) that the node agent
reviews with the API server when a TCP session starts and again every `tokenReviewSeconds` (60 s,
the chart's default). The kubelet writes a new token at 80 % of its lifetime; the pod's clock
client must hand it to the agent on the live connection (its keeper thread does so even when a
one-clock plan sends nothing for hours), or the first review after the old token expires ends
the lease and the GPU goes back to its default clock.

The job runs with `workers.nodeTokenExpirationSeconds` at the API server's floor, 600 s, so the
test needs about 13 minutes of real time: more than the rest of the suite can spare, so it runs
only with KAREUS_TOKEN_ROTATION=1 (`make test-token-rotation`).
"""

from __future__ import annotations

import base64
import json
import time

import pytest
import yaml
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from test_e2e_quickstart import QUICKSTART, agent_metrics_url, locked_by

GROUP, VERSION, PLURAL, NS = "kareus.dev", "v1alpha1", "kareusjobs", "rotation"
TOKEN_S = 600  # the TokenRequest API's floor
REVIEW_S = 60  # the chart's nodeAgent tokenReviewSeconds: how late an expired token can be noticed
TOKEN_FILE = "/var/run/secrets/kareus.dev/node/token"

pytestmark = pytest.mark.timeout(1500)  # collected only with KAREUS_TOKEN_ROTATION=1 (tests/conftest.py)


@pytest.fixture(scope="module")
def cluster(dev_cluster):
    values = dev_cluster.values(operator=True, node_agent=False, worker_namespaces=[NS], watch_namespaces=[NS],
                                crds=False, settings={"RESYNC_S": "2", "PROGRESS_INTERVAL_S": "5"})
    values["workers"]["nodeTokenExpirationSeconds"] = TOKEN_S  # what a user sets in the chart's values
    objects = dev_cluster.install("rotation", "rotation-system", values)
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core = client.CoreV1Api(api_client)
    core.patch_namespace(NS, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    yield dev_cluster, client.CustomObjectsApi(api_client), core
    dev_cluster.uninstall(objects)


def claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_a_lease_outlives_the_token_it_was_taken_with(cluster):
    dev_cluster, jobs, core = cluster
    apps = client.AppsV1Api(core.api_client)
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"]["name"] = "rotation"
    job["spec"]["training"]["steps"] = 50000  # trains far longer than the test watches
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    url = agent_metrics_url(core, apps)
    selector = "kareus.dev/job-name=rotation,kareus.dev/role=train"

    def locking_train_pod() -> str | None:
        pods = {p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=selector).items
                if p.status.phase == "Running"}
        return next(iter(pods & locked_by(url)), None)

    pod = wait_until(locking_train_pod, bool, timeout_s=420, what="a training pod holding a clock lock")

    def token() -> dict:
        return claims(dev_cluster.kubectl("-n", NS, "exec", pod, "--", "cat", TOKEN_FILE).stdout.strip())

    first = token()
    assert first["aud"] == ["kareus-node"] and first["exp"] - first["iat"] == TOKEN_S
    assert first["kubernetes.io"]["pod"]["name"] == pod
    # Watch until the first token has expired and the agent has had two reviews to notice.
    tokens, polls, held = {first["iat"]: first}, 0, 0
    while time.time() < first["exp"] + 2 * REVIEW_S + 10:
        time.sleep(10)
        polls += 1
        held += pod in locked_by(url)
        now = token()
        tokens.setdefault(now["iat"], now)
    rotated = sorted(tokens)
    assert len(rotated) >= 2, f"the kubelet never rotated the token (iat {rotated})"
    second = tokens[rotated[1]]
    assert second["kubernetes.io"]["pod"]["uid"] == first["kubernetes.io"]["pod"]["uid"]
    # The kubelet rotates at 80 % of the lifetime (plus up to 10 s of jitter).
    assert 0.8 * TOKEN_S <= second["iat"] - first["iat"] <= 0.8 * TOKEN_S + 60
    assert pod in locked_by(url), "the lease ended with the first token"
    assert held == polls, f"the lock was held at {held} of {polls} looks"
    status = (read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "rotation"))
              or {}).get("status") or {}
    degraded = [c for c in status.get("conditions", []) if c["type"] == "ClockControlDegraded"]
    assert not any(c["status"] == "True" for c in degraded), degraded
    print(f"token rotated after {second['iat'] - first['iat']} s; lock held at {held}/{polls} looks up to "
          f"{time.time() - first['exp']:.0f} s after the first token expired")
    jobs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "rotation")
    wait_until(lambda: core.list_namespaced_pod(NS, label_selector=selector).items, lambda pods: not pods,
               timeout_s=120, what="the training pods gone")
