"""Start-up hook of every Python process of a Tandem engine (the node puts this folder first on the
engine's PYTHONPATH; Python imports ``sitecustomize`` by itself at start-up).

NIXL's UCX progress thread busy-polls a whole core for the life of the engine, even when idle (measured
here: 5.0 s of CPU per 5 s). On a host with few cores that thread steals the core the engine computes
on. vLLM's NixlConnector builds its agent config without a way to turn the thread off, so we change the
default: with no progress thread, UCX makes progress inside the connector's own per-step calls
(transfer-state checks and notification reads), and loopback transfers use one-sided shared-memory
transports that need no progress from the target. ``TANDEM_NIXL_PROGRESS_THREAD=1`` restores NIXL's
behaviour (e.g. for RDMA between hosts with cores to spare).
"""

import os


def _quiet_nixl() -> None:
    if os.environ.get("TANDEM_NIXL_PROGRESS_THREAD", "0") == "1":
        return
    try:
        import nixl_cu12._api as api  # the build vllm's nixl_utils resolves `nixl._api` to on this host
    except ImportError:
        return
    original = api.nixl_agent_config.__init__
    if getattr(original, "_tandem_patched", False):
        return

    def __init__(self, *args, **kwargs):  # noqa: N807, ANN001, ANN002, ANN003, ANN202
        kwargs["enable_prog_thread"] = False
        original(self, *args, **kwargs)

    __init__._tandem_patched = True  # type: ignore[attr-defined]
    api.nixl_agent_config.__init__ = __init__


_quiet_nixl()
