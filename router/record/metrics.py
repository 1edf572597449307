"""The router's Prometheus metrics (all ``tandem_``), served at ``/metrics``.

Request-level metrics (TTFT, ITL, E2E, requests by status, tokens, hit rates, transfer bytes) are the
shared ``telemetry.TandemMetrics``, fed from the same record that goes to the lake, so the two never
disagree. The router adds what only it can see: the prefill leg, fallbacks, errors by type, and its
view of the fleet, and its admission queues (read from the controller at scrape time):

    tandem_admission_queue_depth{node,priority}     gauge, requests queued in this router for a slot on
                                                    the node, by class (interactive | batch)
    tandem_admission_slots_in_use{node}             gauge, slots this router holds on the node
    tandem_admission_shed_total{node}               counter, requests refused or evicted (503) at the node
    tandem_admission_expired_total{node}            counter, requests dropped unserved at their deadline

and the model table's resolutions (``router.model_table``), labelled only with names the table holds
or a live node serves (a client's unknown name is never a label; its request is a 404):

    tandem_model_resolutions_total{requested,served,via}   counter, via = direct | alias | canary | fallback

and how P/D pairs were sent (``router.planning.layerwise``):

    tandem_pd_pairs_total{mode}                     counter, mode = layerwise (both legs at once) |
                                                    sequential (prefill, then a whole pull)

and cross-node prefix reuse (``router.planning.peer_fetch``), per request a peer could have helped:

    tandem_peer_fetch_total{outcome}                counter, outcome = fetched (the peer leased the
                                                    prefix; the serving node pulls it) | slower (computing
                                                    was predicted faster) | source_failed | source_slow
                                                    (the peer's leg failed or outlasted its budget: computed)
    tandem_peer_fetch_seconds                       histogram, the peer's source leg
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.admission.priority import NodeQueueStats
from telemetry.metrics import LATENCY_BUCKETS, TandemMetrics


class AdmissionCollector(Collector):
    """The admission controller's per-node queues, read when Prometheus scrapes (nothing on the fast
    path). ``source`` is set once the controller exists; until then nothing is exported."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, NodeQueueStats]] | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(self._families({}))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.source() if self.source is not None else {}))

    @staticmethod
    def _families(stats: Mapping[str, NodeQueueStats]) -> list[Metric]:
        queued = GaugeMetricFamily(
            "tandem_admission_queue_depth",
            "Requests queued in this router for a slot on a node, by class",
            labels=["node", "priority"],
        )
        running = GaugeMetricFamily(
            "tandem_admission_slots_in_use", "Slots this router holds on a node", labels=["node"]
        )
        shed = CounterMetricFamily(
            "tandem_admission_shed", "Requests refused or evicted (503) by a node's admission queue", labels=["node"]
        )
        expired = CounterMetricFamily(
            "tandem_admission_expired", "Requests dropped unserved at their deadline", labels=["node"]
        )
        for node, st in sorted(stats.items()):
            queued.add_metric([node, "interactive"], st.queued_interactive)
            queued.add_metric([node, "batch"], st.queued_batch)
            running.add_metric([node], st.running)
            shed.add_metric([node], st.shed)
            expired.add_metric([node], st.expired)
        return [queued, running, shed, expired]


class RouterMetrics:
    """One instance per app, on its own registry (tests build many apps in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.common = TandemMetrics(r)
        self.prefill_leg = Histogram(
            "tandem_prefill_leg_seconds", "Prefill leg duration (P/D only)", buckets=LATENCY_BUCKETS, registry=r
        )
        self.errors = Counter("tandem_errors_total", "Errors by type", ["type"], registry=r)
        self.fallbacks = Counter(
            "tandem_prefill_fallbacks_total",
            "P/D requests prefilled on the decode node because the prefill leg failed",
            registry=r,
        )
        self.pairs = Counter(
            "tandem_pd_pairs_total", "P/D pairs sent, by mode (layerwise | sequential)", ["mode"], registry=r
        )
        self.layerwise_pairs, self.sequential_pairs = self.pairs.labels("layerwise"), self.pairs.labels("sequential")
        self.peer_fetches = Counter(
            "tandem_peer_fetch_total",
            "Requests a peer could help, by outcome (a cached prefix: fetched | slower | source_failed | "
            "source_slow; a prefix it computes meanwhile: split | split_failed)",
            ["outcome"],
            registry=r,
        )
        self.peer_fetch_leg = Histogram(
            "tandem_peer_fetch_seconds", "The peer's source leg of a prefix fetch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inflight = Gauge(
            "tandem_node_inflight_requests", "Requests this router has in flight per node", ["node", "role"], registry=r
        )
        self.kv_usage = Gauge(
            "tandem_node_kv_usage_ratio", "KV cache usage per node (last heartbeat)", ["node", "role"], registry=r
        )
        self.resolutions = Counter(
            "tandem_model_resolutions_total",
            "Requests by the model they named, the served model they went to, and how (router.model_table)",
            ["requested", "served", "via"],
            registry=r,
        )
        self.live_nodes = Gauge("tandem_live_nodes", "Live nodes by role", ["role"], registry=r)
        self.transports = Counter(
            "tandem_requests_by_transport",
            "Finished requests by endpoint and the transport they came by (http, websocket)",
            ["endpoint", "transport"],
            registry=r,
        )
        self.ws_open = Gauge("tandem_ws_open", "WebSockets open on this router, by API", ["api"], registry=r)
        self.ws_upgrades = Counter(
            "tandem_ws_upgrades_total",
            "WebSocket upgrades by API and outcome (accepted, or the refusal's error)",
            ["api", "outcome"],
            registry=r,
        )
        self.admission = AdmissionCollector()
        r.register(self.admission)
