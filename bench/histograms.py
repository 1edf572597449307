"""Prometheus histograms read off an engine's ``/metrics`` page: parsed with their label sets summed,
differenced across a run, and a quantile interpolated inside a bucket as Prometheus does. What
``bench.fleet`` reads vLLM's own inter-token latency with."""

from __future__ import annotations


def parse_histogram(text: str, name: str) -> tuple[dict[float, float], float, float]:
    """A Prometheus histogram from a /metrics page, its label sets summed: (cumulative count per upper
    bound, sum, count). Parsed by ``prometheus_client``, as ``bench.kv_transfer`` reads its counters."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])  # "+Inf" parses as inf
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return buckets, total, count


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The q-quantile of a cumulative histogram, linear inside the bucket it falls in (Prometheus's
    ``histogram_quantile``); NaN when empty. A quantile in the +Inf bucket is its lower bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return float("nan")
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def diff_buckets(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {b: after[b] - before.get(b, 0.0) for b in after}
