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


def test_the_line_scan_agrees_with_prometheus_clients_parser_on_a_full_page() -> None:
    """A page shaped like vLLM's: histograms (the bulk of it), several engines, unlabelled samples,
    label values with escaped quotes and braces, and a timestamp. The fast scan must read what the
    reference parser reads."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = [SAMPLE]
    for engine in ("0", "1"):
        lines.append("# TYPE vllm:time_to_first_token_seconds histogram")
        for le in ("0.001", "0.01", "0.1", "1.0", "+Inf"):
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="{le}",model_name="m"}} 7.0')
        lines.append(f'vllm:num_requests_running{{engine="{engine}",model_name="a \\"b\\" {{c}}"}} 2.0 1700000000000')
        lines.append(f'vllm:generation_tokens_total{{engine="{engine}"}} 100.0')
    lines.append("vllm:num_requests_waiting 4.0")
    lines.append("process_cpu_seconds_total 12.5")
    page = "\n".join(lines) + "\n"

    want: dict[str, float] = {}
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            want[s.name] = want.get(s.name, 0.0) + s.value
    snap = parse_metrics(page)
    assert snap.running == want["vllm:num_requests_running"] == 7
    assert snap.waiting == want["vllm:num_requests_waiting"] == 5
    assert snap.generation_tokens == want["vllm:generation_tokens_total"] == 200
    assert (snap.num_kv_blocks, snap.block_size) == (182, 128)
