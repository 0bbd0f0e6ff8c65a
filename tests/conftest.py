"""Shared fixtures: one real Kubernetes control plane per test session, a namespace per test.

The control plane is the pinned release built by `make kube` (tools/kube/build.sh); when its
binaries are missing and cannot be built, every test that needs it fails with one line saying
why — never a skip, so CI cannot pass without having run them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import os
import re
import sys
from pathlib import Path

import pytest

_namespaces = itertools.count()

# ~13 min of real time (the shortest projected token lives 600 s): `make test-token-rotation` only, so
# that `make test` neither waits for it nor reports it skipped.
collect_ignore = [] if os.environ.get("KAREUS_TOKEN_ROTATION") == "1" else ["test_token_rotation.py"]


# A module is a cluster module when it names one of the fixtures below or starts `kareus dev-cluster`
# itself. Read from its source, since xdist's controller schedules by node id and collects nothing.
_CLUSTER_SOURCE = re.compile(r"\b(control_plane|dev_cluster|kube_client|kubectl|kueue)\b|kareus_devcluster|dev-cluster")
# The cluster modules that wait longest (measured in full runs: Prometheus windows, several jobs end to
# end, whole dev clusters started and stopped), handed out first so that none of them is the tail.
_SLOWEST_FIRST = ("test_power_budget_measured.py", "test_dashboards_live.py", "test_operator_power_budget.py",
                  "test_e2e_quickstart.py", "test_kueue_energy_budget.py", "test_dev_cluster_cli.py",
                  "test_e2e_two_nodes.py", "test_e2e_checkpoint.py")
# Likewise the longest CPU-bound modules (multi-rank torch on gloo, `kareus run`), first of theirs, so that
# the run does not end on one of them while the other workers have nothing left.
_SLOWEST_CPU_FIRST = ("test_runtime_checkpoint.py", "test_runtime_dist.py", "test_run_quickstart.py",
                      "test_runtime_hf_parity.py", "test_hf_roundtrip.py", "test_runtime_recipe.py",
                      "test_golden_losses.py", "test_memory_plan_measured.py", "test_runtime_reload.py",
                      "test_runtime_train.py", "test_runtime_p2p.py")
# Workers gw0 and gw1 may run cluster modules, each on a control plane and dev cluster of its own; any
# further worker (`make test TEST_WORKERS=3`) runs CPU-bound modules only, from the start, on the CPU the
# cluster modules leave idle while they wait on pods, and never starts a third cluster.
_CLUSTER_WORKERS = 2


@functools.cache
def _cluster_module(path: Path) -> bool:
    return bool(_CLUSTER_SOURCE.search(path.read_text()))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs three pytest-xdist workers, each module whole on one of them (its module-scoped
    fixtures, an operator release or a cluster of its own, made once). A worker that runs a cluster
    module starts its own control plane and dev cluster (session fixtures are per worker; the dev
    clusters take separate network slots and cgroup roots), so the cluster modules, which mostly wait
    on pods, watches and Prometheus windows, run two at a time on the first two workers. They go out
    first, slowest first; the CPU-bound modules follow, longest first. The third worker takes
    CPU-bound modules only, from the start."""
    from xdist.scheduler import LoadScopeScheduling

    def rank(scope: str) -> tuple[int, int]:
        name = Path(scope).name
        if name in _SLOWEST_FIRST:
            return 0, _SLOWEST_FIRST.index(name)
        if _cluster_module(config.rootpath / scope):
            return 1, 0
        if name in _SLOWEST_CPU_FIRST:
            return 2, _SLOWEST_CPU_FIRST.index(name)
        return 3, 0

    class SlowestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            order = sorted(self.workqueue, key=rank)  # stable: the queue's order within a rank
            if int(node.gateway.id.removeprefix("gw")) >= _CLUSTER_WORKERS:
                # A CPU-only worker: the first CPU-bound module; a cluster module only when none is left
                # (the run must still end), which the ranks make the rare case.
                order.sort(key=lambda scope: rank(scope)[0] < 2)
            for scope in order:
                self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return SlowestFirst(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once a worker moves from its last cluster module to the CPU-bound ones, its control plane and
    dev cluster (and every session fixture built on them) are stopped: idle, they still cost a share
    of a core (API server, etcd, kubelet, Prometheus scrapes) that the torch modules then lack. The
    scheduler above hands out every cluster module before any other, so none follows; if one did,
    pytest would start them again (a finished fixture is made anew when next requested). Without
    xdist, modules run in file order, mixed, and the cluster stays up to the end."""
    result = yield
    ordered = hasattr(item.config, "workerinput")  # an xdist worker, fed by the scheduler above
    if ordered and nextitem is not None and _cluster_module(item.path) and not _cluster_module(nextitem.path):
        for fixturedef in item.session._fixturemanager.getfixturedefs("control_plane", item) or ():
            fixturedef.finish(item._request)  # its dependants (dev_cluster, kube_client, ...) first
    return result


def pytest_collection_finish(session):
    """Before any test runs, when any will use the dev cluster: the images it runs (`make images`), so
    that a rebuild after a change of code (minutes) is never charged to one test's timeout. `make test`
    has built them already; then this only checks their content hashes."""
    if not any("dev_cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from kareus_devcluster.images import cache_dir, node_images
    from kareus_devcluster.node import image_store

    from kareus.errors import KareusError

    try:
        image_store(node_images(), cache_dir() / "containerd")
    except KareusError as error:
        pytest.exit(f"the dev cluster's images could not be built: {error}", returncode=1)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    from kareus_devcluster.controlplane import ControlPlane, binaries_dir

    from kareus.errors import KareusError

    try:
        directory = binaries_dir(build=True)
    except KareusError as error:
        pytest.fail(f"no Kubernetes control plane: {error}", pytrace=False)
    with ControlPlane(tmp_path_factory.mktemp("controlplane"), binaries=directory) as plane:
        yield plane


@pytest.fixture(scope="session")
def kube_client(control_plane):
    """The official `kubernetes` client (an `ApiClient`) logged in as the cluster admin."""
    from kubernetes import config

    return config.new_client_from_config(config_file=str(control_plane.admin.kubeconfig))


@pytest.fixture
def namespace(control_plane, kube_client, request):
    """A fresh namespace for one test, deleted (asynchronously, as a real cluster does) afterwards."""
    from kubernetes import client

    core = client.CoreV1Api(kube_client)
    name = f"t{next(_namespaces)}-{request.node.name.lower()}"
    name = "".join(ch if ch.isalnum() else "-" for ch in name)[:50].strip("-")
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    with contextlib.suppress(Exception):
        core.delete_namespace(name)


@pytest.fixture(scope="session")
def kubectl(control_plane):
    """`kubectl(*args, input=None, check=True)`: the pinned kubectl as the admin, output as text."""
    return control_plane.run_kubectl


@pytest.fixture(scope="session")
def dev_cluster(control_plane, tmp_path_factory):
    """The session's cluster: the control plane above, one emulated GPU node (8 simulated A100s) and
    the chart's platform release (CRD, node agent; operator scaled to 0). Test modules install their
    own operator releases (`DevCluster.install_operator`), each watching only its namespaces."""
    from kareus_devcluster.cluster import DevCluster

    with DevCluster(tmp_path_factory.mktemp("devcluster"), control_plane=control_plane, operator=False,
                    worker_namespaces=()) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kueue(dev_cluster, tmp_path_factory):
    """The real Kueue controller beside the session's cluster, for one test module (its webhooks are
    removed when the module ends, so the other modules' Jobs are not Kueue's)."""
    from kareus_devcluster.kueue import DevKueue

    with DevKueue(tmp_path_factory.mktemp("kueue"), dev_cluster.control_plane) as running:
        yield running


@pytest.fixture(scope="module")
def dc():
    """`bench/device_check.py` loaded as the module `device_check` (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("device_check", Path(__file__).resolve().parent.parent / "bench" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module
    spec.loader.exec_module(module)
    return module
