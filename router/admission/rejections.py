"""``tandem_store_rejected_total{kind}``: Redis content this router refused because it did not prove the
cluster secret, read when Prometheus scrapes (the counts live where the checks run, nothing on the fast
path).

Kinds: ``key_record`` (a key record whose HMAC fails, ``key_records``), ``auth_flag`` (``keys:exist`` =
"0" while the store holds keys) and ``registry_<reason>`` (a node registry entry left out: ``unproven``,
``version``, ``malformed``; ``contracts.registry``). A non-zero ``key_record``, ``auth_flag`` or
``registry_unproven`` means someone without the secret writes to this cluster's Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

Counts = Callable[[], Mapping[str, int]]


class RejectedRecords(Collector):
    """One counter family over ``keys`` (the key store's ``rejected``) and ``registry`` (the fleet's
    ``skipped_entries``)."""

    def __init__(self, keys: Counts, registry: Counts) -> None:
        self._keys, self._registry = keys, registry

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter([self._family({})])

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = {{"record": "key_record", "flag": "auth_flag"}.get(k, k): n for k, n in self._keys().items()}
        counts.update({f"registry_{k}": n for k, n in self._registry().items()})
        return iter([self._family(counts)])

    @staticmethod
    def _family(counts: Mapping[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "tandem_store_rejected",
            "Redis content refused for not proving the cluster secret (or unreadable), by kind",
            labels=["kind"],
        )
        for kind in ("key_record", "auth_flag", "registry_unproven"):
            family.add_metric([kind], counts.get(kind, 0))
        for kind, n in sorted(counts.items()):
            if kind not in ("key_record", "auth_flag", "registry_unproven"):
                family.add_metric([kind], n)
        return family
