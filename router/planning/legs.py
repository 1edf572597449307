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
from router.planning.peer_fetch import FetchPlan, PeerFetch
from router.planning.retention import RETAIN_FIELD
from router.planning.selection import another_node
from router.policies.base import Candidate, Decision, ReasonCode, RoutingPolicy, RoutingRequest
from router.record.metrics import RouterMetrics
from router.record.trace import (
    Kind,
    RequestTrace,
    note_answer,
    note_colocated,
    note_decode_node,
    note_pair,
    note_peer_fetch,
    note_retry,
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


class Legs:
    """Runs a request's legs on the nodes a decision named (see the module docstring)."""

    settings: RouterSettings
    fleet: Fleet
    client: NodeClient
    policy: RoutingPolicy
    metrics: RouterMetrics
    peers: PeerFetch | None

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
        note_decode_node(trace, decision.decode)
        if decision.prefill is None:
            trace.mode = "colocated"
            if rr is not None and pools is not None:
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

    async def _peer_prefix(
        self, body: dict[str, Any], target: Candidate, rr: RoutingRequest, pools: Pools, trace: RequestTrace
    ) -> dict[str, Any]:
        """``body``, given the transfer params of a prefix a peer leased for ``target`` when the measured
        rates favour loading it (``router.planning.peer_fetch``); else ``body`` as it came (``target`` computes)."""
        if self.peers is None or not rr.block_keys:
            return body
        # Colocated peers only: a prefill or decode node's engine is sized and admitted for its role.
        pool = [c for c in pools.colocated if not self.fleet.is_down(c.node_id)]
        verdict = self.peers.plan(rr.model, rr.block_keys, len(rr.prompt_token_ids), target, pool)
        if verdict is None:
            return body
        if verdict.plan is None:
            self._peer_outcome(trace, verdict.outcome)
            return body
        plan = verdict.plan
        params = await self._source_leg(body, plan, rr, trace)
        if params is None:
            return body
        out = dict(body)
        # vLLM's P/D convention: a decode engine given the prefill side's hit (remote_prefill_cached_tokens)
        # reports that as its own cached_tokens. Here the serving node's own figure is the one that counts
        # (its hit plus what it loaded), so the peer's is not passed on.
        params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        # (beside a retention hint the body may carry: router.planning.retention)
        out["kv_transfer_params"] = trace.kv_params = {
            **(body.get("kv_transfer_params") or {}),
            **params,
            "prefix_tokens": plan.prefix_tokens,
            "prefix_key": rr.block_keys[plan.prefix_tokens // target.node.info.block_size - 1],
        }
        note_peer_fetch(trace, plan.source.node_id, plan.prefix_tokens, plan.own_tokens)
        self._peer_outcome(trace, "fetched")
        return out

    async def _source_leg(
        self, body: dict[str, Any], plan: FetchPlan, rr: RoutingRequest, trace: RequestTrace
    ) -> dict[str, Any] | None:
        """Ask the peer to lease the prefix: its transfer params, or None when it failed or took longer
        than computing would have (the leg is then cancelled: an aborted request leases nothing)."""
        assert self.peers is not None
        rates, source = self.peers.rates, plan.source
        pbody: dict[str, Any] = {
            "model": body["model"],
            "prompt": list(rr.prompt_token_ids[: plan.prefix_tokens]),
            "max_tokens": 1,
            "kv_transfer_params": prefill_request_params(),
        }
        if body.get("cache_salt"):
            pbody["cache_salt"] = body["cache_salt"]  # the same salted hashes as the request's own
        start = time.monotonic()
        try:
            async with asyncio.timeout(plan.compute_s):
                with self.fleet.track(source):
                    resp = await self.client.post_json(
                        source.node.info.url + PATHS["completion"], pbody, self._headers(trace, "prefill")
                    )
        except TimeoutError:
            elapsed = time.monotonic() - start
            rates.observe_source(source.node_id, elapsed)  # so a slow peer is asked less
            self.metrics.peer_fetch_leg.observe(elapsed)
            self._peer_outcome(trace, "source_slow")
            return None
        except UpstreamError as exc:
            self._node_failed(source, exc)
            log.warning("prefix fetch from %s failed (%s); computing it here", source.node_id, exc.message)
            self._peer_outcome(trace, "source_failed")
            return None
        elapsed = time.monotonic() - start
        rates.observe_source(source.node_id, elapsed)
        self.metrics.peer_fetch_leg.observe(elapsed)
        params = resp.get("kv_transfer_params")
        if not is_tandem_params(params):
            log.warning("prefix fetch from %s: no transfer params in its answer; computing", source.node_id)
            self._peer_outcome(trace, "source_failed")
            return None
        return params  # type: ignore[return-value]

    def _peer_outcome(self, trace: RequestTrace, outcome: str) -> None:
        trace.peer_outcome = outcome
        self.metrics.peer_fetches.labels(outcome).inc()

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
