"""What Tandem's processes agree on, and nothing else: anything may import this package, and it imports
nothing of ours (``pyproject.toml``'s import contracts hold it to that).

- ``errors``: the one exception hierarchy (every process raises and translates into it);
- ``registry``: the node registry's records in Redis and their schema version (node agents write them,
  routers and the launcher read them);
- ``transfer``: ``kv_transfer_params`` and the transfer report, typed and versioned (prefill node ->
  router -> decode node -> router);
- ``config``: the settings every process shares (the one Redis URL);
- ``cli``: how every ``tandem`` sub-command ends on one of our errors.

Each versioned contract says its history where it is defined and is checked where it is read; a
mismatch is a ``VersionMismatch`` naming both versions.
"""
