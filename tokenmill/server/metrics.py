"""Prometheus metrics under vLLM-style `tokenmill:` names, in a registry owned by one app.

Latency histograms and token counters are fed from the step thread (every RequestOutput); the
gauges and the engine's own cumulative counters (prefix cache, preemptions) are read from the
AsyncEngine's stats snapshot at scrape time, so a scrape never touches the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from tokenmill.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name",)


class EngineStatsCollector:
    """Gauges and engine-side counters from a stats dict (LLMEngine.stats() keys)."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        s = self.stats()
        yield from self._families(s, GaugeMetricFamily, (
            ("num_requests_running", "Sequences in the running batch.", "num_running"),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
             "kv_cache_usage"),
            ("kv_cache_used_bytes", "Bytes of KV cache blocks held by sequences.",
             "kv_cache_used_bytes"),
        ))
        yield from self._families(s, CounterMetricFamily, (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            ("prefix_cache_hits", "Prompt tokens served by the prefix cache.",
             "prefix_cache_hits"),
            ("num_preemptions", "Sequences preempted (KV blocks freed, recomputed later).",
             "num_preemptions"),
        ))
        if "spec_accepted_counts" in s:
            yield from self._spec_decode(s)

    def _families(self, s: dict, kind, table):
        """One metric family of `kind` per (name, doc, stats key)."""
        for name, doc, key in table:
            family = kind(f"tokenmill:{name}", doc, labels=LABELS)
            family.add_metric([self.model_name], float(s[key]))
            yield family

    def _spec_decode(self, s: dict):
        """Speculative decoding (only when it is configured), with vLLM's names."""
        yield from self._families(s, CounterMetricFamily, (
            ("spec_decode_num_drafts", "Verify steps that checked drafted tokens.",
             "spec_num_drafts"),
            ("spec_decode_num_draft_tokens", "Drafted tokens verified.", "spec_num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
             "spec_num_accepted_tokens"),
        ))
        counts = s["spec_accepted_counts"]  # verify steps by drafts accepted: 0, 1, ... k
        family = HistogramMetricFamily(
            "tokenmill:spec_decode_acceptance_length",
            "Drafted tokens accepted per verify step.", labels=LABELS)
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        buckets = [(str(float(i)), float(c)) for i, c in enumerate(cumulative)]
        buckets.append(("+Inf", float(cumulative[-1])))
        family.add_metric([self.model_name], buckets,
                          float(sum(i * c for i, c in enumerate(counts))))
        yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", LABELS,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds",
                             "Time between two steps that gave a request new tokens.", LABELS,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds",
                             "Time from arrival to the last token of finished requests.", LABELS,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prefilled prompt tokens.",
                                     LABELS, registry=r).labels(model_name)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Generated tokens.",
                                         LABELS, registry=r).labels(model_name)

    def watch_engine(self, stats: Callable[[], dict]) -> None:
        self.registry.register(EngineStatsCollector(stats, self.model_name))

    def observe(self, out: RequestOutput) -> None:
        """Called with every RequestOutput (step thread). token_times gets one entry per step
        that gave the request tokens, so its length tells the first output from later ones."""
        m = out.metrics
        self.generation_tokens.inc(sum(len(c.delta_token_ids) for c in out.outputs))
        if len(m.token_times) == 1:
            self.prompt_tokens.inc(m.num_prompt_tokens)
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
        elif len(m.token_times) >= 2:
            self.itl.observe(m.token_times[-1] - m.token_times[-2])
        if out.finished and m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
