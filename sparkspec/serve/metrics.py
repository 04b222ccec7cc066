"""Prometheus metrics: engine counters are read at scrape time; latencies are observed per finished request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)


class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes (no bookkeeping on the hot path)."""

    def __init__(self, async_engine):
        self.async_engine = async_engine

    def describe(self):
        return []

    def collect(self):
        snap = self.async_engine.stats()
        st = snap["stats"]
        yield GaugeMetricFamily("sparkspec_num_requests_waiting", "Requests queued, not yet running",
                                value=snap["num_waiting"])
        yield GaugeMetricFamily("sparkspec_num_requests_running", "Requests in the running batch",
                                value=snap["num_running"])
        yield GaugeMetricFamily("sparkspec_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                                value=snap["kv_usage"])
        for name, doc, value in (
            ("sparkspec_prompt_tokens", "Prompt tokens of admitted requests", st.num_prompt_tokens),
            ("sparkspec_generation_tokens", "Generated tokens", st.num_generation_tokens),
            ("sparkspec_engine_steps", "Engine steps", st.num_steps),
            ("sparkspec_decode_rows", "Request-steps after the first token (plain rows + verify blocks)",
             st.num_decode_rows),
            ("sparkspec_spec_decode_num_drafts", "Request-steps that verified at least one draft", st.num_spec_steps),
            ("sparkspec_spec_decode_num_draft_tokens", "Draft tokens verified", st.num_drafted),
            ("sparkspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", st.num_accepted),
            ("sparkspec_spec_decode_drafter_skipped_steps", "Steps where the budget skipped drafting",
             st.num_drafter_skipped_steps),
            ("sparkspec_spec_decode_context_skipped_steps",
             "Of those, steps planned without the drafter's context write (plain decoding settled)",
             st.num_context_skipped_steps),
            # vLLM's vllm:prefix_cache_queries / vllm:prefix_cache_hits, in sparkspec's prefix and spelling
            ("sparkspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admissions)",
             st.num_prefix_cache_queries),
            ("sparkspec_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)",
             st.num_prefix_cache_hits),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        per_pos = CounterMetricFamily("sparkspec_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position", labels=["position"])
        for j, n in enumerate(list(st.accepted_per_position)):
            per_pos.add_metric([str(j)], n)
        yield per_pos


class ServerMetrics:
    def __init__(self, async_engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(async_engine))
        self.requests = Counter("sparkspec_requests", "Finished requests by finish reason (abort: the client went "
                                "away, while sending its body or while its answer was generated)", ["finish_reason"],
                                registry=self.registry)
        self.http_errors = Counter("sparkspec_http_errors", "Refused requests by HTTP status", ["status"],
                                   registry=self.registry)
        self.ttft = Histogram("sparkspec_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("sparkspec_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("sparkspec_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_aborted(self) -> None:
        self.requests.labels("abort").inc()

    def observe_finished(self, out) -> None:
        m = out.metrics
        self.requests.labels(out.finish_reason or "unknown").inc()
        arrival, first, finish = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        if arrival is not None and first is not None:
            self.ttft.observe(first - arrival)
        if first is not None and finish is not None and len(out.token_ids) > 1:
            self.tpot.observe((finish - first) / (len(out.token_ids) - 1))
        if arrival is not None and finish is not None:
            self.e2e.observe(finish - arrival)
