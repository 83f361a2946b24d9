"""Prometheus metrics under `kvpage:`, with vLLM's names and meanings: engine gauges and counters read
from the engine loop's stats snapshot at scrape time, and per-request latency histograms.

Each app has its own CollectorRegistry, so several servers (tests build many) never share series.
"""
from __future__ import annotations

import time
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpage.engine.outputs import RequestOutput

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

# (metric, engine stats key, help) for the counters; Prometheus adds the _total suffix.
_COUNTERS = (
    ("kvpage:prefix_cache_queries", "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."),
    ("kvpage:prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
    ("kvpage:num_preemptions", "num_preemptions", "Preemptions (swap and recompute) by the scheduler."),
    ("kvpage:prompt_tokens", "num_prompt_tokens", "Prompt tokens of the requests added."),
    ("kvpage:generation_tokens", "num_generation_tokens", "Tokens sampled."),
)
# [kv tier] (issue 48) the KV offload tier's counters, where one is configured (kvpage serve --kv-offloading-*).
_TIER_COUNTERS = (
    ("kvpage:kv_offload_hits", "kv_offload_hit_tokens", "Prompt tokens loaded from the KV offload tier, not computed."),
    ("kvpage:kv_offload_loads", "kv_offload_loaded_blocks", "KV blocks loaded from the offload tier."),
    ("kvpage:kv_offload_stores", "kv_offload_stored_blocks", "KV blocks written to the offload tier."),
)

# [spec decode] (issue 51) speculative decoding's counters (vLLM's vllm:spec_decode_*), where it is configured.
_SPEC_COUNTERS = (
    ("kvpage:spec_decode_num_drafts", "spec_decode_num_drafts", "Decode steps of a sequence that verified proposed tokens."),
    ("kvpage:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Proposed (draft) tokens verified."),
    ("kvpage:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
)


class _EngineCollector:
    """Gauges and counters of the engine, from the loop's latest stats snapshot."""

    def __init__(self, engine_loop, labels: dict[str, str]) -> None:
        self.engine_loop = engine_loop
        self.labels = labels

    def _family(self, cls, name: str, help_: str, value: float):
        family = cls(name, help_, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        s = self.engine_loop.stats
        yield self._family(GaugeMetricFamily, "kvpage:num_requests_running", "Requests in the running batch.",
                           s["num_running"])
        yield self._family(GaugeMetricFamily, "kvpage:num_requests_waiting",
                           "Requests waiting to run (queued or swapped out).", s["num_waiting"] + s["num_swapped"])
        yield self._family(GaugeMetricFamily, "kvpage:kv_cache_usage_perc",
                           "Fraction of KV-cache blocks in use (1 = full).",
                           s["kv_blocks_used"] / s["num_kv_blocks"] if s["num_kv_blocks"] else 0.0)
        for name, key, help_ in _COUNTERS:
            yield self._family(CounterMetricFamily, name, help_, s[key])
        for name, key, help_ in _TIER_COUNTERS + _SPEC_COUNTERS:  # [kv tier], [spec decode]: where configured
            if key in s:
                yield self._family(CounterMetricFamily, name, help_, s[key])


class ServerMetrics:
    def __init__(self, engine_loop, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(_EngineCollector(engine_loop, labels))
        self._labels = labels
        histogram = lambda name, help_, buckets: Histogram(  # noqa: E731
            name, help_, list(labels), buckets=buckets, registry=self.registry).labels(**labels)
        self.ttft = histogram("kvpage:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("kvpage:time_per_output_token_seconds", "Time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = histogram("kvpage:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.success = Counter("kvpage:request_success", "Requests finished, by the finish reason of their first"
                               " choice.", [*labels, "finished_reason"], registry=self.registry)

    def observe_finished(self, out: RequestOutput, arrival: float) -> None:
        """One engine request's latencies, from its arrival at the server (time.perf_counter, the
        engine's clock too) to its first token and to its end."""
        now = time.perf_counter()
        self.e2e.observe(now - arrival)
        if out.outputs:
            self.success.labels(**self._labels, finished_reason=out.outputs[0].finish_reason).inc()
        first = out.metrics.get("first_token_time")
        if first is None:
            return
        self.ttft.observe(max(first - arrival, 0.0))
        num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if num_tokens > 1:
            self.tpot.observe((now - first) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
