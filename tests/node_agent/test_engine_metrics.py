from __future__ import annotations

from node_agent.engine_metrics import parse_metrics

SAMPLE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="182"} 1.0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 5.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 38.0
"""


def test_parse_metrics_reads_load_capacity_and_token_sources() -> None:
    snap = parse_metrics(SAMPLE)
    assert (snap.running, snap.waiting, snap.kv_usage) == (3, 1, 0.25)
    assert (snap.num_kv_blocks, snap.block_size) == (182, 128)
    assert snap.prompt_tokens_by_source == {"local_compute": 5.0, "external_kv_transfer": 38.0}
