"""Both legs of a layer-wise P/D request, sent straight to the two engines at once, as a sender that
has layer-wise transfer does: the decode leg pulls each layer while the prefill computes it."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from contracts.secret import engine_auth_headers
from contracts.transfer import LAYERWISE_ID_KEY, TransferParams
from kv_transfer import prefill_request_params
from kv_transfer.settings import ConnectorSettings, host_id


def decode_params(prefill_node_port: int, transfer_id: str, transport: str | None = None) -> dict[str, Any]:
    """What the decode leg carries: where the prefill node's block server is (node port + 3, as the node
    configures it), and the transfer id the prefill leg is given."""
    return TransferParams(
        transfer_id=transfer_id,
        remote_block_ids=[],
        remote_endpoints=ConnectorSettings(port=prefill_node_port + 3).endpoints,
        remote_host_id=host_id(),
        remote_engine_id="prefill",
        remote_num_tokens=0,
        lease_deadline=time.time() + 3600,
        transport=transport,
        layerwise=True,
    ).to_dict()


def prefill_params(transfer_id: str) -> dict[str, Any]:
    return {**prefill_request_params(), LAYERWISE_ID_KEY: transfer_id}


def start_decode_leg(
    pool: ThreadPoolExecutor, decode_url: str, body: dict[str, Any], prefill_node_port: int, transport: str | None
) -> tuple[str, Future[httpx.Response]]:
    """Send the decode leg (in ``pool``); returns the transfer id the prefill leg must carry."""
    tid = f"lw-{uuid.uuid4().hex}"
    headers = engine_auth_headers(loopback_only=True)
    json = {**body, "kv_transfer_params": decode_params(prefill_node_port, tid, transport)}
    return tid, pool.submit(httpx.post, f"{decode_url}/v1/chat/completions", json=json, headers=headers, timeout=600)


def layerwise_chat(
    prefill_url: str, decode_url: str, prefill_node_port: int, body: dict[str, Any], transport: str | None = None
) -> httpx.Response:
    """One layer-wise request: the decode leg's answer (its kv_transfer_params carry the pull's report)."""
    headers = engine_auth_headers(loopback_only=True)
    with ThreadPoolExecutor(1) as pool:
        tid, answer = start_decode_leg(pool, decode_url, body, prefill_node_port, transport)
        first = httpx.post(
            f"{prefill_url}/v1/chat/completions",
            json={**body, "max_tokens": 1, "kv_transfer_params": prefill_params(tid)},
            headers=headers,
            timeout=600,
        )
        first.raise_for_status()
        return answer.result()
