"""Fleet KV index: routing keys equal to vLLM's block hashes, an index of which node holds which
block (fed by the engines' ZeroMQ KV events), and the offline ideal hit rate."""

from router.kv_index.block_keys import BlockHasher, BlockKey, block_keys, external_key
from router.kv_index.ideal import ideal_cached_tokens, ideal_hit_rate
from router.kv_index.index import FleetIndex, ModelIndex, bench_longest_prefix
from router.kv_index.subscriber import KVEventSubscriber, KVEventSubscribers, SubscriberStats

__all__ = [
    "BlockHasher",
    "BlockKey",
    "FleetIndex",
    "KVEventSubscriber",
    "KVEventSubscribers",
    "ModelIndex",
    "SubscriberStats",
    "bench_longest_prefix",
    "block_keys",
    "external_key",
    "ideal_cached_tokens",
    "ideal_hit_rate",
]
