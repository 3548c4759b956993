"""/metrics: a Prometheus collector that reads the cache's counters (`model.telemetry()`) and the
server's request counters at scrape time. The cache counts from its creation and a resize keeps
the counts, so every `_total` series only grows."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ..telemetry import OP_COUNTERS
from .slots import Scheduler

PREFIX = "expertcache"

_HELP = {
    "ops_seen": "MoE ops processed",
    "used_experts_unique": "distinct experts used, summed over MoE ops",
    "loaded_experts_before": "experts of the layer resident when an op began, summed over ops",
    "resident_hits": "used experts that were resident",
    "resident_misses": "used experts that were not resident",
    "copied_experts": "experts copied into the cache",
    "copied_bytes": "bytes copied into the cache",
    "copy_ranges": "transfers issued (runs of contiguous experts are one transfer)",
    "skipped_experts": "copies avoided because the expert was resident",
    "skipped_bytes": "bytes of copies avoided because the expert was resident",
    "empty_copy_ops": "MoE ops that copied nothing",
    "evictions": "experts evicted from the cache",
    "waves": "passes MoE ops ran in: one per op, more for an op needing more experts than the cache has slots",
    "demand_misses": "used experts neither resident nor prefetched when their op began",
    "prefetch_issued": "experts a prefetch planned to copy",
    "prefetch_used": "prefetched experts an op used before they were evicted",
    "prefetch_wasted": "prefetched experts evicted before any op used them",
}


class ServerCollector(Collector):
    def __init__(self, model, scheduler: Scheduler):
        self.model, self.scheduler = model, scheduler

    def collect(self):
        # Read while the worker runs ops (`Telemetry.total` copies what it iterates). Never an
        # empty stand-in: counters read as 0 would tell Prometheus that every one of them reset.
        t = self.model.telemetry()
        layers = t.get("layers", {})
        for name in OP_COUNTERS:
            m = CounterMetricFamily(f"{PREFIX}_cache_{name}", _HELP.get(name, name), labels=["layer"])
            for layer, counters in layers.items():
                m.add_metric([str(layer)], counters.get(name, 0))
            yield m
        m = CounterMetricFamily(f"{PREFIX}_cache_invalidations", "cache slots invalidated, by reason",
                                labels=["reason"])
        for reason, n in t.get("invalidations", {}).items():
            m.add_metric([reason], n)
        yield m
        for name, doc in (("pre_invalid_loaded", "slots resident when an invalidation cleared them"),
                          ("pre_invalid_hit", "cleared slots that the next op would have hit"),
                          ("load_copied_experts", "experts copied while loading or resizing"),
                          ("load_copied_bytes", "bytes copied while loading or resizing"),
                          ("copy_failures", "copies from the slow tier that failed (their slots left empty)"),
                          ("copy_seconds", "seconds spent in the copies of MoE ops (on a GPU: issuing them)"),
                          ("stall_seconds", "seconds compute waited for expert copies (its own or prefetches)"),
                          ("prefetch_copy_seconds", "seconds the prefetch worker spent copying"),
                          ("prefetch_dropped_bytes", "bytes of planned prefetch copies never made (counted in "
                                                     "copied_bytes; the expert lost its slot first)")):
            yield CounterMetricFamily(f"{PREFIX}_cache_{name}", doc, value=t.get(name, 0))
        yield GaugeMetricFamily(f"{PREFIX}_cache_prefetch_active", "1 when predicted experts are copied early",
                                value=1 if t.get("prefetch") else 0)
        total = t.get("total", {})
        yield GaugeMetricFamily(f"{PREFIX}_cache_hit_rate", "resident hits / used experts since start",
                                value=total.get("hit_rate", 0.0))
        for name, doc in (("capacity", "cache slots, in experts"), ("total_experts", "experts in the model"),
                          ("expert_bytes", "bytes of one expert"), ("pool_bytes", "bytes of the slot pool")):
            yield GaugeMetricFamily(f"{PREFIX}_cache_{name}", doc, value=t.get(name, 0))
        info = GaugeMetricFamily(f"{PREFIX}_cache_info", "cache mode, policy and slow tier",
                                 labels=["mode", "policy", "store"])
        info.add_metric([str(t.get("mode", "")), str(t.get("policy", "")), str(t.get("store", ""))], 1)
        yield info

        p = self.model.prefill_total
        yield CounterMetricFamily(f"{PREFIX}_prefill_bytes_read", "expert bytes read from the slow tier while "
                                  "processing prompts", value=p.bytes_read)
        yield GaugeMetricFamily(f"{PREFIX}_prefill_bytes_read_per_token", "expert bytes read from the slow tier "
                                "per prompt token processed, since start", value=p.bytes_per_token)
        yield GaugeMetricFamily(f"{PREFIX}_prefill_stretch", "tokens the MoE ops of a long prompt run over "
                                "per load of each expert", value=self.model.stretch)
        yield GaugeMetricFamily(f"{PREFIX}_prefill_workspace_bytes", "bytes of the MoE op buffers kept "
                                "for prompt processing", value=self.model.net.workspace.nbytes)

        s = self.scheduler.snapshot()
        for name, doc, value in (
            ("requests", "requests the worker took (including aborted and failed ones)", s.requests),
            ("requests_aborted", "requests whose client left before the end", s.aborted),
            ("requests_failed", "requests that failed inside the engine", s.errors),
            ("prompt_tokens", "prompt tokens processed (not reused from the prompt cache)", s.prompt_tokens),
            ("prompt_cached_tokens", "prompt tokens reused from a slot's KV state", s.cached_tokens),
            ("tokens_predicted", "tokens generated", s.predicted_tokens),
            ("prompt_seconds", "seconds spent processing prompts", s.prompt_seconds),
            ("tokens_predicted_seconds", "seconds spent generating", s.predicted_seconds),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield GaugeMetricFamily(f"{PREFIX}_prompt_tokens_per_second", "average prompt throughput since start",
                                value=s.prompt_tokens / s.prompt_seconds if s.prompt_seconds else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}_predicted_tokens_per_second", "average generation throughput since start",
                                value=s.predicted_tokens / s.predicted_seconds if s.predicted_seconds else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}_requests_processing", "requests running now", value=s.processing)
        yield GaugeMetricFamily(f"{PREFIX}_requests_deferred", "requests waiting for the worker", value=s.deferred)
        # Recurrent state (Qwen3.5's DeltaNet) and sliding-window rings (Gemma 4) cannot be cut
        # back to a prefix: sessions keep snapshots to restore from, bounded in number; their
        # memory shows here.
        # Each slot's session is read once: the worker drops a failed request's session meanwhile.
        sessions = [slot.session for slot in self.scheduler.slots]
        kept = [session.kv for session in sessions if session is not None]
        yield GaugeMetricFamily(f"{PREFIX}_state_snapshots", "state snapshots the slots keep (recurrent state, sliding-window rings)",
                                value=sum(len(getattr(kv, "snapshots", ())) for kv in kept))
        yield GaugeMetricFamily(f"{PREFIX}_state_snapshot_bytes", "bytes of the state snapshots the slots keep (recurrent state, sliding-window rings)",
                                value=sum(kv.snapshot_bytes() for kv in kept))


class QueueCollector(Collector):
    """The queue's bound (`--max-queue`) and the requests refused at it, beside the
    `requests_deferred` gauge that approaches the bound."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        yield GaugeMetricFamily(f"{PREFIX}_requests_deferred_limit", "requests that may wait for the worker "
                                "(--max-queue); more are refused with 503", value=self.scheduler.max_queue)
        yield CounterMetricFamily(f"{PREFIX}_requests_refused", "requests refused with 503 because the queue "
                                  "was full (not counted in requests_total)", value=self.scheduler.snapshot().refused)


def make_registry(model, scheduler: Scheduler) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(model, scheduler))
    registry.register(QueueCollector(scheduler))
    return registry
