"""Reading a vLLM engine's Prometheus ``/metrics`` into the few numbers Tandem needs."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from contracts.errors import UpstreamError


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float
    num_kv_blocks: int
    block_size: int
    prompt_tokens_by_source: dict[str, float]
    """vllm:prompt_tokens_by_source_total: local_compute / local_cache_hit / external_kv_transfer."""
    generation_tokens: float


def parse_metrics(text: str) -> EngineSnapshot:
    values: dict[str, float] = {}
    by_source: dict[str, float] = {}
    blocks = block_size = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total":
                by_source[s.labels.get("source", "")] = by_source.get(s.labels.get("source", ""), 0) + s.value
            elif s.name == "vllm:cache_config_info":
                blocks = int(s.labels.get("num_gpu_blocks") or 0)
                block_size = int(s.labels.get("block_size") or 0)
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return EngineSnapshot(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=float(values.get("vllm:kv_cache_usage_perc", 0.0)),
        num_kv_blocks=blocks,
        block_size=block_size,
        prompt_tokens_by_source=by_source,
        generation_tokens=values.get("vllm:generation_tokens_total", 0.0),
    )


async def read_snapshot(client: httpx.AsyncClient, base_url: str) -> EngineSnapshot:
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=5.0)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise UpstreamError(f"engine metrics at {base_url} unreadable: {exc}") from exc
    return parse_metrics(resp.text)
