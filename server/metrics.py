"""Prometheus metrics of one server: its own CollectorRegistry, never the global one.

Request-side series (latency histograms, token counters) are observed by the server as
outputs stream by; engine-side gauges (running/waiting, pages, slots, prefix-cache hit rate)
are read from `engine.stats()` at scrape time by a custom collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineStatsCollector:
    """Turns `engine.stats()` into gauges when Prometheus scrapes."""

    def __init__(self, read_stats: Callable[[], dict]):
        self._read_stats = read_stats

    def collect(self):
        stats = self._read_stats()
        gauges = {
            "jaxserve_num_requests_running": ("Requests in the running batch", stats.get("num_running", 0)),
            "jaxserve_num_requests_waiting": ("Requests waiting to be scheduled", stats.get("num_waiting", 0)),
            "jaxserve_kv_pages_total": ("KV cache pages in the pool", stats.get("pages_total", 0)),
            "jaxserve_kv_pages_free": ("Free KV cache pages", stats.get("pages_free", 0)),
            "jaxserve_kv_pages_cached": ("Free pages kept by the prefix cache", stats.get("pages_cached", 0)),
            "jaxserve_state_slots_total": ("Recurrent-state slots", stats.get("slots_total", 0)),
            "jaxserve_state_slots_free": ("Free recurrent-state slots", stats.get("slots_free", 0)),
            "jaxserve_state_slots_cached": ("State slots kept by the prefix cache", stats.get("slots_cached", 0)),
            "jaxserve_prefix_cache_hit_rate": (
                "Prefix-cache hit rate (tokens)",
                stats.get("prefix_cache_hit_rate", 0.0),
            ),
            "jaxserve_kv_cache_usage_ratio": ("Fraction of KV pages in use", _usage(stats, "pages")),
            "jaxserve_state_slot_usage_ratio": ("Fraction of state slots in use", _usage(stats, "slots")),
            "jaxserve_weight_bytes": (
                "Bytes of model parameters on the device(s), quantization scales included",
                stats.get("weight_bytes", 0),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        yield CounterMetricFamily(
            "jaxserve_num_preemptions",
            "Requests preempted for lack of pages",
            value=float(stats.get("num_preemptions", 0)),
        )
        yield CounterMetricFamily(
            "jaxserve_preemption_recomputed_tokens",
            "Computed tokens preempted requests computed again (0 for those swapped to host)",
            value=float(stats.get("preemption_recomputed_tokens", 0)),
        )
        spec_counters = {  # speculative decoding (vLLM's names); exposed as *_total
            "spec_decode_num_drafts": "Sequences verified with drafted tokens",
            "spec_decode_num_draft_tokens": "Drafted tokens verified",
            "spec_decode_num_accepted_tokens": "Drafted tokens accepted",
            "spec_decode_num_disabled_steps": "Schedules without drafts: more decoding than disable_by_batch_size",
        }
        for name, doc in spec_counters.items():
            if name in stats:
                yield CounterMetricFamily(f"jaxserve_{name}", doc, value=float(stats[name]))
        per_position = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_position is not None:
            family = CounterMetricFamily(
                "jaxserve_spec_decode_num_accepted_tokens_per_pos",
                "Drafted tokens accepted, by draft position",
                labels=["position"],
            )
            for position, value in enumerate(per_position):
                family.add_metric([str(position)], float(value))
            yield family
        host_tier = {  # cache.kv_offloading_size (paged_kv/tiered_cache.py)
            "host_cache_bytes": (GaugeMetricFamily, "Bytes held by the host-memory tier"),
            "host_cache_hits": (CounterMetricFamily, "Host-tier entries loaded back for a prefix hit"),
            "host_cache_evictions": (CounterMetricFamily, "Host-tier entries dropped for its byte cap"),
            "host_cache_offloads": (CounterMetricFamily, "Evicted pages and checkpoints copied to host memory"),
            "host_cache_load_failures": (CounterMetricFamily, "Host-tier reads that failed (recomputed)"),
            "host_cache_hits_taken": (CounterMetricFamily, "Host hits taken: loaded instead of recomputed"),
            "host_cache_swap_outs": (CounterMetricFamily, "Preempted requests swapped out to host memory"),
            "host_cache_swap_ins": (CounterMetricFamily, "Swapped-out requests resumed with nothing recomputed"),
            "host_cache_swap_fallbacks": (CounterMetricFamily, "Swap records lost (evicted, failed): recomputed"),
            "host_cache_swap_declined": (CounterMetricFamily, "Preemptions recomputed: cheaper than a swap by cost"),
            "host_cache_swapped_requests": (GaugeMetricFamily, "Preempted requests whose state waits on host"),
            "host_cache_recomputes": (CounterMetricFamily, "Host hits recomputed: cheaper than loading by cost"),
            "host_cache_admission_waits": (CounterMetricFamily, "Admissions deferred until a host hit had room"),
            "host_cache_pages_loaded": (CounterMetricFamily, "KV pages loaded from host memory"),
            "host_cache_checkpoints_loaded": (CounterMetricFamily, "GDN checkpoints loaded from host memory"),
            "host_cache_load_batches": (CounterMetricFamily, "Host-to-device load programs dispatched"),
            "host_cache_load_seconds_total": (CounterMetricFamily, "Dispatch time of host-to-device loads"),
            "host_cache_load_seconds_mean": (GaugeMetricFamily, "Mean dispatch time of a host-to-device load"),
            "host_cache_load_seconds_p90": (GaugeMetricFamily, "p90 dispatch time of a host-to-device load"),
        }
        for name, (family, doc) in host_tier.items():
            if name in stats:
                yield family(f"jaxserve_{name}", doc, value=float(stats[name]))
        for name, value in stats.items():  # P/D (runtime/kv_transfer): counters and held pages/slots
            if name.startswith("kv_transfer_"):
                yield GaugeMetricFamily(
                    f"jaxserve_{name}", f"P/D KV transfer: {name[12:].replace('_', ' ')}", value=float(value)
                )


def _usage(stats: dict, kind: str) -> float:
    total = stats.get(f"{kind}_total", 0)
    return 0.0 if not total else 1.0 - stats.get(f"{kind}_free", 0) / total


class ServerMetrics:
    def __init__(self, read_engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(read_engine_stats))
        self.time_to_first_token = Histogram(
            "jaxserve_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "jaxserve_inter_token_latency_seconds",
            "Time between generated tokens of one completion",
            buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "jaxserve_e2e_request_latency_seconds",
            "Time from arrival to the last token of a completion",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "jaxserve_prompt_tokens", "Prompt tokens of admitted completions", registry=self.registry
        )
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Generated tokens", registry=self.registry)
        self.finished_requests = Counter(
            "jaxserve_request_success",
            "Completions finished, by reason (abort: the client went away, an error or a shutdown ended it)",
            ["finished_reason"],
            registry=self.registry,
        )
        self.rejected_requests = Counter(
            "jaxserve_requests_rejected",
            "HTTP requests answered with an error, by status",
            ["status"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int) -> CompletionTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        return CompletionTimer(self)


class CompletionTimer:
    """Latency bookkeeping of one engine request (one choice)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = self.last_token_time = time.monotonic()
        self.num_tokens = 0
        self.finished = False

    def on_output(self, num_tokens: int, finish_reason: str | None) -> None:
        now = time.monotonic()
        new_tokens = num_tokens - self.num_tokens
        if new_tokens > 0:
            if self.num_tokens == 0:
                self.metrics.time_to_first_token.observe(now - self.arrival)
                new_gaps = new_tokens - 1
            else:
                new_gaps = new_tokens
            for _ in range(new_gaps):
                self.metrics.inter_token_latency.observe((now - self.last_token_time) / new_tokens)
            self.metrics.generation_tokens.inc(new_tokens)
            self.num_tokens, self.last_token_time = num_tokens, now
        if finish_reason is not None and not self.finished:
            self.finished = True
            self.metrics.e2e_latency.observe(now - self.arrival)
            self.metrics.finished_requests.labels(finished_reason=finish_reason).inc()

    def on_abandoned(self) -> None:
        """The request ended without a finish from the engine (client gone, error, shutdown)."""
        if not self.finished:
            self.finished = True
            self.metrics.finished_requests.labels(finished_reason="abort").inc()
