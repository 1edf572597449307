"""Prometheus histograms read off an engine's ``/metrics`` page: parsed with their label sets summed,
differenced across a run, and a quantile interpolated inside a bucket as Prometheus does. What
``bench.fleet`` reads vLLM's own inter-token latency with."""

from __future__ import annotations


def parse_histogram(text: str, name: str) -> tuple[dict[float, float], float, float]:
    """A Prometheus histogram from a /metrics page, its label sets summed: (cumulative count per upper
    bound, sum, count)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key.startswith(f"{name}_bucket"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(value)
        elif key.startswith(f"{name}_sum"):
            total += float(value)
        elif key.startswith(f"{name}_count"):
            count += float(value)
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
