"""The router's Prometheus metrics: its own registry, and every backend's metrics merged into its
``/metrics`` with an ``instance`` label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIX = "goodserve:router_"


class RouterMetrics:
    """The router's own Prometheus registry (never the process-wide default one)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests sent to a backend, by how they ended: ok (2xx), "
                                "http_error (the backend's error status), aborted (the client left), "
                                "backend_error (connection lost), connect_error (never sent).",
                                ["backend", "role", "outcome"], registry=r)
        self.backend_errors = Counter(PREFIX + "backend_errors", "Transport errors talking to a backend.",
                                      ["backend", "kind"], registry=r)
        self.in_flight = Gauge(PREFIX + "in_flight_requests", "Requests in flight per backend.", ["backend"],
                               registry=r)
        self.healthy = Gauge(PREFIX + "backend_healthy", "1 if the backend is in rotation.", ["backend"],
                             registry=r)
        self.local = Counter(PREFIX + "local_errors", "Requests the router answered itself with an error.",
                             ["status_code", "reason"], registry=r)
        self.kv_index_blocks = Gauge(PREFIX + "kv_index_blocks", "Prefix-cache blocks the router's index holds for "
                                     "a backend, from its KV events (compare goodserve:prefix_cache_blocks).",
                                     ["backend"], registry=r)
        self.kv_releases = Counter(PREFIX + "kv_hold_releases", "Holds the router asked a producer to free (P/D), by "
                                   "answer: released, pulling (a consumer is reading it), not_found, error.",
                                   ["backend", "outcome"], registry=r)


def relabel_metrics(text: str, instance: str) -> list:
    """Parse a Prometheus text exposition and add the label ``instance=<instance>`` to every sample.

    Args:
        text: Prometheus text format (as a backend's ``/metrics`` serves it).
        instance: The label's value (the router uses the backend's base URL).

    Returns:
        The metric families (``prometheus_client.Metric``), samples relabelled.

    Raises:
        ValueError: if ``text`` is not valid exposition text.
    """
    families = []
    for fam in text_string_to_metric_families(text):
        fam.samples = [Sample(s.name, {**s.labels, "instance": instance}, s.value, s.timestamp, s.exemplar)
                       for s in fam.samples]
        families.append(fam)
    return families


class FixedFamilies:
    """A collector that yields fixed metric families (to expose them with ``generate_latest``)."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
