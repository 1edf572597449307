"""``TandemConnector``: the vLLM KV connector that vLLM loads through
``{"kv_connector": "TandemConnector", "kv_connector_module_path": "kv_connector.connector"}``.

A thin facade: vLLM builds one instance per role, and each delegates to its half, the scheduler half
(``scheduler.py``) or the worker half (``worker.py``), which never import each other. They share only
the metadata types (``metadata.py``), the wire format (``wire.py``) and the settings.

The KV moves after the prefill finishes (pull model), or, for a prefill sent together with its decode
leg (layer-wise), while it computes: each layer of the last chunk is served as ``save_kv_layer`` reports it.
In both, the prefill node leases the request's blocks,
the decode node pulls them over the chosen transport and acknowledges, and the lease state machine
(``prefill_nodes/lease.py``) frees them on every path, including the failures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_connector.prom import TandemKVStats, TandemPromMetrics
from kv_connector.scheduler import TandemScheduler
from kv_connector.worker import TandemWorker
from kv_transfer.layout import KVLayout
from kv_transfer.metadata import TandemMetadata, TransferReports
from kv_transfer.settings import ConnectorSettings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class TandemConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        if tc is None:  # vLLM builds a connector only from a kv_transfer_config
            raise ValueError("TandemConnector needs a kv_transfer_config")
        settings = ConnectorSettings(**(tc.kv_connector_extra_config or {}))
        engine_id = tc.engine_id or "tandem"
        self._scheduler: TandemScheduler | None = None
        self._worker: TandemWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = TandemScheduler(settings, engine_id, vllm_config.cache_config.block_size)
        else:
            self._worker = TandemWorker(settings, engine_id, kv_cache_config.num_blocks)

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(KVLayout.from_torch(kv_caches, self._worker.num_blocks), list(kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TandemMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Only a split prefill's pull is synchronous (``layer_gate``); every other one completes before
        # its request is scheduled.
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Blocks are served from the engine's cache itself, under a lease: nothing to copy out. A step
        # that ends a layer-wise prefill tells the block server each layer as it is written.
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TandemMetadata)
        self._worker.layer_saved(layer_name, meta)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> TransferReports | None:
        return self._worker.take_reports() if self._worker is not None else None

    def get_kv_connector_stats(self) -> TandemKVStats | None:
        if self._worker is None:
            return None
        data = self._worker.stats_snapshot()
        return TandemKVStats(data=data) if data is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side --------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        # A step that schedules no tokens only waits for transfers (vLLM keeps stepping while a
        # request waits for remote KV or a finished one waits for its lease): tell the worker.
        return self._scheduler.build_connector_meta(
            idle=scheduler_output.total_num_scheduled_tokens == 0, scheduled=scheduler_output.num_scheduled_tokens
        )

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        self._scheduler.update_connector_output(
            set(connector_output.finished_recving or ()), meta.reports if isinstance(meta, TransferReports) else None
        )

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
        return self._scheduler.request_finished(request, list(ids or ()))

    # -- class-level hooks (API-server process) --------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TandemKVStats | None:
        return TandemKVStats(data=data) if data is not None else TandemKVStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> TandemPromMetrics:
        return TandemPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
