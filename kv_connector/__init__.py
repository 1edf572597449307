"""The vLLM connector shell: the class vLLM loads (``kv_connector.connector.TandemConnector``).

It sits above everything it wires together: a scheduler half (``scheduler``) that hands the decode side to
``decode_nodes.admission``, a worker half (``worker``) that builds the prefill block server and the decode
puller, and the Prometheus metrics vLLM collects (``prom``). The KV primitives (wire, transports, layout,
checksums) stay in ``kv_transfer`` below the role packages, so no package imports back up into this one.
"""
