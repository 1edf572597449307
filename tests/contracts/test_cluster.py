"""Cluster names keep clusters apart on one Redis: the registry of one never lists another's nodes,
and the default cluster reads keys written before names existed."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from contracts import cluster
from contracts.config import redis_url
from contracts.registry import NodeInfo, NodeRegistry, Role, node_key, nodes_set


def test_names_are_validated() -> None:
    assert cluster.validate("staging-2") == "staging-2"
    for bad in ("", "A", "a:b", "a/b", "-a", "x" * 41):
        with pytest.raises(ValueError):
            cluster.validate(bad)


def test_an_unnamed_launch_is_the_default_cluster_whatever_its_port() -> None:
    from infra.launcher import Cluster, ClusterSpec

    assert Cluster(ClusterSpec(router_port=19050)).name == "default"
    assert Cluster(ClusterSpec(router_port=19050, cluster="staging")).name == "staging"


def test_default_cluster_keeps_unprefixed_keys_and_paths() -> None:
    assert cluster.key("default", "node", "n1") == "tandem:node:n1" == node_key("n1")
    assert nodes_set() == "tandem:nodes"
    assert cluster.key("a", "node", "n1") == "tandem:a:node:n1"
    assert cluster.runtime_dir("a") == cluster.runtime_dir("default") / "a"
    assert cluster.suffix("default") == "" and cluster.suffix("a") == "-a"


def _info(node_id: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=Role.BOTH,
        model="m",
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=64,
        kv_connector="none",
    )


async def test_registries_of_two_clusters_see_only_their_nodes() -> None:
    client = aioredis.from_url(redis_url())
    tag = uuid.uuid4().hex[:8]
    a, b = f"a{tag}", f"b{tag}"
    ra, rb = NodeRegistry(client, cluster=a), NodeRegistry(client, cluster=b)
    try:
        await ra.register(_info(f"na-{tag}"))
        await rb.register(_info(f"nb-{tag}"))
        assert [n.info.node_id for n in await ra.live_nodes()] == [f"na-{tag}"]
        assert [n.info.node_id for n in await rb.live_nodes()] == [f"nb-{tag}"]
        assert f"na-{tag}" not in {n.info.node_id for n in await NodeRegistry(client).live_nodes()}
    finally:
        await ra.deregister(f"na-{tag}")
        await rb.deregister(f"nb-{tag}")
        await client.aclose()


def test_default_secret_is_one_per_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from contracts.secret import default_secret_path

    monkeypatch.delenv(cluster.CLUSTER_ENV, raising=False)
    unnamed = default_secret_path()
    monkeypatch.setenv(cluster.CLUSTER_ENV, "default")
    assert default_secret_path() == unnamed  # an upgraded single cluster keeps its secret
    monkeypatch.setenv(cluster.CLUSTER_ENV, "a")
    a = default_secret_path()
    monkeypatch.setenv(cluster.CLUSTER_ENV, "b")
    assert len({unnamed, a, default_secret_path()}) == 3


def test_settings_refuse_a_bad_cluster_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from router.settings import RouterSettings

    monkeypatch.setenv(cluster.CLUSTER_ENV, "a:b")
    with pytest.raises(ValidationError):
        RouterSettings()
    monkeypatch.setenv(cluster.CLUSTER_ENV, "staging")
    assert RouterSettings().cluster == "staging"


def test_router_metrics_name_the_cluster() -> None:
    from prometheus_client import generate_latest

    from router.edge.app import create_app
    from router.settings import RouterSettings

    app = create_app(RouterSettings(cluster="staging"))
    assert b'tandem_cluster_info{cluster="staging"} 1.0' in generate_latest(app.state.metrics.registry)
