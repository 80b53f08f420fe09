"""The server's Prometheus metrics (prometheus-client; one registry per app).

Counters move by exactly what each request's ``usage`` reports:
``mars_tokens_generated_total`` by ``completion_tokens``, the drafted,
accepted and relaxed counters and ``mars_rounds_total`` by
``usage.speculative``.  ``mars_mean_accepted_length`` is a histogram of each
request's τ (tokens per target forward).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .responses import cached_tokens

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

_TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series beside each counter (process-wide)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mars_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.generations = Counter("mars_generations", "Generations run, by outcome (ok, cancelled, error)",
                                   ["outcome"], registry=r)
        self.prompt_tokens = Counter("mars_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.prompt_cached = Counter("mars_prompt_tokens_cached", "Prompt tokens taken from the KV cache",
                                     registry=r)
        self.generated = Counter("mars_tokens_generated", "Tokens generated", registry=r)
        self.drafted = Counter("mars_tokens_drafted", "Draft tokens proposed and verified", registry=r)
        self.accepted = Counter("mars_tokens_accepted", "Draft tokens accepted (relaxed ones included)", registry=r)
        self.relaxed = Counter("mars_tokens_relaxed", "Draft tokens accepted only because of MARS", registry=r)
        self.rounds = Counter("mars_rounds", "Target forwards in decode loops (verify windows)", registry=r)
        self.tau = Histogram("mars_mean_accepted_length", "Per request: tokens per target forward (tau)",
                             buckets=_TAU_BUCKETS, registry=r)
        self.latency = Histogram("mars_request_duration_seconds", "Generation requests: arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("mars_time_to_first_token_seconds", "Generation requests: arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("mars_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("mars_requests_running", "Requests on the engine (up to --parallel)", registry=r)
        self.batch_rows = Gauge("mars_batch_rows", "Rows of the latest target forward (all sequences)", registry=r)
        self.batch_k = Gauge("mars_batch_draft_length", "The latest round's draft length (load-aware)", registry=r)

    def set_load(self, worker) -> None:
        """The gauges of what runs now (a Worker or a BatchWorker)."""
        self.queue_depth.set(worker.waiting)
        self.running.set(worker.n_running)
        sched = getattr(worker, "sched", None)
        if sched is not None:
            self.batch_rows.set(sched.last_rows)
            self.batch_k.set(sched.last_k)

    def observe(self, stats, outcome: str, latency: float | None, ttft: float | None) -> None:
        """One generation's counts (``stats``: its SpecStats; None when it never started)."""
        self.generations.labels(outcome).inc()
        if stats is None:
            return
        self.prompt_tokens.inc(stats.n_prompt)
        self.prompt_cached.inc(cached_tokens(stats))
        self.generated.inc(stats.n_generated)
        self.drafted.inc(stats.n_drafted)
        self.accepted.inc(stats.n_accepted)
        self.relaxed.inc(stats.n_relaxed)
        self.rounds.inc(stats.n_rounds)
        if stats.n_rounds:
            self.tau.observe(stats.mean_accepted_length)
        if latency is not None:
            self.latency.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)
