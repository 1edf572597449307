"""Cross-node prefix reuse: the node that prefills a prompt loads the prefix a peer's engine holds
instead of computing it, through our connector, when the router's measured rates say that is faster.

    router   plan: X serves the request (colocated); peer Y's engine holds k more leading blocks of the
             prompt than X reuses (its own cache and host tier), both run our connector (``--peer-kv``)
             decide:  fetch_s = source_s(Y) + gain · transfer_s/token   <   compute_s = gain · prefill_s/token(X)
      ─▶ Y   POST /v1/completions {prompt: ids[:P], max_tokens: 1, kv_transfer_params: do_remote_decode}
             its engine reuses all but the prefix's last block, computes that one, and leases the P/bs
             blocks (the lease state machine of a P/D prefill, ``prefill_nodes.lease``) ─▶ TransferParams
      ─▶ X   the request itself, kv_transfer_params = those + ``prefix_tokens=P``: X's connector pulls
             blocks [its own hit, P/bs) from Y's block server by position and vLLM computes the rest
             (``decode_nodes.admission``); X answers with the pull's report (``tandem_transfer``)

``gain`` is the prefix tokens X would otherwise compute; the pull moves the prefix past X's engine's
own blocks (the peer's replace what X's host tier would have loaded). The prefix P is the peer's whole blocks, at
most the prompt's last whole block before its last token (vLLM computes at least that token).

Rates (``FetchRates``), per node, exponentially weighted from a prior, drifting back to it when not
measured for a while (``FORGET_S``):
    prefill_s/token   streamed colocated requests of at least ``MIN_MEASURED_TOKENS`` uncached tokens and
                      no fetch attempt: time from routing to the first token over those tokens
                      (queueing included, an over-estimate of the compute a fetch saves)
    transfer_s/token  the peer pulls' own reports: seconds over tokens moved
    source_s          the source leg's round trip (router to peer and back, one engine step on the peer),
                      plus, while the peer reports requests waiting, their assumed tokens at its rate

Bounded loss: the source leg may take at most the ``compute_s`` it was meant to save (a peer busier
than measured); past it, or on any failure of the peer, the leg is cancelled and X computes the prompt
as if no peer held it. A source that dies after answering fails X's pull: X recomputes
(``kv_load_failure_policy``) and the request still completes. A lease nobody pulls (the leg cancelled
just as it answered: the router never learns its id) holds the peer's blocks until its deadline
(``kv_lease_s``). Blocks move by position, so the params carry the router's key of the prefix's last
block (a chain hash over every token before it and the salt): X loads only if its own hash agrees.

Sources are colocated peers only (prefill and decode nodes are sized and admitted for their roles).

Not covered: P/D pairs (a prefill node's own request would then both pull and lease), sources across
hosts beyond what the block server's endpoints reach, and the peer's host tier (only its engine's own
blocks are served).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.planning.layerwise import TANDEM
from router.policies.base import Candidate

PRIOR_PREFILL_S_PER_TOKEN = 1.5e-3
"""Until measured: ~0.7k tokens/s, a 0.5B model's prefill on two CPU cores (a GPU node measures its
own within a few requests)."""
PRIOR_TRANSFER_S_PER_TOKEN = 2e-5
"""Until measured: 12 KB of KV per token (Qwen2.5-0.5B, bf16) at ~0.6 GB/s, tcp on a loaded host."""
PRIOR_SOURCE_S = 0.15
"""Until measured: one round trip and one engine step on an idle peer."""
WAITING_REQUEST_TOKENS = 1024
"""Prompt tokens assumed per request a peer reports waiting (as ``cache_aware`` assumes)."""
MIN_MEASURED_TOKENS = 256
"""A colocated request with fewer uncached tokens says more about overheads than about prefill."""
ALPHA = 0.3
"""Weight of each new observation in the moving averages (the first is blended with the prior)."""
FORGET_S = 120.0
"""Time constant over which an average unmeasured since drifts back to its prior."""


class OwnPrefix(Protocol):
    def own_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """node id -> leading blocks of ``keys`` its engine holds itself (no host tier)."""
        ...

    def longest_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """node id -> leading blocks it would reuse (its engine's, then its host tier's)."""
        ...


@dataclass
class _Ewma:
    """A moving average that starts at its prior and drifts back to it while nothing is measured, so
    one slow observation cannot shut a peer out for good (a peer no longer asked is never measured)."""

    prior: float
    measured: int = 0
    _value: float | None = None
    _at: float = 0.0

    @property
    def value(self) -> float:
        if self._value is None:
            return self.prior
        keep = math.exp(-(time.monotonic() - self._at) / FORGET_S)
        return self.prior + (self._value - self.prior) * keep

    def add(self, x: float) -> None:
        if not math.isfinite(x) or x < 0:
            return
        self._value, self._at = (1 - ALPHA) * self.value + ALPHA * x, time.monotonic()
        self.measured += 1


@dataclass
class FetchRates:
    """The measured rates the decision compares (see the module docstring)."""

    prefill: dict[str, _Ewma] = field(default_factory=dict)
    transfer: _Ewma = field(default_factory=lambda: _Ewma(PRIOR_TRANSFER_S_PER_TOKEN))
    """Fleet-wide: one host's links and copies are alike; per source would starve each of samples."""
    source: dict[str, _Ewma] = field(default_factory=dict)

    def prefill_s_per_token(self, node_id: str) -> float:
        return self.prefill.get(node_id, _Ewma(PRIOR_PREFILL_S_PER_TOKEN)).value

    def source_s(self, node_id: str) -> float:
        return self.source.get(node_id, _Ewma(PRIOR_SOURCE_S)).value

    def observe_prefill(self, node_id: str, uncached_tokens: int, seconds: float) -> None:
        if uncached_tokens >= MIN_MEASURED_TOKENS and seconds > 0:
            self.prefill.setdefault(node_id, _Ewma(PRIOR_PREFILL_S_PER_TOKEN)).add(seconds / uncached_tokens)

    def observe_transfer(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.transfer.add(seconds / tokens)

    def observe_source(self, node_id: str, seconds: float) -> None:
        self.source.setdefault(node_id, _Ewma(PRIOR_SOURCE_S)).add(seconds)


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Load ``prefix_tokens`` of the prompt from ``source`` instead of computing the part past ``local_tokens``."""

    source: Candidate
    prefix_tokens: int
    local_tokens: int
    """Prompt tokens the serving node reuses itself (its engine and host tier)."""
    own_tokens: int
    """Of those, its engine's own: the pull starts there (the peer's blocks replace the tier's)."""
    fetch_s: float
    compute_s: float
    """Predicted: the fetch, and computing the same tokens; the source leg may take at most ``compute_s``."""

    @property
    def gain_tokens(self) -> int:
        return self.prefix_tokens - self.local_tokens


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the planner concluded for one request: a plan, or why none (a metrics label)."""

    plan: FetchPlan | None
    outcome: str
    """``planned``, or ``slower`` (computing was predicted faster); requests no peer could help get no
    verdict at all."""


def serves_peers(c: Candidate) -> bool:
    """Whether ``c`` runs our connector with a block server (``NodeSettings.peer_kv`` on a colocated node)."""
    return c.node.info.kv_connector == TANDEM and bool(c.node.info.kv_endpoints)


def peers_of(target: Candidate, pool: Sequence[Candidate]) -> list[Candidate]:
    """The nodes of ``pool`` that can exchange KV blocks with ``target``: others running our connector
    with a block server, of its block size, on a host they name."""
    bs = target.node.info.block_size
    return [
        c
        for c in pool
        if c.node_id != target.node_id and serves_peers(c) and c.node.info.block_size == bs and c.node.info.kv_host_id
    ]


class PeerFetch:
    def __init__(self, index: OwnPrefix, min_tokens: int, rates: FetchRates | None = None) -> None:
        self.index = index
        self.min_tokens = min_tokens
        self.rates = rates or FetchRates()

    def plan(
        self, model: str, keys: Sequence[int], prompt_tokens: int, target: Candidate, pool: Sequence[Candidate]
    ) -> Verdict | None:
        """Whether ``target`` should load a prefix of this prompt from a node of ``pool``; None when no
        peer holds at least ``min_tokens`` more of it than ``target`` reuses itself."""
        bs = target.node.info.block_size
        if not keys or bs <= 0 or prompt_tokens <= 1 or not serves_peers(target):
            return None
        peers = peers_of(target, pool)
        if not peers:  # (before the index walks: a fleet without peers pays nothing per request)
            return None
        cap = (prompt_tokens - 1) // bs
        local = min(self.index.longest_prefix(model, keys).get(target.node_id, 0), cap)
        own = self.index.own_prefix(model, keys)
        best = max(peers, key=lambda c: (min(own.get(c.node_id, 0), cap), -_waiting(c)))
        prefix_blocks = min(own.get(best.node_id, 0), cap)
        gain = (prefix_blocks - local) * bs
        if gain < self.min_tokens:
            return None
        compute_s = gain * self.rates.prefill_s_per_token(target.node_id)
        source_s = self.rates.source_s(best.node_id)
        source_s += _waiting(best) * WAITING_REQUEST_TOKENS * self.rates.prefill_s_per_token(best.node_id)
        mine = min(own.get(target.node_id, 0), local)
        fetch_s = source_s + (prefix_blocks - mine) * bs * self.rates.transfer.value  # the pull starts at its own
        plan = FetchPlan(best, prefix_blocks * bs, local * bs, mine * bs, fetch_s, compute_s)
        return Verdict(plan if fetch_s < compute_s else None, "planned" if fetch_s < compute_s else "slower")


def _waiting(c: Candidate) -> int:
    return c.node.load.waiting
