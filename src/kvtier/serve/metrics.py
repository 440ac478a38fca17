"""Prometheus metrics of the server, in a registry of its own (no global registry).

Gauges and counters of the engine's state are read at scrape time from the
engine's last :meth:`~kvtier.serve.engine.LLMEngine.stats` snapshot; per-request
latencies are observed as requests finish.

========================================== ========= ==============================================
name                                       type      meaning
========================================== ========= ==============================================
``kvtier_requests_running``                gauge     requests holding blocks and stepping
``kvtier_requests_waiting``                gauge     requests queued for admission
``kvtier_kv_blocks_total``                 gauge     blocks of the pool
``kvtier_kv_blocks_free``                  gauge     blocks free or cached-and-unreferenced
``kvtier_kv_blocks_cached``                gauge     blocks holding a hashed prefix
``kvtier_prefix_cache_queries_total``      counter   prompt tokens of admitted requests
``kvtier_prefix_cache_hits_total``         counter   of those, tokens found in the prefix cache
``kvtier_prefix_cache_hit_rate``           gauge     hits / queries
``kvtier_preemptions_total``               counter   requests preempted (freed, recomputed later)
``kvtier_kv_blocks_released_total``        counter   blocks released behind a sliding window
``kvtier_prompt_tokens_total``             counter   prompt tokens of accepted requests
``kvtier_generation_tokens_total``         counter   tokens generated
``kvtier_requests_finished_total``         counter   finished requests, by ``finish_reason`` (``abort``: ended early)
``kvtier_requests_rejected_total``         counter   refused requests, by HTTP ``status``
``kvtier_time_to_first_token_seconds``     histogram arrival to first token
``kvtier_time_per_output_token_seconds``   histogram (finish - first token) / (tokens - 1)
``kvtier_e2e_request_latency_seconds``     histogram arrival to finish
``kvtier_prefix_file_saves_total``         counter   periodic saves of the prefix cache file (``--prefix-cache-save-interval``)
``kvtier_prefix_file_save_failures_total`` counter   of those, tries that failed
``kvtier_prefix_file_last_save_seconds``   gauge     the last save's time, begun to renamed
``kvtier_prefix_file_last_pause_seconds``  gauge     the engine's pause in it, between two steps
``kvtier_prefix_file_blocks``              gauge     blocks the file held after it
========================================== ========= ==============================================
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.serve.params import RequestOutput

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector:
    """The engine's stats snapshot as gauges and counters, read at scrape time."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, key, text in (
            ("kvtier_requests_running", "running", "Requests holding blocks and stepping."),
            ("kvtier_requests_waiting", "waiting", "Requests queued for admission."),
            ("kvtier_kv_blocks_total", "num_blocks", "Blocks of the KV pool."),
            ("kvtier_kv_blocks_free", "free_blocks", "Blocks free, or cached and unreferenced."),
            ("kvtier_kv_blocks_cached", "cached_blocks", "Blocks holding a hashed prefix."),
            ("kvtier_prefix_cache_hit_rate", "prefix_hit_rate", "Prefix cache hits / queries (tokens)."),
        ):
            yield GaugeMetricFamily(name, text, value=s[key])
        for name, key, text in (
            ("kvtier_prefix_cache_queries", "prefix_queries", "Prompt tokens of admitted requests."),
            ("kvtier_prefix_cache_hits", "prefix_hits", "Prompt tokens found in the prefix cache."),
            ("kvtier_preemptions", "preemptions", "Requests preempted and recomputed later."),
            ("kvtier_kv_blocks_released", "released_blocks", "Blocks released behind a sliding window."),
            ("kvtier_prompt_tokens", "prompt_tokens", "Prompt tokens of accepted requests."),
        ):
            yield CounterMetricFamily(name, text, value=s[key])
        if "spec_drafts" in s:  # a server started with --speculative-config
            for name, key, text in (
                ("kvtier_spec_decode_num_drafts", "spec_drafts", "Decode rows that fed drafts."),
                ("kvtier_spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens fed."),
                ("kvtier_spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens kept."),
            ):
                yield CounterMetricFamily(name, text, value=s[key])
            yield GaugeMetricFamily("kvtier_spec_decode_acceptance_rate", "Draft tokens kept / fed.",
                                    value=s["spec_acceptance_rate"])
        if s.get("host_blocks"):  # a server started with --kv-offload-memory
            yield GaugeMetricFamily("kvtier_kv_host_blocks_total", "Slots of the host tier.", value=s["host_blocks"])
            yield GaugeMetricFamily("kvtier_kv_host_blocks_cached", "Host slots holding an offloaded block.",
                                    value=s["host_cached_blocks"])
            for name, key, text in (
                ("kvtier_kv_offload_hits", "host_hits", "Prompt tokens loaded from the host tier."),
                ("kvtier_kv_offload_blocks_saved", "blocks_saved", "Blocks saved to the host tier."),
                ("kvtier_kv_offload_blocks_loaded", "blocks_loaded", "Blocks loaded from the host tier."),
            ):
                yield CounterMetricFamily(name, text, value=s[key])
        if "prefix_file_saves" in s:  # a server started with --prefix-cache-save-interval
            yield CounterMetricFamily("kvtier_prefix_file_saves", "Periodic saves of the prefix cache file.",
                                      value=s["prefix_file_saves"])
            yield CounterMetricFamily("kvtier_prefix_file_save_failures", "Periodic saves that failed.",
                                      value=s["prefix_file_save_failures"])
            for name, key, text in (
                ("kvtier_prefix_file_last_save_seconds", "prefix_file_last_save_seconds", "The last save's time."),
                ("kvtier_prefix_file_last_pause_seconds", "prefix_file_last_pause_seconds",
                 "The engine's pause in the last save."),
                ("kvtier_prefix_file_blocks", "prefix_file_blocks", "Blocks the file held after the last save."),
            ):
                if key in s:
                    yield GaugeMetricFamily(name, text, value=s[key])


class ServerMetrics:
    """The server's metrics over ``stats`` (a callable returning the engine's stats dict)."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.generation_tokens = Counter("kvtier_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("kvtier_requests_finished", "Finished requests.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("kvtier_requests_rejected", "Refused requests, by HTTP status.",
                                ["status"], registry=r)
        self.ttft = Histogram("kvtier_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvtier_time_per_output_token_seconds",
                              "Time per output token after the first.", buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("kvtier_e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def observe(self, out: RequestOutput) -> None:
        """Count one engine output; a finished one adds its latencies."""
        self.generation_tokens.inc(len(out.token_ids))
        if out.completion_tokens == len(out.token_ids) and out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
        if not out.finished:
            return
        self.finished.labels(out.finish_reason).inc()
        self.e2e.observe(out.finish_time - out.arrival_time)
        if out.completion_tokens > 1:
            self.tpot.observe((out.finish_time - out.first_token_time) / (out.completion_tokens - 1))

    def aborted(self) -> None:
        """Count a request that ended before it finished (``finish_reason`` ``abort``)."""
        self.finished.labels("abort").inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
