"""The host tier's Prometheus metrics (``tandem tier serve --metrics-port``), for /metrics scrapers.

The server loop owns the tier's state and is single-threaded; the HTTP exporter runs on its own thread.
So the loop hands over a snapshot (``TierStats``, a frozen value) once a second, and the collector
reads only that: a scrape never touches the live state and never waits for the loop.

    tandem_tier_blocks{state=held|writing|pinned}  gauges          tandem_tier_slots, _slot_bytes
    tandem_tier_pinned_bytes                       gauge           what session retention holds
    tandem_tier_stored_total, _hits_total, _misses_total           counters (blocks)
    tandem_tier_pinned_hits_total                  counter         hits on pinned blocks ("hits saved")
    tandem_tier_evictions_total{reason=lru|pinned_spare|pinned_lru}  counter
    tandem_tier_forgotten_total{reason=corrupt|...}                counter
    tandem_tier_pins_refused_total, _demoted_total, _reclaimed_total
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from host_tier.messages import TierStats


class TierCollector:
    def __init__(self) -> None:
        self.snapshot: TierStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        blocks = GaugeMetricFamily("tandem_tier_blocks", "Blocks in the tier by state.", labels=["state"])
        for state, n in (("held", s.held), ("writing", s.writing), ("pinned", s.pinned)):
            blocks.add_metric([state], n)
        yield blocks
        yield GaugeMetricFamily("tandem_tier_slots", "Slots the tier has (its bound).", value=s.n_slots)
        yield GaugeMetricFamily("tandem_tier_slot_bytes", "Bytes of one block.", value=s.slot_bytes)
        yield GaugeMetricFamily(
            "tandem_tier_pinned_bytes", "Bytes held pinned by session retention.", value=s.pinned * s.slot_bytes
        )
        for name, doc, value in (
            ("stored", "Blocks offloaded into the tier.", s.stored),
            ("hits", "Blocks found by lookups.", s.hits),
            ("misses", "Blocks lookups did not find.", s.misses),
            ("pinned_hits", "Lookup hits on pinned blocks.", s.pinned_hits),
            ("pins_refused", "Blocks a pin asked for beyond its tenant's budget.", s.pins_refused),
            ("demoted", "Superseded blocks of a session, unpinned and sent to the cold end.", s.demoted),
            ("reclaimed", "Reservations taken back from writers that vanished.", s.reclaimed),
        ):
            yield CounterMetricFamily(f"tandem_tier_{name}", doc, value=value)
        for name, doc, counts in (
            ("evictions", "Blocks evicted, by reason.", s.evictions),
            ("forgotten", "Blocks dropped because a reader found them bad, by reason.", s.forgotten),
        ):
            family = CounterMetricFamily(f"tandem_tier_{name}", doc, labels=["reason"])
            for reason, n in sorted(counts.items()):
                family.add_metric([reason], n)
            yield family


def serve_metrics(port: int) -> TierCollector:
    """Start the exporter on 127.0.0.1:``port``; returns the collector to hand snapshots to."""
    registry = CollectorRegistry()
    collector = TierCollector()
    registry.register(collector)
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return collector
