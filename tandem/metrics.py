"""Prometheus /metrics over HTTP for one service: its own CollectorRegistry (never the
process-global one: tests run several services in one process), a collector that turns the
service's figures (tandem.figures) into metric families at scrape time, so /metrics and the
Stats RPC read the same numbers, and the HTTP server's start and stop."""

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.figures import HistogramSnapshot
from tandem.ops import EngineStats

log = logging.getLogger(__name__)

# Per model service: (suffix, EngineStats field, help) of the token counters it reports.
ENGINE_TOKEN_COUNTERS = {
    "target": (
        ("prefill_tokens", "prefill_tokens_total", "Prompt tokens run through the model."),
        ("decode_tokens", "decode_tokens_total", "Decode inputs run through the model, draft tokens included."),
        ("verified_draft_tokens", "verified_draft_tokens_total", "Draft tokens scored by verification."),
    ),
    "draft": (
        ("proposed_tokens", "proposed_draft_tokens_total", "Draft tokens proposed to the router."),
    ),
}


class _Collector:
    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


class MetricsServer:
    """A service's /metrics endpoint (and /), served on a thread until stop()."""

    def __init__(self, host: str, port: int, collect: Callable[[], Iterable[Metric]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(collect))
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._httpd.server_port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_metrics(host: str, port: int, collect: Callable[[], Iterable[Metric]], name: str) -> MetricsServer | None:
    """Starts the endpoint on host:port; port 0 means off (returns None)."""
    if not port:
        return None
    server = MetricsServer(host, port, collect)
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", name, host, server.port)
    return server


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def labelled_counter(name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def histogram(name: str, doc: str, snap: HistogramSnapshot) -> HistogramMetricFamily:
    cumulative = snap.cumulative()
    buckets = [(_le(b), c) for b, c in zip(snap.bounds, cumulative)] + [("+Inf", cumulative[-1])]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=snap.sum)


def _le(bound: float) -> str:
    return repr(float(bound))


STEP_DURATION_HELP = {
    "target": "Time in the engine of one step that runs the model (its sequence ops included).",
    "draft": "Time in the engine of one draft call that drafts: its wait for the target's hidden "
             "states, its sequence ops and the drafting.",
}


def engine_families(role: str, stats: EngineStats, step: HistogramSnapshot) -> list[Metric]:
    """A model service's metrics (role: target or draft), named tandem_<role>_*."""
    p = f"tandem_{role}"
    families = [
        counter(f"{p}_steps_total", f"{role.capitalize()} steps run.", stats.steps_total),
        histogram(f"{p}_step_duration_seconds", STEP_DURATION_HELP[role], step),
        gauge(f"{p}_kv_pages_used", "KV cache pages in use.", stats.kv_pages_total - stats.kv_pages_free),
        gauge(f"{p}_kv_pages_total", "KV cache pages in all (0: no KV cache).", stats.kv_pages_total),
        gauge(f"{p}_sequences", "Sequences the service holds for the router.", stats.sequences_live),
    ]
    for suffix, field, doc in ENGINE_TOKEN_COUNTERS[role]:
        families.append(counter(f"{p}_{suffix}_total", doc, getattr(stats, field)))
    return families


def engine_collector(role: str, engine) -> Callable[[], list[Metric]]:
    """What a target or draft engine (with .stats() and .figures) reports at each scrape."""
    return lambda: engine_families(role, engine.stats(), engine.figures.step_seconds.snapshot())
