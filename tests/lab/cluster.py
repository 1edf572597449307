"""The lab's cluster for the lab tests: ``infra.lab.cluster`` (one component per host), under the names
these tests and the two-region cluster import."""

from infra.lab.cluster import (
    NODE_PORT,
    NODES,
    PG_BIN,
    PG_PORT,
    REDIS_PORT,
    ROUTER_PORT,
    SPEC,
    START_TIMEOUT_S,
    LabCluster,
    lab_cluster,
    node_id,
)

__all__ = [
    "NODES",
    "NODE_PORT",
    "PG_BIN",
    "PG_PORT",
    "REDIS_PORT",
    "ROUTER_PORT",
    "SPEC",
    "START_TIMEOUT_S",
    "LabCluster",
    "lab_cluster",
    "node_id",
]
