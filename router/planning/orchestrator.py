"""P/D orchestration: validate against the fleet, pick nodes, run the prefill leg, open the decode leg.

    request ─▶ pools(model) ─▶ policy.select ─▶ [prefill leg: max_tokens=1, do_remote_decode]
                                                     │ kv_transfer_params (where the KV waits)
                                                     ▼
                                              decode leg (stream or not) ─▶ client

Everything up to the opening of the decode leg happens before the router answers, so any refusal
(bad request, no node, engine 4xx, shed or expired in an admission queue) still gets a proper HTTP
status.

Admission slots (``router.admission.priority``), when the orchestrator has a controller: after routing,
the request takes a slot on its decode (or colocated) node, then one on its prefill node; it queues by
class then arrival for each, until ``trace.deadline``. The decode slot comes first and is held until
the answer ends (``Leg.release``), so KV computed by a prefill node never waits for a decode slot;
the prefill slot is held for the prefill leg only. A request shed or expired while queued has reached
no engine. Every request takes its slots in the same order (decode, then prefill), so none deadlock.
A decode leg retried on the prefill node (below) runs on the slots already held: it was admitted.

A prefill leg that fails for a reason that is not the client's follows ``prefill_fallback``: prefill
on the decode node, or 502.
A decode leg that fails before its first token (decode node dead, refusing, or dying mid-transfer)
releases the prefill node's lease and, under the same policy, is served once more by the prefill node
itself, which still has the prompt in its prefix cache; the client sees one answer either way.

Layer-wise pairs (``RouterSettings.layerwise``, ``router.planning.layerwise``): both legs go out at once, the
decode leg naming the prefill node's block server and a transfer id the router chose, so the decode
node pulls each layer while the prefill computes; ``plan`` returns at the first of the decode leg being
ready or the prefill leg ending, and the legs are the ``Leg``'s ``pair`` until the exchange's exit. The
prefill slot is then held by the prefill leg itself, until it ends.

The edge hands over one frozen ``RequestPlan`` (what the client asked, already checked); the routing
choice itself is ``router.planning.selection``'s, the legs' running ``router.planning.legs``'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from contracts.errors import InvalidRequest, Unavailable
from contracts.registry import NodeInfo
from router.admission.priority import AdmissionController
from router.fleet import Fleet, Pools
from router.kv_index import BlockHasher, FleetIndex, prefix_view
from router.model_table import ModelTable, Via
from router.planning import selection
from router.planning.legs import Background, Leg, Legs
from router.planning.peer_fetch import PeerFetch
from router.planning.retention import retention_default, retention_for
from router.planning.split_prefill import SplitPrefill
from router.policies.base import Candidate, Decision, RoutingPolicy, RoutingRequest
from router.record.metrics import RouterMetrics
from router.record.trace import Kind, RequestTrace, RouteMode, note_decision, note_resolution
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer
from router.upstream.node_client import NodeClient

log = logging.getLogger("tandem.router")

TokenCharge = Callable[[int, int | None], Awaitable[None]]
CAPACITY_CODES = frozenset({"overloaded", "shed"})
"""``Unavailable`` codes that mean every slot of the chosen node was taken (``router.admission.priority``):
a request refused so may still go to its model's fallback. A passed deadline is final."""


@dataclass(frozen=True)
class RequestPlan:
    """What the edge asks planning for, once the request is read and checked: one value, not a list of
    arguments. ``body`` is the request as the engine should see it (``router.edge.schemas``' ``body()``);
    planning copies it before it adds anything (the served model's name, a salt, transfer params)."""

    kind: Kind
    model: str
    """The client's ``model``, before alias, canary and fallback (``router.model_table``)."""
    body: Mapping[str, Any]
    max_tokens: int | None
    """The completion's token limit as the client set it (``max_completion_tokens`` or ``max_tokens``)."""
    prefer: RouteMode | None = None
    """``x-tandem-route``: the path an operator forces."""
    pin: str | None = None
    """``x-tandem-node``: the node that serves the request alone, instead of the policy's choice."""
    cache_salt: str | None = None
    charge: TokenCharge | None = None
    """Called with (prompt tokens, max_tokens) once they are known, before any node works (token limits)."""
    background: Background | None = None
    """Runs the lease releases of pairs given up while planning, off the fast path."""


class Orchestrator(Legs):
    """Resolves, routes and admits a request, then runs its legs (``Legs``)."""

    def __init__(
        self,
        settings: RouterSettings,
        fleet: Fleet,
        client: NodeClient,
        policy: RoutingPolicy,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
        index: FleetIndex | None = None,
        slots: AdmissionController | None = None,
        models: ModelTable | None = None,
        peers: PeerFetch | None = None,
        splits: SplitPrefill | None = None,
    ) -> None:
        self.models = models or ModelTable()
        self.peers = peers
        """Cross-node prefix reuse (``router.planning.peer_fetch``); None: off."""
        self.splits = splits
        """One cold prompt on two idle colocated nodes at once (``router.planning.split_prefill``); None: off."""
        self.index = index
        self.slots = slots
        self._hashers: dict[tuple[str, int], BlockHasher] = {}
        self.settings = settings
        self.fleet = fleet
        self.client = client
        self.policy = policy
        self.tokenizer = tokenizer
        self.metrics = metrics

    # -- planning -------------------------------------------------------------------------------------
    async def plan(self, plan: RequestPlan, trace: RequestTrace) -> Leg:
        """Route and run the prefill leg. Returns the decode leg to run (a layer-wise one is already in
        flight). The plan's ``cache_salt`` (``router.planning.cache_salt``) goes to every engine leg and
        into the routing keys, so that the fleet index matches the engines' salted block hashes.

        The request's ``model`` is resolved first (``router.model_table``): the engines see the served
        name. If the node chosen for it refuses for capacity (its admission queue is full) and the model
        has a fallback, the request is planned once more on the fallback, uncharged (its tokens were
        charged once). A pinned request never moves to another node or model."""
        resolution = self.models.resolve(plan.model, self.fleet.serves)
        if resolution.served not in self.fleet.model_names:  # a node may have registered since the last read
            await self.fleet.catch_up()
            resolution = self.models.resolve(plan.model, self.fleet.serves)
        note_resolution(trace, resolution)
        try:
            return await self._plan_on(resolution.served, plan, trace)
        except Unavailable as exc:
            fallback = resolution.fallback
            if fallback is None or exc.code not in CAPACITY_CODES or plan.pin is not None:
                raise
            log.warning("%s has no capacity (%s); planning on its fallback %s", trace.model, exc.message, fallback)
            note_resolution(trace, replace(resolution, served=fallback, via=Via.FALLBACK, fallback=None))
            return await self._plan_on(fallback, replace(plan, charge=None), trace)
        finally:
            if self.bounded(resolution.requested):
                self.metrics.resolutions.labels(resolution.requested, trace.model, trace.model_resolution).inc()

    def bounded(self, name: str) -> bool:
        """Whether ``name`` may be a metrics label: a name of the model table, or one a live node serves
        (a bounded set); any other client string would be a new time series, kept forever."""
        return name in self.fleet.model_names or self.models.known(name)

    async def _plan_on(self, model: str, plan: RequestPlan, trace: RequestTrace) -> Leg:
        pools = self.fleet.pools(model)
        body = dict(plan.body)
        body["model"] = model  # the engine serves this name (vLLM refuses any other)
        if plan.cache_salt:
            body["cache_salt"] = plan.cache_salt
        if self.settings.default_max_tokens and plan.max_tokens is None:
            body["max_tokens"] = self.settings.default_max_tokens
        reference = (pools.decode or pools.colocated or pools.prefill)[0].node.info  # same model everywhere
        if plan.charge is not None or selection.has_choice(self.settings.tokenize, pools):
            ids = await self._prompt_ids(plan, body, reference, trace)
        else:  # nothing to decide and nothing to charge: the engine counts (and checks) the prompt
            self._check_max_tokens(plan, reference)
            ids = None
        if plan.charge is not None:
            await plan.charge(trace.prompt_tokens or 0, plan.max_tokens)
        rr = RoutingRequest(
            request_id=trace.request_id,
            model=trace.model,
            prompt_token_ids=tuple(ids or ()),
            session_id=trace.session_id,
            block_keys=self._keys(reference, ids, plan.cache_salt),
        )
        retry_after = self.settings.retry_after_s
        if plan.pin is None:
            decision = selection.select(self.policy, rr, pools, plan.prefer, retry_after)
        else:
            decision = selection.pinned(self.fleet, self.policy, model, plan.pin, retry_after)
        trace.routed = time.time()
        hold, prefill_slot = AsyncExitStack(), AsyncExitStack()
        try:  # from here on the policy counts the decision: whatever fails settles it
            note_decision(trace, decision)
            self._hit_breakdown(rr, decision, trace, pools)
            self._retain(body, decision, trace)
            await hold.enter_async_context(self._slot(decision.decode, trace))
            await prefill_slot.enter_async_context(self._slot(decision.prefill, trace))
            leg = await self._legs(plan.kind, body, decision, trace, prefill_slot, plan.background, rr, pools)
        except BaseException:
            await prefill_slot.aclose()
            await hold.aclose()
            self.policy.on_complete(decision)
            raise
        leg.hold = hold
        return leg

    async def _prompt_ids(
        self, plan: RequestPlan, body: dict[str, Any], node: NodeInfo, trace: RequestTrace
    ) -> list[int] | None:
        """The prompt's token ids, after checking that prompt and completion fit the context window."""
        limit = node.max_model_len
        max_tokens = self._check_max_tokens(plan, node)
        ids = await self.tokenizer.token_ids(node, body)
        n = trace.prompt_tokens = len(ids) if ids is not None else None
        if n is not None and n + (max_tokens or 1) > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + (max_tokens or 1)} tokens ({n} in the messages, {max_tokens or 1} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="messages" if "messages" in body else "prompt",
                code="context_length_exceeded",
            )
        return ids

    def _check_max_tokens(self, plan: RequestPlan, node: NodeInfo) -> int | None:
        """The completion's max_tokens, refused when it alone fills the context window."""
        limit = node.max_model_len
        max_tokens = plan.max_tokens or self.settings.default_max_tokens
        if max_tokens is not None and max_tokens >= limit:
            raise InvalidRequest(
                f"max_tokens={max_tokens} does not fit this model's context window of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _hit_breakdown(self, rr: RoutingRequest, decision: Decision, trace: RequestTrace, pools: Pools) -> None:
        """fleet_cached_tokens (best prefix anywhere) and routed_cached_tokens (on the node that will
        prefill), from the fleet KV index, whatever the policy, and the rest of what miss attribution
        needs (``router.kv_index.attribution``). Like vLLM, the last prompt token is always
        recomputed, so at most (n-1)//block_size blocks count."""
        if self.index is None or not rr.block_keys:
            return
        prefiller = decision.prefill or decision.decode
        live = {c.node_id for pool in (pools.prefill, pools.decode, pools.colocated) for c in pool}
        view = trace.prefix_view = prefix_view(
            self.index,
            rr.model,
            rr.block_keys,
            prompt_tokens=len(rr.prompt_token_ids),
            block_size=prefiller.node.info.block_size,
            routed_node=prefiller.node_id,
            live_nodes=live,
            reason_code=decision.code.value,
            now=time.time(),
        )
        trace.fleet_cached_tokens, trace.routed_cached_tokens = view.fleet_tokens, view.routed_tokens

    def _retain(self, body: dict[str, Any], decision: Decision, trace: RequestTrace) -> None:
        """Ask the prefilling node's host tier to keep this session's context (``router.planning.retention``)."""
        prefiller = (decision.prefill or decision.decode).node.info
        if not prefiller.host_tier_events_endpoint:
            return
        hint = retention_for(
            body,
            trace.session_id,
            trace.tenant_id,
            retention_default(self.settings, trace.transport),
            self.settings.session_retention_max_s,
        )
        if hint is not None:
            body["kv_transfer_params"] = hint.params()
            trace.retention_s = hint.ttl_s

    def _keys(self, node: NodeInfo, ids: list[int] | None, cache_salt: str | None) -> tuple[int, ...]:
        if ids is None or self.index is None or node.block_size <= 0:
            return ()
        hasher = self._hashers.get((node.model, node.block_size))
        if hasher is None:
            hasher = self._hashers[(node.model, node.block_size)] = BlockHasher(node.block_size, "sha256_cbor")
        return tuple(hasher.keys(ids, cache_salt=cache_salt))

    def _slot(self, node: Candidate | None, trace: RequestTrace) -> AbstractAsyncContextManager[None]:
        """The node's admission slot for this request (queued by class, dropped at the deadline)."""
        if node is None or self.slots is None or trace.deadline is None:
            return nullcontext()
        return self.slots.slot(node.node_id, trace.priority, trace.deadline)
