"""Prometheus metrics of the teacher (served at GET /metrics).

Per-session series carry the labels `session` and `job` and are removed when the
session ends, so a long-running teacher does not accumulate series. A job's share of
the teacher is `sum by (job) (rate(teacher_tokens_total[1m]))`.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SESSION_LABELS = ("session", "job")


class BusyClock:
    """Fraction of wall time spent in forward over the last `window_s` seconds.

    A forward still running when read counts up to now (`begin` marks it), so a
    teacher busy with one long forward does not read as idle. Before `window_s`
    have passed since start, the window is the time since start.
    """

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()
        self._running: float | None = None  # start of the forward in progress
        self._started = time.monotonic()

    def begin(self, start: float) -> None:
        self._running = start

    def add(self, start: float, end: float) -> None:
        self._spans.append((start, end))
        self._running = None
        horizon = end - self.window_s
        while self._spans and self._spans[0][1] < horizon:
            self._spans.popleft()

    def fraction(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        window_start = max(now - self.window_s, self._started)
        if now <= window_start:
            return 0.0
        spans = list(self._spans)  # a copy: the engine thread appends meanwhile
        running = self._running
        if running is not None:
            spans.append((running, now))
        busy = sum(max(0.0, min(end, now) - max(start, window_start)) for start, end in spans)
        return min(1.0, busy / (now - window_start))


class _CacheCollector:
    """Exports the shared-work cache's own counters (one source of truth: its stats)."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        s = self.cache.stats()
        for name, doc, value in (
                ("teacher_cache_hits", "Batches served from the output cache, without a forward", s.hits),
                ("teacher_cache_misses", "Batches computed while the output cache was on", s.misses),
                ("teacher_cache_evictions", "Cache entries evicted to stay within --cache-bytes", s.evictions),
                ("teacher_shared_batches", "Batches served by an identical batch of the same forward",
                 s.shared_in_forward)):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("teacher_cache_bytes", "Bytes of outputs held by the cache (on the teacher device)", s.bytes),
                ("teacher_cache_entries", "Batches held by the cache", s.entries),
                ("teacher_cache_capacity_bytes", "--cache-bytes (0: cache off)", s.capacity_bytes)):
            yield GaugeMetricFamily(name, doc, value=value)


class _ExpertLoadCollector:
    """Exports the MoE layers' expert load (teacher_server/moe.py's ExpertLoad), read at each scrape."""

    def __init__(self, load):
        self.load = load

    def collect(self):
        from teacher_server.moe import imbalance

        snapshot = self.load.snapshot()
        tokens = CounterMetricFamily("teacher_expert_tokens", "Tokens routed to each expert of each MoE layer since "
                                     "start-up (padding included)", labels=["layer", "expert"])
        last = GaugeMetricFamily("teacher_expert_imbalance", "Tokens of an MoE layer's busiest expert over the mean "
                                 "per expert, in the last forward (1: even routing)", labels=["layer"])
        for layer, (counts, recent) in enumerate(zip(snapshot.total, snapshot.last)):
            for expert, count in enumerate(counts):
                tokens.add_metric([str(layer), str(expert)], count)
            last.add_metric([str(layer)], imbalance(recent))
        yield tokens
        yield last


class Metrics:
    def __init__(self, device: torch.device | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_connected = Gauge("teacher_sessions_connected", "Sessions joined and not yet ended", registry=r)
        self.sessions_joined = Counter("teacher_sessions_joined_total", "Sessions admitted at Join", registry=r)
        self.sessions_ended = Counter("teacher_sessions_ended_total", "Sessions ended, by reason", ["reason"], registry=r)
        self.batches = Counter("teacher_batches_total", "Batches whose outputs were sent", SESSION_LABELS, registry=r)
        self.batches_failed = Counter("teacher_batches_failed_total", "Batches the teacher could not serve (a "
                                      "forward, deriving or keeping their outputs failed; the log says why)",
                                      registry=r)
        self.tokens = Counter("teacher_tokens_total", "Tokens (rows x length) served", SESSION_LABELS, registry=r)
        self.bytes_sent = Counter("teacher_bytes_sent_total", "Bytes of outputs sent", SESSION_LABELS, registry=r)
        self.inflight = Gauge("teacher_inflight_batches", "Batches submitted and not yet sent", SESSION_LABELS,
                              registry=r)
        # What a real group formation takes here, against --join-timeout-s (which ends a session still connecting).
        self.session_connect_seconds = Histogram(
            "teacher_session_connect_seconds", "Time from a session's Join to its process group formed", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0))
        self.queue_depth = Gauge("teacher_queue_depth", "Batches waiting for a forward, all sessions", registry=r)
        self.forward_seconds = Histogram(
            "teacher_forward_seconds", "Time of one packed forward (outputs ready on the device)", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.forward_tokens = Counter("teacher_forward_tokens_total", "Tokens run through forward, padding included",
                                      registry=r)
        self.busy_seconds = Counter("teacher_busy_seconds_total", "Seconds spent in forward", registry=r)
        self.busy_clock = BusyClock()
        self.busy_fraction = Gauge("teacher_busy_fraction", "Time in forward over wall time, last 10 s (a forward "
                                   "in progress counts)", registry=r)
        self.busy_fraction.set_function(self.busy_clock.fraction)
        self.rpc_errors = Counter("teacher_rpc_errors_total", "RPCs answered with an error", ["method", "code"],
                                  registry=r)
        self.gpu_memory_allocated = Gauge("teacher_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated",
                                          registry=r)
        self.gpu_memory_reserved = Gauge("teacher_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved",
                                         registry=r)
        # Peaks since start-up: what the device must hold at worst, which a scrape of the current
        # figures miss between two scrapes (bench/recipe_served.py and eagle3_served.py read them).
        self.gpu_memory_peak_allocated = Gauge("teacher_gpu_memory_peak_allocated_bytes",
                                               "torch.cuda.max_memory_allocated since start-up", registry=r)
        self.gpu_memory_peak_reserved = Gauge("teacher_gpu_memory_peak_reserved_bytes",
                                              "torch.cuda.max_memory_reserved since start-up", registry=r)
        if device is not None and device.type == "cuda":
            self.gpu_memory_allocated.set_function(lambda: torch.cuda.memory_allocated(device))
            self.gpu_memory_reserved.set_function(lambda: torch.cuda.memory_reserved(device))
            self.gpu_memory_peak_allocated.set_function(lambda: torch.cuda.max_memory_allocated(device))
            self.gpu_memory_peak_reserved.set_function(lambda: torch.cuda.max_memory_reserved(device))

    def watch_cache(self, cache) -> None:
        """Exports the cache's counters and gauges (teacher_cache_*, teacher_shared_batches_total)."""
        self.registry.register(_CacheCollector(cache))

    def watch_experts(self, load) -> None:
        """Exports an MoE teacher's tokens per expert per layer (teacher_expert_tokens_total) and each
        layer's imbalance in the last forward (teacher_expert_imbalance)."""
        self.registry.register(_ExpertLoadCollector(load))

    def watch_answers(self, budget) -> None:
        """Exports the OpenAI API's answer memory (teacher_server/openai/budget.py): bytes held, the
        limit, and requests waiting for room."""
        r = self.registry
        Gauge("teacher_api_answer_bytes", "Bytes POST /v1/completions requests in flight are charged for their "
              "answers", registry=r).set_function(lambda: budget.held)
        Gauge("teacher_api_answer_limit_bytes", "--api-max-answer-bytes (or its derived default)",
              registry=r).set_function(lambda: budget.limit)
        Gauge("teacher_api_requests_waiting", "POST /v1/completions requests waiting for answer memory",
              registry=r).set_function(lambda: budget.waiting)

    def forward_started(self, start: float) -> None:
        self.busy_clock.begin(start)

    def forward_failed(self, start: float, end: float) -> None:
        self.busy_clock.add(start, end)  # busy all the same; nothing was produced

    def record_forward(self, start: float, end: float, tokens: int) -> None:
        self.forward_seconds.observe(end - start)
        self.forward_tokens.inc(tokens)
        self.busy_seconds.inc(end - start)
        self.busy_clock.add(start, end)

    def forget_session(self, session_id: str, job: str) -> None:
        for metric in (self.batches, self.tokens, self.bytes_sent, self.inflight):
            try:
                metric.remove(session_id, job)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
