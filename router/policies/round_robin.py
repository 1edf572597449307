"""round_robin: each pool takes its nodes in turn.

Candidates are ordered by node id; each pool (prefill, decode) has its own counter, advanced once
per request, and the node at ``counter % len(pool)`` is chosen, so nodes joining or leaving only
shift the rotation. No thresholds. It ignores load and cache: the baseline the benchmark compares
against. With an empty prefill pool the decode node prefills itself.
"""

from __future__ import annotations

from router.policies.base import Candidate, Decision, PolicyName, ReasonCode, RoutingRequest


class RoundRobin:
    name = PolicyName.ROUND_ROBIN.value

    def __init__(self) -> None:
        self._prefill_turn = 0
        self._decode_turn = 0

    def select(self, request: RoutingRequest, prefill: list[Candidate], decode: list[Candidate]) -> Decision:
        ds = sorted(decode, key=lambda c: c.node_id)
        d = ds[self._decode_turn % len(ds)]
        self._decode_turn += 1
        p = None
        if prefill:
            ps = sorted(prefill, key=lambda c: c.node_id)
            p = ps[self._prefill_turn % len(ps)]
            self._prefill_turn += 1
        return Decision(
            decode=d,
            prefill=p,
            policy=self.name,
            code=ReasonCode.ROUND_ROBIN,
            decode_code=ReasonCode.ROUND_ROBIN,
            reason="round robin",
        )

    def on_split(self, decision: Decision, helper: str, prefix_tokens: int) -> None:
        pass

    def on_prefilled(self, decision: Decision) -> None:
        return None

    def on_complete(self, decision: Decision) -> None:
        return None
