"""The legs of a planned request: the prefill leg, the decode leg, and what runs when one fails.

A P/D pair runs sequentially (the prefill leg to its one token, then the decode leg given the prefill
node's ``kv_transfer_params``) or layer-wise (both at once: ``router.planning.layerwise``). A node
that prefills for itself may first load a prefix a peer holds (``router.planning.peer_fetch``: the
source leg asks the peer to lease it). A failed prefill leg follows ``prefill_fallback``; a decode leg
that fails before its first token is served once more, by the prefill node of its pair or by another
node (``router.planning.selection.another_node``). Every leg's trace fields are filled here and in
``router.record.trace``.

``Legs`` is the orchestrator's half that talks to nodes (through ``router.upstream``); the other half,
``router.planning.orchestrator``, resolves, routes and admits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from contracts.errors import EngineRejected, TandemError, UpstreamError
from kv_transfer import prefill_request_params
from kv_transfer.control import is_tandem_params, release_lease
from router.fleet import Fleet, Pools
from router.planning import layerwise
from router.planning.peer_fetch import PeerFetch
from router.planning.peer_legs import PeerLegs
from router.planning.retention import RETAIN_FIELD
from router.planning.selection import another_node
from router.planning.split_prefill import SplitPlan, SplitPrefill
from router.policies.base import Candidate, Decision, ReasonCode, RoutingPolicy, RoutingRequest
from router.record.metrics import RouterMetrics
from router.record.trace import (
    Kind,
    RequestTrace,
    note_answer,
    note_colocated,
    note_decode_node,
    note_pair,
    note_retry,
    note_split,
)
from router.settings import FallbackPolicy, RouterSettings
from router.upstream.node_client import NodeClient
from router.upstream.sse_upstream import SseStream

log = logging.getLogger("tandem.router")

Background = Callable[[Awaitable[Any]], None]
PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass
class Leg:
    """The decode leg, ready to be run: where, and with which body."""

    decision: Decision
    url: str
    body: dict[str, Any]
    hold: AsyncExitStack = field(default_factory=AsyncExitStack)
    """The decode node's admission slot. Whoever runs the leg calls ``release`` once the answer ends."""
    pair: layerwise.Pair | None = None
    """A layer-wise pair: this leg is already in flight beside its prefill leg (``router.planning.layerwise``)."""

    async def release(self) -> None:
        """End a layer-wise pair's legs if still running, give back the decode node's slot (idempotent;
        nothing inside waits, so safe under cancellation)."""
        if self.pair is not None:
            await self.pair.cancel()
        await self.hold.aclose()


class Legs(PeerLegs):
    """Runs a request's legs on the nodes a decision named (see the module docstring)."""

    settings: RouterSettings
    fleet: Fleet
    client: NodeClient
    policy: RoutingPolicy
    metrics: RouterMetrics
    peers: PeerFetch | None
    splits: SplitPrefill | None

    async def _legs(
        self,
        kind: Kind,
        body: dict[str, Any],
        decision: Decision,
        trace: RequestTrace,
        prefill_slot: AsyncExitStack,
        background: Background | None,
        rr: RoutingRequest | None = None,
        pools: Pools | None = None,
    ) -> Leg:
        """The decode leg to run, after the prefill leg (sequential) or beside it (layer-wise). Whoever
        runs the prefill leg closes ``prefill_slot`` when it ends. A node that prefills itself may load a
        prefix from a peer first (``router.planning.peer_fetch``)."""
        path = PATHS[kind]
        if self.splits is not None:  # a split's steps are starting there: join the next ones
            await self.splits.wait_hold(decision.decode.node_id, decision.prefill and decision.prefill.node_id)
        note_decode_node(trace, decision.decode)
        if decision.prefill is None:
            trace.mode = "colocated"
            if rr is not None and pools is not None:
                split = self._split_plan(decision, rr, pools)
                if split is not None:
                    return await self._split_legs(path, body, decision, split, rr, trace)
                body = await self._peer_prefix(body, decision.decode, rr, pools, trace)
            return Leg(decision, decision.decode.node.info.url + path, body)

        note_pair(trace, decision.prefill)
        if self.settings.layerwise and layerwise.eligible(decision.prefill, decision.decode):
            self.metrics.layerwise_pairs.inc()
            return await self._layerwise_legs(path, body, decision, decision.prefill, trace, prefill_slot, background)
        self.metrics.sequential_pairs.inc()
        trace.prefill_start = time.time()
        try:
            with self.fleet.track(decision.prefill):
                kv_params = await self._prefill(decision.prefill, path, self._prefill_body(body), trace)
        except EngineRejected as exc:
            if exc.status_code < 500:
                raise  # the client's request is at fault; another node would refuse it too
            kv_params = self._fallback(exc, trace)
        except UpstreamError as exc:
            self._node_failed(decision.prefill, exc)
            kv_params = self._fallback(exc, trace)
        finally:
            self._prefill_ended(trace)
            await prefill_slot.aclose()
        decode_body = dict(body)
        if kv_params is None:
            note_colocated(trace)
        else:
            decode_body["kv_transfer_params"] = trace.kv_params = kv_params
        return Leg(decision, decision.decode.node.info.url + path, decode_body)

    async def _layerwise_legs(
        self,
        path: str,
        body: dict[str, Any],
        decision: Decision,
        prefill: Candidate,
        trace: RequestTrace,
        prefill_slot: AsyncExitStack,
        background: Background | None,
    ) -> Leg:
        """Both legs at once (``router.planning.layerwise``): the decode leg in flight as ``leg.pair``, or, when
        the prefill leg failed first, what a sequential pair does then (its 4xx, the fallback, a 502)."""
        tid = layerwise.new_transfer_id()
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = trace.kv_params = layerwise.decode_params(
            prefill.node.info, tid, time.time() + self.settings.request_timeout_s
        )
        leg = Leg(decision, decision.decode.node.info.url + path, decode_body)
        trace.prefill_start = time.time()
        # The decode leg first: its pull is then waiting at the block server when the lease opens.
        decode_call = self._open_once(leg, trace) if body.get("stream") else self._post_decode(leg, trace)
        pair = leg.pair = layerwise.Pair(
            asyncio.ensure_future(decode_call),
            asyncio.ensure_future(self._layerwise_prefill(prefill, path, body, tid, trace, prefill_slot)),
        )
        await pair.first()
        exc = pair.prefill_failed()
        if exc is None or pair.decode.done():
            return leg  # a decode leg that is ready stands: a pull only delivers a finished prefill
        await pair.cancel()
        if background is not None:
            self.abandon(leg, f"prefill leg failed: {exc}", background)
        if isinstance(exc, EngineRejected) and exc.status_code < 500:
            raise exc  # the client's request is at fault; another node would refuse it too
        if not isinstance(exc, UpstreamError):
            raise exc
        self._node_failed(prefill, exc)
        self._fallback(exc, trace)
        note_colocated(trace)
        return Leg(decision, decision.decode.node.info.url + path, body)

    async def _layerwise_prefill(
        self,
        node: Candidate,
        path: str,
        body: dict[str, Any],
        tid: str,
        trace: RequestTrace,
        prefill_slot: AsyncExitStack,
    ) -> None:
        try:
            with self.fleet.track(node):
                await self._prefill(node, path, self._prefill_body(body, tid), trace)
        finally:
            self._prefill_ended(trace)
            await prefill_slot.aclose()

    def _split_plan(self, decision: Decision, rr: RoutingRequest, pools: Pools) -> SplitPlan | None:
        if self.splits is None or not rr.block_keys or decision.code is ReasonCode.PINNED:
            return None  # (a pinned request is its node's alone: x-tandem-node)
        pool = [c for c in pools.colocated if not self.fleet.is_down(c.node_id)]
        n = len(rr.prompt_token_ids)
        fleet = self.fleet
        return self.splits.plan(rr.model, rr.block_keys, n, decision.decode, pool, fleet.inflight, fleet.ended_since)

    async def _split_legs(
        self,
        path: str,
        body: dict[str, Any],
        decision: Decision,
        split: SplitPlan,
        rr: RoutingRequest,
        trace: RequestTrace,
    ) -> Leg:
        """A split prefill (``router.planning.split_prefill``): the helper's prefix leg and the request itself
        at once, as a layer-wise pair whose prefill leg only computes the prefix. A helper leg that fails
        does not end the request: the serving node's pull then fails and it recomputes the prefix."""
        target, helper, prefix = decision.decode, split.helper, split.prefix_tokens
        tid = layerwise.new_transfer_id()
        params = layerwise.decode_params(helper.node.info, tid, time.time() + self.settings.request_timeout_s)
        out = dict(body)
        # (beside a retention hint the body may carry: router.planning.retention)
        out["kv_transfer_params"] = trace.kv_params = {
            **(body.get("kv_transfer_params") or {}),
            **params,
            "prefix_tokens": prefix,
            "prefix_key": rr.block_keys[prefix // target.node.info.block_size - 1],
            "split": True,
        }
        hbody: dict[str, Any] = {
            "model": body["model"],
            "prompt": list(rr.prompt_token_ids[:prefix]),
            "max_tokens": 1,
            "kv_transfer_params": layerwise.prefill_params(tid),
        }
        if body.get("cache_salt"):
            hbody["cache_salt"] = body["cache_salt"]  # the same salted hashes as the request's own
        note_split(trace, helper.node_id, prefix, split.local_tokens)
        self.policy.on_split(decision, helper.node_id, prefix - split.local_tokens)
        self._peer_outcome(trace, "split")
        leg = Leg(decision, target.node.info.url + path, out)
        helper_leg = asyncio.ensure_future(self._helper_leg(helper, hbody, trace))
        serve = self._open_once(leg, trace) if body.get("stream") else self._post_decode(leg, trace)
        leg.pair = layerwise.Pair(asyncio.ensure_future(serve), helper_leg)
        assert self.splits is not None  # (it planned the split)
        self.splits.hold(target.node_id, helper.node_id)
        await leg.pair.first()
        return leg

    async def _helper_leg(self, helper: Candidate, hbody: dict[str, Any], trace: RequestTrace) -> None:
        try:
            with self.fleet.track(helper):
                resp = await self.client.post_json(
                    helper.node.info.url + PATHS["completion"], hbody, self._headers(trace, "prefill")
                )
            details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
            if trace.split_cached is not None:  # (None: the request was retried elsewhere meanwhile)
                trace.split_cached = (trace.split_cached[0], int(details.get("cached_tokens") or 0))
        except UpstreamError as exc:
            self._node_failed(helper, exc)
            log.warning(
                "split prefill: %s's prefix leg failed (%s); the prefix is recomputed", helper.node_id, exc.message
            )
            self._peer_outcome(trace, "split_failed")
            raise

    def _prefill_ended(self, trace: RequestTrace) -> None:
        trace.prefill_end = time.time()
        self.metrics.prefill_leg.observe(trace.prefill_end - (trace.prefill_start or trace.prefill_end))

    @staticmethod
    def _prefill_body(body: dict[str, Any], layerwise_id: str | None = None) -> dict[str, Any]:
        pbody = dict(body)  # only top-level keys change; the messages are shared, not copied
        for k in ("stream", "stream_options", "max_completion_tokens"):
            pbody.pop(k, None)
        pbody["max_tokens"] = 1
        params = prefill_request_params() if layerwise_id is None else layerwise.prefill_params(layerwise_id)
        # (beside a retention hint the body may carry for the prefill node's host tier: router.planning.retention)
        pbody["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        return pbody

    async def _post_decode(self, leg: Leg, trace: RequestTrace) -> dict[str, Any]:
        with self.fleet.track(leg.decision.decode):
            return await self.client.post_json(leg.url, leg.body, self._headers(trace, "decode"))

    async def _prefill(self, node: Candidate, path: str, pbody: dict[str, Any], trace: RequestTrace) -> dict:
        resp = await self.client.post_json(node.node.info.url + path, pbody, self._headers(trace, "prefill"))
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        trace.engine_cached_tokens = details.get("cached_tokens")
        params = resp.get("kv_transfer_params")
        if not params:
            raise UpstreamError(
                f"prefill node {node.node_id} returned no kv_transfer_params (is its KV connector configured?)"
            )
        return params

    def _fallback(self, exc: TandemError, trace: RequestTrace) -> None:
        if self.settings.prefill_fallback is FallbackPolicy.ERROR:
            raise exc
        log.warning("prefill leg failed (%s); prefilling on decode node %s", exc.message, trace.decode_node)
        self.metrics.fallbacks.inc()
        trace.fallback = True
        return None

    def _headers(self, trace: RequestTrace, leg: Literal["prefill", "decode"]) -> dict[str, str]:
        # vLLM names its answer "chatcmpl-<X-Request-Id>" ("cmpl-…" for completions): sending the
        # part after our prefix makes the engine's chunk ids the router's response id, so streamed
        # chunks pass through unchanged (router/edge/sse.py).
        headers = {"X-Request-Id": trace.request_id.partition("-")[2]}
        if not self.settings.otlp_traces_endpoint:
            return headers  # no spans, no header: nothing drawn or formatted
        # W3C trace context naming the router's span of this leg (tandem.prefill or tandem.decode), which
        # an engine with --otlp-traces-endpoint parents its own span on; the accounting gives the
        # router's spans the same ids (telemetry.tracing).
        if trace.trace_id is None or trace.prefill_span_id is None or trace.decode_span_id is None:
            trace.trace_id = random.getrandbits(128) or 1  # 0 is the invalid id
            trace.prefill_span_id = random.getrandbits(64) or 1
            trace.decode_span_id = random.getrandbits(64) or 1
        span = trace.prefill_span_id if leg == "prefill" else trace.decode_span_id
        headers["traceparent"] = f"00-{trace.trace_id:032x}-{span:016x}-01"
        return headers

    def abandon(self, leg: Leg, reason: str, background: Background) -> None:
        """The router gives up on a planned leg: free the prefill node's lease now, off the fast path."""
        params = leg.body.get("kv_transfer_params")
        if is_tandem_params(params):
            background(release_lease(params, reason))

    def _node_failed(self, node: Candidate, exc: UpstreamError) -> None:
        """A leg could not reach ``node`` (no engine answer at all): leave it out of routing now rather
        than when its registry entry lapses. An engine's own error answer says the node is alive."""
        if not isinstance(exc, EngineRejected):
            self.fleet.mark_down(node.node_id, exc.message)

    def _retry_leg(self, leg: Leg, trace: RequestTrace, exc: TandemError) -> Leg:
        """The decode leg failed before any token: serve the request once more, on the prefill node of a
        P/D pair (alive, with the prompt cached), else on another node that can serve it alone."""
        retryable = isinstance(exc, UpstreamError) and not (isinstance(exc, EngineRejected) and exc.status_code < 500)
        if not retryable or self.settings.prefill_fallback is FallbackPolicy.ERROR:
            raise exc
        assert isinstance(exc, UpstreamError)
        failed = leg.decision.decode
        self._node_failed(failed, exc)
        if leg.decision.code is ReasonCode.PINNED:
            raise exc  # its operator asked for that node, no other
        prefill = leg.decision.prefill
        path = leg.url[len(failed.node.info.url) :]
        body = {k: v for k, v in leg.body.items() if k != "kv_transfer_params"}
        # A P/D decode leg (not one that already fell back to colocated, whose body may carry only a
        # retention hint): its prefill node holds the prompt, so it serves the retry.
        if prefill is not None and trace.mode == "disaggregated":
            target, why = prefill, "served by the prefill node"
        else:
            target = another_node(self.fleet, trace.model, failed.node_id)
            if target is None:
                raise exc
            why = f"served by {target.node_id}"
        retain = (leg.body.get("kv_transfer_params") or {}).get(RETAIN_FIELD)
        if retain is not None and target.node.info.host_tier_events_endpoint:
            body["kv_transfer_params"] = {RETAIN_FIELD: retain}  # the retry's node keeps the session too
        log.warning("decode leg on %s failed (%s); %s", failed.node_id, exc.message, why)
        self.metrics.fallbacks.inc()
        note_retry(trace, target, why)
        return Leg(replace(leg.decision, decode=target, prefill=None), target.node.info.url + path, body)

    async def complete(self, leg: Leg, trace: RequestTrace, background: Background | None = None) -> dict[str, Any]:
        try:
            try:
                if leg.pair is not None:
                    resp = await leg.pair.claim_decode()
                    # The decode node's whole answer came before the prefill node's one-token answer:
                    # rare, and short (that answer trails the prefill's last layer), but the usage the
                    # client gets names the prefill node's cached tokens.
                    await leg.pair.prefill_ended()
                else:
                    resp = await self._post_decode(leg, trace)
            except UpstreamError as exc:
                resp = await self._post_decode(await self._instead(leg, trace, exc, background), trace)
        finally:
            self.policy.on_complete(leg.decision)
        resp["id"] = trace.request_id
        note_answer(trace, resp)
        return resp

    async def open_stream(
        self,
        leg: Leg,
        trace: RequestTrace,
        stack: AsyncExitStack,
        background: Background | None = None,
    ) -> SseStream:
        """Open the decode stream and wait for its first batch of chunks, so that refusals and a decode node that
        dies before the first token raise here (and can be retried, or answered with a proper HTTP
        status); the stream's lifetime is bound to ``stack``."""
        stack.callback(self.policy.on_complete, leg.decision)
        try:
            if leg.pair is not None:
                stream, attempt = await leg.pair.claim_decode()
            else:
                stream, attempt = await self._open_once(leg, trace)
        except UpstreamError as exc:
            stream, attempt = await self._open_once(await self._instead(leg, trace, exc, background), trace)
        stack.push_async_exit(attempt)
        # vLLM sends a stream's first event with its first token: the prompt's work is done.
        self.policy.on_prefilled(leg.decision)
        return stream

    async def _instead(self, leg: Leg, trace: RequestTrace, exc: UpstreamError, background: Background | None) -> Leg:
        """The decode leg failed before any token: free its prefill node's lease, and the leg that serves
        the request instead (``_retry_leg``), or raise."""
        if background is not None:
            self.abandon(leg, f"decode leg failed: {exc.message}", background)
        retry = self._retry_leg(leg, trace, exc)
        if leg.pair is not None:
            await leg.pair.prefill_ended()  # the retry goes to the prefill node: its prompt cached
        return retry

    async def _open_once(self, leg: Leg, trace: RequestTrace) -> tuple[SseStream, AsyncExitStack]:
        """The stream, opened up to its first events, and the stack that closes it."""
        body = dict(leg.body)
        body["stream"] = True
        # Always ask the engine for usage (telemetry needs it); it is only forwarded if the client asked.
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        attempt = AsyncExitStack()
        try:
            attempt.enter_context(self.fleet.track(leg.decision.decode))
            stream = await attempt.enter_async_context(
                self.client.open_stream(leg.url, body, self._headers(trace, "decode"))
            )
            await stream.first()
        except BaseException:
            await attempt.aclose()
            raise
        return stream, attempt
