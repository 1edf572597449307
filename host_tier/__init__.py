"""The host tier: a per-host shared-memory KV block store, addressed by the engines' own block hashes.

- ``arena.py``: the shared file of slots, the seqlock + checksum read that never serves a wrong block;
- ``server.py``: the one owner (slot states, the bound, reclaim of abandoned writes, events);
- ``eviction.py``: the stated policy (LRU, retention pins evicted last);
- ``client.py``: put / get / pin from any process on the host;
- ``events.py``: store/remove events in vLLM's KV-event format with ``medium="CPU_SHM"``;
- ``layout.py``: the fingerprint that keeps blocks of different models, dtypes or seeds apart.

Issue 14 item 2. Not wired into the engines' connector yet: that is the next step (offload at
``request_finished`` under the lease, load in ``get_num_new_matched_tokens`` / ``start_load_kv``).
"""
