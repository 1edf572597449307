"""Prefill nodes: engines that compute prompts and hand their KV to decode nodes.

What a prefill node does beyond stock vLLM:

- ``engine.py``: the engine arguments that suit the role;
- ``block_server.py``: the block server that answers decode nodes' pulls from the engine's own KV cache
  (its thread and the engine thread's calls), with ``block_requests.py`` (the wire protocol's messages
  and the pulls waiting for their lease), ``block_sender.py`` (a pull's blocks, by transport) and
  ``layer_streams.py`` (layer-wise pulls served while the prefill computes);
- ``lease.py``: the lease table and its state machine, which frees a request's blocks on every path.

The block server runs inside the engine, started by the worker half of the connector vLLM loads
(``kv_connector.worker``). The node process itself (engine supervision, registry, heartbeat) is shared by
every role: ``node_agent``.
"""

from __future__ import annotations

from prefill_nodes.engine import engine_args

__all__ = ["engine_args"]
