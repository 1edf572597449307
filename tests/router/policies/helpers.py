from __future__ import annotations

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.policies.base import Candidate


def cand(
    node_id: str,
    role: Role = Role.PREFILL,
    *,
    inflight: int = 0,
    waiting: int = 0,
    running: int = 0,
    kv_usage: float = 0.0,
    block_size: int = 16,
) -> Candidate:
    info = NodeInfo(
        node_id=node_id,
        role=role,
        model="m",
        url=f"http://{node_id}:8000",
        block_size=block_size,
        max_model_len=8192,
        kv_connector="nixl",
    )
    load = NodeLoad(running=running, waiting=waiting, kv_usage=kv_usage)
    return Candidate(node=LiveNode(info=info, load=load), inflight=inflight)
