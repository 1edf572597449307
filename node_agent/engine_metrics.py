"""Reading a vLLM engine's Prometheus ``/metrics`` into the few numbers Tandem needs."""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

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
    leases_active: int = 0
    """tandem_kv_leases_active: KV leases the engine's connector holds for decode nodes (prefill side)."""
    pulls_active: int = 0
    """tandem_kv_pulls_active: pulls the engine's connector has under way (decode side), a layer-wise
    one for as long as the prefill node computes the prompt."""


LEASES = "tandem_kv_leases_active"
PULLS = "tandem_kv_pulls_active"
_WANTED = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_by_source_total",
        "vllm:cache_config_info",
        "vllm:generation_tokens_total",
        LEASES,
        PULLS,
    }
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> EngineSnapshot:
    """The few samples Tandem reads, by a scan of the exposition text's lines.

    The node agent reads this page every heartbeat on a host it shares with its engine, and vLLM's page
    is mostly histogram buckets Tandem never reads: prometheus_client's parser built every one of them
    (about 16 ms of the node's CPU a beat here, taken from the engine's cores); skipping lines by
    their name costs well under a millisecond. Samples with the same name are summed (one per engine)."""
    values: dict[str, float] = {}
    by_source: dict[str, float] = {}
    blocks = block_size = 0
    for line in text.splitlines():
        if not line.startswith(("vllm:", "tandem_kv_")):
            continue  # comments (# HELP, # TYPE), other exporters' samples
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        name = line[:end]
        if name not in _WANTED:
            continue
        labels: dict[str, str] = {}
        rest = line[end:]
        if rest.startswith("{"):
            close = line.rfind("}")
            labels = dict(_LABEL.findall(line, end, close))
            rest = line[close + 1 :]
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue  # not a sample line Tandem can read; the others still count
        if name == "vllm:prompt_tokens_by_source_total":
            source = labels.get("source", "")
            by_source[source] = by_source.get(source, 0) + value
        elif name == "vllm:cache_config_info":
            blocks = int(labels.get("num_gpu_blocks") or 0)
            block_size = int(labels.get("block_size") or 0)
        else:
            values[name] = values.get(name, 0.0) + value
    return EngineSnapshot(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=float(values.get("vllm:kv_cache_usage_perc", 0.0)),
        num_kv_blocks=blocks,
        block_size=block_size,
        prompt_tokens_by_source=by_source,
        generation_tokens=values.get("vllm:generation_tokens_total", 0.0),
        leases_active=int(values.get(LEASES, 0)),
        pulls_active=int(values.get(PULLS, 0)),
    )


async def read_snapshot(client: httpx.AsyncClient, base_url: str) -> EngineSnapshot:
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=5.0)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise UpstreamError(f"engine metrics at {base_url} unreadable: {exc}") from exc
    return parse_metrics(resp.text)
