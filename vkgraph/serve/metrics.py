"""Prometheus metrics of one server (its own registry, so several servers in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..nn.engine import Engine, Event

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("vkgraph_requests", "Requests finished, by route and outcome", ["route", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("vkgraph_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("vkgraph_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("vkgraph_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("vkgraph_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("vkgraph_request_latency_seconds", "From arrival to the last token", buckets=_LATENCY,
                             registry=r)
        self.waiting = Gauge("vkgraph_requests_waiting", "Requests queued in the engine", registry=r)
        self.running = Gauge("vkgraph_requests_running", "Requests decoding", registry=r)
        self.in_flight = Gauge("vkgraph_requests_in_flight", "Requests accepted and not finished", registry=r)
        self.kv_used = Gauge("vkgraph_kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_total = Gauge("vkgraph_kv_blocks_total", "KV cache blocks", registry=r)
        self.prefix_hit_rate = Gauge("vkgraph_prefix_cache_hit_rate",
                                     "Share of prompt tokens found in the prefix cache", registry=r)
        self.prefix_hit_tokens = Gauge("vkgraph_prefix_cache_hit_tokens",
                                       "Prompt tokens found in the prefix cache so far, by the tier they came from",
                                       ["tier"], registry=r)
        self.store_blocks = Gauge("vkgraph_prefix_store_blocks", "KV blocks held below the GPU, by tier", ["tier"],
                                  registry=r)
        self.store_bytes = Gauge("vkgraph_prefix_store_bytes", "Bytes held below the GPU, by tier", ["tier"],
                                 registry=r)
        self.store_spilled = Gauge("vkgraph_prefix_store_spilled_blocks",
                                   "Blocks the GPU prefix cache evicted into the store so far", registry=r)
        self.store_dropped = Gauge("vkgraph_prefix_store_dropped_blocks",
                                   "Disk entries found corrupt or foreign and dropped so far", registry=r)
        self.store_read_bytes = Gauge("vkgraph_prefix_store_read_bytes",
                                      "Bytes of KV blocks found and read below the GPU so far, by tier", ["tier"],
                                      registry=r)
        self.store_read_seconds = Gauge("vkgraph_prefix_store_read_seconds",
                                        "Time spent finding and reading them so far, by tier (disk: files read and "
                                        "digests checked)", ["tier"], registry=r)
        self.preemptions = Gauge("vkgraph_preemptions", "Requests preempted for KV blocks so far", registry=r)
        self.step_seconds = Histogram("vkgraph_engine_step_seconds", "One engine step", buckets=_LATENCY, registry=r)

    def on_step(self, engine: Engine, events: list[Event], seconds: float | None) -> None:
        """Called on the engine thread after each step (and, with seconds None, after requests came or went)."""
        kv = engine.kv
        if seconds is not None:
            self.step_seconds.observe(seconds)
        self.waiting.set(len(engine.waiting))
        self.running.set(len(engine.running))
        self.kv_used.set(kv.num_blocks - kv.num_free_blocks)
        self.kv_total.set(kv.num_blocks)
        self.prefix_hit_rate.set(kv.hit_tokens / kv.queried_tokens if kv.queried_tokens else 0.0)
        for tier, n in kv.hit_tokens_by_tier.items():
            self.prefix_hit_tokens.labels(tier).set(n)
        if kv.store is not None:
            for tier, (blocks, size) in kv.store.sizes().items():
                self.store_blocks.labels(tier).set(blocks)
                self.store_bytes.labels(tier).set(size)
            self.store_spilled.set(kv.store.spilled)
            for tier, n in kv.store.fetched.items():
                self.store_read_bytes.labels(tier).set(n)
                self.store_read_seconds.labels(tier).set(kv.store.fetch_s[tier])
            self.store_dropped.set(kv.store.disk.dropped if kv.store.disk is not None else 0)
        self.preemptions.set(engine.stats["preemptions"])
        self.generation_tokens.inc(sum(ev.token is not None for ev in events))

    def render(self) -> bytes:
        return generate_latest(self.registry)
