"""Decode nodes: engines that load a prompt's KV from a prefill node and generate the answer.

What a decode node does beyond stock vLLM:

- ``engine.py``: the engine arguments that suit the role;
- ``puller.py``: the pull of a request's blocks from the prefill node's block server, over the chosen
  transport, and its outcome (acknowledged, refused, failed);
- ``admission.py``: the admission of remote KV, i.e. the decode side of the connector's scheduler half
  (which requests load KV from a peer, and when a lease is released instead).

Both run inside the engine, driven by the connector vLLM loads (``kv_transfer``). The node process itself
(engine supervision, registry, heartbeat) is shared by every role: ``node_agent``.
"""

from __future__ import annotations

from decode_nodes.engine import engine_args

__all__ = ["engine_args"]
