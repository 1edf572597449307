"""least_loaded: pick, in each pool, the node with the fewest requests on it.

Load of a node = requests this router has in flight there + requests the engine reports waiting
(its last heartbeat, at most one TTL old). The router's own in-flight count reacts at once to a
burst; the engine's waiting count covers other routers' traffic. Ties go to the lower KV usage,
then to the node id so the choice is deterministic.
"""

from __future__ import annotations

from router.policies.base import Candidate, Decision, PolicyName, ReasonCode, RoutingRequest


def _load_key(c: Candidate) -> tuple[float, float, str]:
    return (c.inflight + c.node.load.waiting, c.node.load.kv_usage, c.node_id)


class LeastLoaded:
    name = PolicyName.LEAST_LOADED.value

    def select(self, request: RoutingRequest, prefill: list[Candidate], decode: list[Candidate]) -> Decision:
        d = min(decode, key=_load_key)
        p = min(prefill, key=_load_key) if prefill else None
        chosen = p or d
        return Decision(
            decode=d,
            prefill=p,
            policy=self.name,
            code=ReasonCode.LEAST_LOADED,
            decode_code=ReasonCode.LEAST_LOADED,
            reason="fewest requests in flight",
            load=float(chosen.inflight + chosen.node.load.waiting),
        )

    def on_split(self, decision: Decision, helper: str, prefix_tokens: int) -> None:
        pass

    def on_prefilled(self, decision: Decision) -> None:
        return None

    def on_complete(self, decision: Decision) -> None:
        return None
