"""The legs that involve a colocated node's peer: a prefix the peer leases for the serving node
(``router.planning.peer_fetch``: the source leg, then the request with the lease's params).

``PeerLegs`` is a part of ``router.planning.legs.Legs``, kept apart because it is one policy with its own
failure handling: a source leg that fails or is too slow leaves the request to compute the prefix itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from contracts.errors import UpstreamError
from kv_transfer import prefill_request_params
from kv_transfer.control import is_tandem_params
from router.fleet import Fleet, Pools
from router.planning.peer_fetch import FetchPlan, PeerFetch
from router.policies.base import Candidate, RoutingRequest
from router.record.metrics import RouterMetrics
from router.record.trace import RequestTrace, note_peer_fetch
from router.upstream.node_client import NodeClient

log = logging.getLogger("tandem.router")

COMPLETIONS = "/v1/completions"


class PeerLegs:
    fleet: Fleet
    client: NodeClient
    metrics: RouterMetrics
    peers: PeerFetch | None

    if TYPE_CHECKING:

        def _headers(self, trace: RequestTrace, leg: Literal["prefill", "decode"]) -> dict[str, str]: ...
        def _node_failed(self, node: Candidate, exc: UpstreamError) -> None: ...

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
                        source.node.info.url + COMPLETIONS, pbody, self._headers(trace, "prefill")
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
