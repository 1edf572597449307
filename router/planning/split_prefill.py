"""Split prefill: one cold prompt computed by two idle colocated nodes at once, a layer apart.

    router   plan: X serves the request (colocated); X and a peer Y are idle, both run our connector
             (``--peer-kv``), and X would compute at least ``min_tokens`` of the prompt itself
      ─▶ Y   POST /v1/completions {prompt: ids[:P], max_tokens: 1, do_remote_decode, tandem_layerwise_id=T}
             Y computes the prefix and serves each layer of it as it is written (a layer-wise lease)
      ─▶ X   at the same time, the request itself with kv_transfer_params = layer-wise params naming Y's
             block server and T, ``prefix_tokens=P``, ``split``: X's engine schedules the rest of the
             prompt at once and each of its attention layers waits for Y's KV of that layer
             (``kv_connector.layer_gate``), so both halves are computed together

A prompt's prefill then takes about its larger half plus one layer. Loading the prefix first and
computing the rest after it (a peer fetch of a prefix the peer computes) takes both halves one after
the other, no sooner than X alone. Measured on a 2-core AMD EPYC host, two one-core colocated nodes,
SmolLM2-135M, cold 1,536-token prompts, TTFT alone against split, alternated: 3.05-3.25 s against
1.83-1.87 s; prefix loaded first: 3.25 s; the answers equal, greedy, to the peer's own of the prompt.

P balances the halves: Y computes [its own hit, P), X computes [P, n); P is whole blocks and leaves X at
least the prompt's last token. X's own hit is pulled past, not over (``decode_nodes.admission``).

Only between idle nodes. X's engine waits inside its forward pass, which would hold every other stream
on X for the length of Y's half; and Y's half delays whatever Y serves. So both must show nothing
running or waiting (their last heartbeat, less this router's requests there that ended since it was
taken: another router's are not told apart, and at worst a split then meets a busy node and its stall
gives it up), nothing this router has in flight there (its live count, not
the snapshot the request was routed from), and no split under way (two prompts split in opposite
directions over the same nodes would each wait on the other until the stall). A burst of cold prompts
thus splits its first one and routes the rest as usual: in ``bench fleet``'s burst (three cold contexts
on two nodes) the last first turn ended at 5.4-5.6 s instead of 6.1-6.6 (one context alone: 3.1-3.5 s;
an even spread of the work would end at 1.5 of those).

Other requests wait for the split's steps to start: vLLM adds a waiting request to the step it starts
next, up to its token budget, so a cold prompt routed to X or Y a few milliseconds after the split
would share that step and stretch it, and the split's first token would come only when both prompts'
tokens are computed (in ``bench fleet``'s burst the split prompt's TTFT was 2.5-2.7 s without the hold,
2.2-2.4 s with it; 1.85 s alone). For ``HOLD_S`` after a split, a request routed to either node waits
before it is sent (``wait_hold``); it then runs in the step after, which is where it would have
finished anyway.

Failures: Y's leg failing ends its lease (the prefill node aborts the fill: X's pull fails at once), or
Y goes silent (X gives its pull up after ``ConnectorSettings.split_stall_s``); X then recomputes the
prefix (``kv_load_failure_policy``) and the request is answered. The router does not retry it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.planning.peer_fetch import OwnPrefix, peers_of, serves_peers
from router.policies.base import Candidate

HOLD_S = 0.1
"""How long after a split's legs are sent other requests to its two nodes wait (the module docstring):
time for an idle engine's API server to take a request and its scheduler to start a step on it."""


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """``helper`` computes the prompt's first ``prefix_tokens`` while the serving node computes the rest."""

    helper: Candidate
    prefix_tokens: int
    local_tokens: int
    """Of the prompt, what the serving node reuses itself (the fleet index's view)."""


EndedSince = Callable[[str, float], int]
"""(node id, time) -> this router's requests on that node that ended after that time (``Fleet.ended_since``)."""


def _none_ended(node_id: str, t: float) -> int:
    return 0


def idle(c: Candidate, ended_since: EndedSince = _none_ended) -> bool:
    """Nothing of this router's in flight there, and nothing running or waiting at its last heartbeat but
    what this router's requests that ended since then account for. A heartbeat is up to its interval old
    (2 s): one taken while a short request of ours ran there, read after it ended, said busy when the
    node was not, and the burst of cold prompts that came next was not split (``bench fleet``: 23.4 s
    for its last first turn, against 20.5 s in the other round, where the split ran)."""
    load = c.node.load
    busy = load.running + load.waiting
    return c.inflight == 0 and (busy == 0 or busy <= ended_since(c.node_id, load.updated_at))


class SplitPrefill:
    def __init__(self, index: OwnPrefix, min_tokens: int, hold_s: float = HOLD_S) -> None:
        self.index = index
        self.min_tokens = min_tokens
        self.hold_s = hold_s
        self._held: dict[str, float] = {}
        """node id -> monotonic time until which requests to it wait (a split's steps starting)."""

    def hold(self, *node_ids: str) -> None:
        """A split's legs were just sent to these nodes: hold other requests to them for ``hold_s``."""
        until = time.monotonic() + self.hold_s
        for node_id in node_ids:
            self._held[node_id] = until

    async def wait_hold(self, *node_ids: str | None) -> None:
        """Wait out the holds on these nodes (at once when none applies: the common case)."""
        if not self._held:
            return
        now = time.monotonic()
        for node_id, until in list(self._held.items()):
            if until <= now:
                del self._held[node_id]
        wait = max((self._held.get(n, now) for n in node_ids if n is not None), default=now) - now
        if wait > 0:
            await asyncio.sleep(wait)

    def _free(self, c: Candidate, inflight: Callable[[str], int], ended_since: EndedSince) -> bool:
        """Idle, by its candidate (a snapshot taken when the request was routed) and by this router's live
        count, and in no split's hold. Two prompts planned one after the other must not split in
        opposite directions over the same two nodes: each node's step would wait on the other's."""
        now = time.monotonic()
        return idle(c, ended_since) and inflight(c.node_id) == 0 and self._held.get(c.node_id, now) <= now

    def plan(
        self,
        model: str,
        keys: Sequence[int],
        prompt_tokens: int,
        target: Candidate,
        pool: Sequence[Candidate],
        inflight: Callable[[str], int] = lambda node_id: 0,
        ended_since: EndedSince = _none_ended,
    ) -> SplitPlan | None:
        """Whether ``target`` should compute this prompt with a peer of ``pool`` (see the module docstring);
        ``inflight``: this router's requests in flight on a node now (``Fleet.inflight``); ``ended_since``:
        its requests there that ended after a time (``Fleet.ended_since``)."""
        bs = target.node.info.block_size
        if prompt_tokens < self.min_tokens or not keys or bs <= 0 or not serves_peers(target):
            return None
        if not self._free(target, inflight, ended_since):
            return None
        helpers = [c for c in peers_of(target, pool) if self._free(c, inflight, ended_since)]
        if not helpers:  # (before the index walks: a busy fleet pays nothing per request)
            return None
        cap = (prompt_tokens - 1) // bs
        local = min(self.index.longest_prefix(model, keys).get(target.node_id, 0), cap) * bs
        if prompt_tokens - local < self.min_tokens:
            return None
        own = self.index.own_prefix(model, keys)
        helper = max(helpers, key=lambda c: (min(own.get(c.node_id, 0), cap), c.node_id))
        held = min(own.get(helper.node_id, 0), cap) * bs
        if prompt_tokens - held < self.min_tokens:
            return None  # the helper holds most of it: a fetch's business (router.planning.peer_fetch)
        prefix = min((prompt_tokens + held) // 2 // bs, cap) * bs
        if prefix - local < self.min_tokens // 2:
            return None  # the serving node already holds most of what the helper would compute
        return SplitPlan(helper, prefix, local)
