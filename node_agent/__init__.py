"""The node agent (``tandem node``): one process per node, whatever its role, beside its vLLM engine.

- ``node.py``: the ``vllm serve`` command line and environment for a role, and the agent's main loop;
- ``supervisor.py``: engine supervision (start, health, hang detection, restart with backoff, give up);
- ``settings.py``: ``NodeSettings``, the one settings object of the process (``TANDEM_NODE_*``);
- ``engine_metrics.py``: the engine's load, read from its Prometheus metrics for the heartbeat;
- ``engine_guard.py``: the middleware the engine loads so that every path but liveness and metrics needs its key;
- ``model.py``: where the node's model folder is;
- ``ports.py``, ``lifetime.py``: the engine's ports checked free; process groups that die with their parent.

It registers the engine in the registry (``contracts.registry``) and heart-beats its load; the router
talks to the engine directly, so the agent is never on a request's path. What differs by role is in
``prefill_nodes`` and ``decode_nodes``.
"""
