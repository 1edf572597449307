"""cache_aware (the default): send a prompt where its prefix is already cached, unless that node is
too busy; prefill on the decode node itself when little is left to compute or prefill is saturated.

Inputs: ``RoutingRequest.prompt_token_ids`` and ``block_keys`` (the router computes them with
``router.kv_index.BlockHasher``), and a ``PrefixLookup`` (the router's ``FleetIndex``) given to the
constructor, which tells per node how many leading blocks of the prompt it holds.

Per candidate n (block size bs = n's block size, P = prompt tokens):
    cached(n) = min(matched_blocks(n), (P - 1) // bs) * bs
                (vLLM never reuses a prompt's last token, so a whole-prompt match reuses one block less)
    load(n)   = requests this router has in flight on n + requests n's engine reports waiting
    pending(n) = leading blocks of the prompt that a prompt this router sent to n and not yet prefilled
                shares with it: cached(n) counts max(matched, pending) blocks. Two sessions of one
                repository that arrive together then meet on the node computing their context (the
                second waits for the first, then computes only its own turn) instead of computing it
                twice, once on each node, while other cold prompts queue behind them.
    queued(n) = uncached prompt tokens this router sent to n and not yet prefilled (released by
                ``on_prefilled`` when a streamed answer's first token arrives, else by ``on_complete``
                at the request's end) + n.waiting * waiting_request_tokens (other routers' queue,
                from heartbeats). Released at the end (as it once was), a node that decodes long
                answers looked busy with prompt work it had done: the queue then followed when answers
                ended, tens of milliseconds decided the node, and the router piled first turns
                onto the other node (five within 3 s in a replay, TTFT 4-5 s).

Decode node (chosen first):
    1. session affinity (``session_affinity``): the session's previous decode node, if still a
       candidate and load <= min load + imbalance_threshold;
    2. otherwise, if a candidate within that same load bound has P - cached(n) <=
       local_prefill_max_tokens, the one with the most cached tokens (it will prefill locally);
    3. otherwise the lowest running + waiting + inflight + decode_kv_weight * kv_usage.
    With no prefill pool (colocated nodes) the decode pool is scored as the prefill pool below.
Conditional disaggregation: ``prefill=None`` (the decode node prefills itself, no KV transfer) when
    P > 0 (token ids known) and P - cached(decode) <= local_prefill_max_tokens, or every prefill candidate has
    load >= prefill_saturation_load.
Peer reach (``PeerReach``, ``TANDEM_ROUTER_PEER_REACH``; on by default): for colocated nodes that serve
    peers, matched(n) also counts the leading blocks another such node's engine holds (what a peer fetch,
    ``router.planning.peer_fetch``, would load into n), as a node's host tier's blocks already count. A
    node that could fetch a context then ties with the node holding it, and the lighter queue, then load,
    decides. Without it a repository's later sessions follow its context onto one node however busy
    (``bench fleet`` at two nodes: six sessions on one node, three on the other, in every defaults round;
    five and four with a host tier, whose blocks both nodes match, and the tier arm faster).
A split prompt (``on_split``, ``router.planning.split_prefill``) moves its prefix's tokens from the serving
node's queue to the helper's, and the helper's pending blocks are the prefix.
Prefill node:
    score(n) = cached(n) - load_weight * queued(n); the highest wins (ties: lower load, node id).
    Load-imbalance guard: if max load - min load over the pool > imbalance_threshold, the least
    loaded node wins instead (as ``least_loaded``).

Reason codes (``ReasonCode``): the prefilling node's is best_prefix, load_guard (the guard above),
local_prefill or prefill_saturated (the two conditions of conditional disaggregation), or, colocated,
session_affinity; the decode node's is session_affinity, most_cached (rule 2) or least_busy (rule 3).

``Decision.extra``: prompt_tokens, fleet_cached_tokens (longest cached prefix on any node of the
model, candidate or not), routed_cached_tokens (predicted reuse on the node that prefills),
uncached_tokens, queued_tokens (what this decision added to that node's queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from router.policies.base import Candidate, Decision, PolicyName, ReasonCode, RoutingRequest


class PrefixLookup(Protocol):
    def longest_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """node id -> number of leading blocks of ``keys`` the node holds (absent: none)."""
        ...


@dataclass(frozen=True, slots=True)
class PeerReach:
    """What a peer fetch could load (the module docstring's peer reach): each engine's own leading blocks
    of a prompt (``FleetIndex.own_prefix``: a peer serves its engine's blocks, not its tier's), and
    whether a candidate serves and fetches peers' blocks (``router.planning.peer_fetch.serves_peers``)."""

    own_prefix: Callable[[str, Sequence[int]], dict[str, int]]
    serves_peers: Callable[[Candidate], bool]


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    load_weight: float = 1.0
    """Cached tokens one queued prefill token is worth: 1.0 trades them one for one."""
    waiting_request_tokens: int = 1024
    """Prompt tokens assumed per request an engine reports waiting (others' traffic)."""
    imbalance_threshold: int = 8
    """Load spread (requests) within a pool above which cache is ignored and least loaded wins."""
    decode_kv_weight: float = 4.0
    """Requests a full KV cache (kv_usage 1.0) is worth when ranking decode nodes."""
    local_prefill_max_tokens: int = 256
    """Prefill on the decode node when at most this many prompt tokens are not cached there."""
    prefill_saturation_load: int = 16
    """Prefill pool is saturated when every prefill node has at least this load."""
    session_affinity: bool = True
    """Keep a session on its previous decode node while that node is within the imbalance guard."""
    max_sessions: int = 100_000
    """Sessions remembered for affinity (least recently used forgotten first)."""


@dataclass(frozen=True, slots=True)
class _Pick:
    """One rule's choice: the node, the rule's code, a sentence, and the figures it compared."""

    node: Candidate
    code: ReasonCode
    text: str
    threshold: float | None = None
    load: float | None = None


def _load(c: Candidate) -> int:
    return c.inflight + c.node.load.waiting


class CacheAware:
    name = PolicyName.CACHE_AWARE.value

    def __init__(
        self, index: PrefixLookup, config: CacheAwareConfig | None = None, peer_reach: PeerReach | None = None
    ) -> None:
        self.index = index
        self.config = config or CacheAwareConfig()
        self.peer_reach = peer_reach
        self._queued: dict[str, int] = {}
        self._unsettled: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
        """id(decision.extra) -> (node, tokens, block keys) a decision still counts in that node's queue
        and pending prefixes (two entries once split). Keyed by the ``extra`` dict: the one object every
        copy of a decision (``dataclasses.replace``) shares, alive until the router calls
        ``on_complete``; settled tokens go back to the node they were added to, even when the prefill
        moved (a forced P/D)."""
        self._sessions: OrderedDict[str, str] = OrderedDict()

    # --- pieces ---------------------------------------------------------------------------------
    @staticmethod
    def _cached(c: Candidate, matches: dict[str, int], prompt_tokens: int) -> int:
        bs = c.node.info.block_size
        if prompt_tokens <= 0 or bs <= 0:
            return 0
        return min(matches.get(c.node_id, 0), (prompt_tokens - 1) // bs) * bs

    def _with_pending(self, keys: Sequence[int], matches: dict[str, int]) -> dict[str, int]:
        """``matches`` raised, per node, to the leading blocks of ``keys`` a prompt still to prefill there
        shares (its blocks will be cached by the time a request queued behind it runs)."""
        if not keys or not self._unsettled:
            return matches
        out = dict(matches)
        for entries in self._unsettled.values():
            for node, _, pending in entries:
                if not pending or pending[0] != keys[0]:
                    continue  # (the common case: another context from its first block)
                n = 0
                for a, b in zip(pending, keys, strict=False):
                    if a != b:
                        break
                    n += 1
                if n > out.get(node, 0):
                    out[node] = n
        return out

    def _with_peer_reach(
        self, request: RoutingRequest, pool: list[Candidate], matches: dict[str, int]
    ) -> dict[str, int]:
        """``matches`` raised, per node of ``pool`` that serves peers, to the most leading blocks another such
        node's engine holds itself (what a peer fetch would load there)."""
        reach = self.peer_reach
        if reach is None or not request.block_keys:
            return matches
        peers = [c for c in pool if reach.serves_peers(c)]
        if len(peers) < 2:
            return matches
        own = reach.own_prefix(request.model, request.block_keys)
        out = dict(matches)
        for c in peers:
            fetchable = max(own.get(m.node_id, 0) for m in peers if m is not c)
            if fetchable > out.get(c.node_id, 0):
                out[c.node_id] = fetchable
        return out

    def _queued_tokens(self, c: Candidate) -> int:
        return self._queued.get(c.node_id, 0) + c.node.load.waiting * self.config.waiting_request_tokens

    def _within_guard(self, pool: list[Candidate]) -> list[Candidate]:
        floor = min(_load(c) for c in pool)
        return [c for c in pool if _load(c) <= floor + self.config.imbalance_threshold]

    def _score_pool(
        self, pool: list[Candidate], matches: dict[str, int], prompt_tokens: int, held: dict[str, int] | None = None
    ) -> _Pick:
        """The pool's best node by cache less queue, then load; ``held``: each node's blocks before peer
        reach raised ``matches`` (on a whole tie the node that holds the blocks wins over one that would
        fetch them)."""
        loads = [_load(c) for c in pool]
        spread = max(loads) - min(loads)
        if spread > self.config.imbalance_threshold:
            best = min(pool, key=lambda c: (_load(c), c.node.load.kv_usage, c.node_id))
            return _Pick(
                best,
                ReasonCode.LOAD_GUARD,
                f"load guard: spread {spread} > {self.config.imbalance_threshold}, least loaded {best.node_id}",
                threshold=float(self.config.imbalance_threshold),
                load=float(spread),
            )

        held_blocks = held or {}

        def key(c: Candidate) -> tuple[float, int, int, str]:
            score = self._cached(c, matches, prompt_tokens) - self.config.load_weight * self._queued_tokens(c)
            return (-score, _load(c), -held_blocks.get(c.node_id, 0), c.node_id)

        best = min(pool, key=key)
        cached = self._cached(best, matches, prompt_tokens)
        return _Pick(
            best,
            ReasonCode.BEST_PREFIX,
            f"cache: {best.node_id} holds {cached}/{prompt_tokens} tokens, queue {self._queued_tokens(best)}",
            load=float(_load(best)),
        )

    def _decode_cost(self, c: Candidate) -> float:
        load = c.node.load
        return load.running + load.waiting + c.inflight + self.config.decode_kv_weight * load.kv_usage

    def _pick_decode(
        self, request: RoutingRequest, decode: list[Candidate], matches: dict[str, int], prompt_tokens: int
    ) -> _Pick:
        cfg = self.config
        ok = self._within_guard(decode)
        if cfg.session_affinity and request.session_id is not None:
            prev = self._sessions.get(request.session_id)
            for c in ok:
                if c.node_id == prev:
                    return _Pick(c, ReasonCode.SESSION_AFFINITY, f"session affinity: {c.node_id}")
        if prompt_tokens > 0:
            local = [
                c for c in ok if prompt_tokens - self._cached(c, matches, prompt_tokens) <= cfg.local_prefill_max_tokens
            ]
            if local:
                best = max(local, key=lambda c: (self._cached(c, matches, prompt_tokens), -self._decode_cost(c)))
                left = prompt_tokens - self._cached(best, matches, prompt_tokens)
                text = f"decode {best.node_id} holds all but the last {left} tokens"
                return _Pick(best, ReasonCode.MOST_CACHED, text)
        best = min(decode, key=lambda c: (self._decode_cost(c), c.node_id))
        return _Pick(best, ReasonCode.LEAST_BUSY, f"decode {best.node_id} least busy")

    # --- policy ---------------------------------------------------------------------------------
    def select(self, request: RoutingRequest, prefill: list[Candidate], decode: list[Candidate]) -> Decision:
        cfg = self.config
        prompt_tokens = len(request.prompt_token_ids)
        matches = self.index.longest_prefix(request.model, request.block_keys) if request.block_keys else {}
        bs = decode[0].node.info.block_size
        fleet_blocks = min(max(matches.values(), default=0), (prompt_tokens - 1) // bs if prompt_tokens else 0)
        matches = self._with_pending(request.block_keys, matches)  # (fleet_blocks: what is cached now)

        if not prefill:  # colocated: the decode pool prefills, so its cache decides
            prev = self._sessions.get(request.session_id) if cfg.session_affinity and request.session_id else None
            sticky = [c for c in self._within_guard(decode) if c.node_id == prev]
            if sticky:
                why = _Pick(
                    sticky[0],
                    ReasonCode.SESSION_AFFINITY,
                    f"colocated, session affinity: {sticky[0].node_id}",
                    threshold=float(cfg.imbalance_threshold),
                    load=float(_load(sticky[0])),
                )
            else:
                reached = self._with_peer_reach(request, decode, matches)  # (held blocks break a whole tie)
                why = self._score_pool(decode, reached, prompt_tokens, None if reached is matches else matches)
                why, matches = replace(why, text="colocated, " + why.text), reached
            d, p, decode_why = why.node, None, why
        else:
            decode_why = self._pick_decode(request, decode, matches, prompt_tokens)
            d = decode_why.node
            uncached_d = prompt_tokens - self._cached(d, matches, prompt_tokens)
            min_p_load = min(_load(c) for c in prefill)
            if prompt_tokens > 0 and uncached_d <= cfg.local_prefill_max_tokens:
                p = None
                why = _Pick(
                    d,
                    ReasonCode.LOCAL_PREFILL,
                    f"local prefill: {uncached_d} uncached tokens <= {cfg.local_prefill_max_tokens}; {decode_why.text}",
                    threshold=float(cfg.local_prefill_max_tokens),
                    load=float(_load(d)),
                )
            elif min_p_load >= cfg.prefill_saturation_load:
                p = None
                why = _Pick(
                    d,
                    ReasonCode.PREFILL_SATURATED,
                    f"local prefill: prefill pool saturated (min load {min_p_load}); {decode_why.text}",
                    threshold=float(cfg.prefill_saturation_load),
                    load=float(min_p_load),
                )
            else:
                why = self._score_pool(prefill, matches, prompt_tokens)
                p = why.node
                why = replace(why, text=f"{why.text}; {decode_why.text}")

        prefiller = p if p is not None else d
        routed = self._cached(prefiller, matches, prompt_tokens)
        uncached = max(prompt_tokens - routed, 0)
        self._queued[prefiller.node_id] = self._queued.get(prefiller.node_id, 0) + uncached
        if cfg.session_affinity and request.session_id is not None:
            self._sessions[request.session_id] = d.node_id
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > cfg.max_sessions:
                self._sessions.popitem(last=False)
        extra = {
            "prompt_tokens": float(prompt_tokens),
            "fleet_cached_tokens": float(fleet_blocks * bs),
            "routed_cached_tokens": float(routed),
            "uncached_tokens": float(uncached),
            "queued_tokens": float(uncached),
        }
        self._unsettled[id(extra)] = [(prefiller.node_id, uncached, tuple(request.block_keys))]
        return Decision(
            decode=d,
            prefill=p,
            policy=self.name,
            code=why.code,
            decode_code=decode_why.code,
            reason=why.text,
            threshold=why.threshold,
            load=why.load,
            extra=extra,
        )

    def on_split(self, decision: Decision, helper: str, prefix_tokens: int) -> None:
        entries = self._unsettled.get(id(decision.extra))
        if entries is None or len(entries) != 1:
            return
        node, tokens, keys = entries[0]
        bs = decision.decode.node.info.block_size
        moved = min(tokens, prefix_tokens)
        entries[:] = [(node, tokens - moved, keys), (helper, moved, keys[: prefix_tokens // bs] if bs > 0 else ())]
        self._queued[node] = self._queued.get(node, 0) - moved
        self._queued[helper] = self._queued.get(helper, 0) + moved

    def on_prefilled(self, decision: Decision) -> None:
        self._settle(decision)

    def on_complete(self, decision: Decision) -> None:
        self._settle(decision)

    def _settle(self, decision: Decision) -> None:
        """Take the decision's prompt tokens off its node's queue, once."""
        entries = self._unsettled.pop(id(decision.extra), None)
        for node, tokens, _ in entries or ():
            left = self._queued.get(node, 0) - tokens
            if left > 0:
                self._queued[node] = left
            else:
                self._queued.pop(node, None)
