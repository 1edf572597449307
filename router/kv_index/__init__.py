"""Fleet KV index: routing keys equal to vLLM's block hashes, an index of which node holds which
block (fed by the engines' ZeroMQ KV events), and the offline ideal hit rate.

Wiring in the router (one event loop, one of each per process):

    index = FleetIndex()
    hashers = {model: BlockHasher(block_size, "sha256_cbor")}          # must match the nodes' flags
    subscribers = KVEventSubscribers(index, hashers=hashers)
    policy = CacheAware(index)                                         # router.policies
    ... on every registry refresh:   await subscribers.sync(live_nodes)
    ... per request, after tokenizing the rendered prompt:
        keys = hashers[model].keys(token_ids)
        decision = policy.select(RoutingRequest(..., prompt_token_ids=tuple(token_ids),
                                                block_keys=tuple(keys)), prefill, decode)
    ... when it ends: policy.on_complete(decision); at shutdown: await subscribers.close()
"""

from router.kv_index.attribution import MissAttribution, PrefixView, attribute, prefix_view
from router.kv_index.block_keys import BlockHasher, BlockKey, block_keys, external_key
from router.kv_index.ideal import ideal_cached_tokens, ideal_hit_rate
from router.kv_index.index import Eviction, FleetIndex, ModelIndex, bench_longest_prefix
from router.kv_index.subscriber import CurveClient, KVEventSubscriber, KVEventSubscribers, SubscriberStats

__all__ = [
    "BlockHasher",
    "CurveClient",
    "BlockKey",
    "Eviction",
    "FleetIndex",
    "KVEventSubscriber",
    "KVEventSubscribers",
    "MissAttribution",
    "ModelIndex",
    "PrefixView",
    "SubscriberStats",
    "attribute",
    "bench_longest_prefix",
    "block_keys",
    "external_key",
    "ideal_cached_tokens",
    "ideal_hit_rate",
    "prefix_view",
]
