"""One lab cluster for the cluster-across-hosts modules, started once.

``lc``: the lab cluster (``infra.lab.cluster``: router, prefill, decode and colocated hosts, a store host
with a lake writer, a client host) that ``test_faults_hosts`` fires its faults on and ``test_pd_hosts``
then serves P/D on. Three engines and a lab take about a minute on a 2-core host; each module leaves the
cluster whole (every fault healed, a lost node started again). It is stopped when this folder's tests
end, before the other lab modules start labs of their own: its idle engines slowed their starts.

``machine``: a thread in the machine's own namespace, where link changes, host kills and restarts run
(not in the client host's, where the tests' requests come from). It lives as long as ``lc``: a node
started again from it holds a parent-death signal bound to that thread (``node_agent.lifetime``), and
would die with it: a module-scoped thread took the decode node it had restarted down at the end of
the faults module, and the P/D module found that node's engine gone."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.lab.network import LabSpec
from tests.lab.cluster import SPEC, LabCluster, lab_cluster

HOSTS_SPEC = LabSpec("pdf", SPEC.hosts, net=233)


@pytest.fixture(scope="package")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabCluster]:
    with lab_cluster(tmp_path_factory.mktemp("lab"), HOSTS_SPEC, lake=True) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def machine(lc: LabCluster) -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()
    yield pool
    pool.shutdown()
