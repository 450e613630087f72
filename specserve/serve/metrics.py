"""Prometheus metrics of the served model, through Ray's metrics API (``ray.util.metrics``).

Ray exports them from every node's metrics agent with a ``ray_`` prefix (e.g.
``ray_specserve_accepted_tokens_total``); Ray adds the node and worker tags. Each metric here
carries ``model`` and ``lossy`` tags — ``lossy="true"`` marks anything produced by a lossy
acceptance mode (a request's ``speculation.acceptance: typical``, :mod:`specserve.core.verify.typical`),
so exact and lossy runs never mix on a dashboard. Per-request metrics take the request's own
``lossy``; the replica's queue gauges keep the deployment's.

Recorded per request when it finishes (counts and per-request histograms; the budget chosen per
cycle is tagged with the cycle's batch size, as a power-of-two bucket, so a dashboard shows γ
against batch size), at its first token (time to first token), whenever the replica's queue
changes, and, on a batched replica, after every engine step (requests verified together, tokens
committed). Shadow checks (:mod:`specserve.serve.shadow`) count their results as they end; a finished
request's cycles update its drafter's smoothed acceptance by position, budget and measured speedup, and
count drift events (:mod:`specserve.policies.drift`; these are tagged with the deployment's ``lossy``). The
queue gauges read 0 from the moment a replica creates its metrics, so an idle
replica's series are there, at 0, before its first request. Needs a connected Ray: the
Serve deployment creates a :class:`ServeMetrics`; in-process runs pass none. Does not compute
anything that :class:`~specserve.core.stats.RequestStats` does not already hold.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from specserve.core.kv.prefix_cache import CacheStats
from specserve.core.stats import RequestStats

TAGS = ("model", "lossy")
LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LENGTH_BOUNDARIES = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]
RATE_BOUNDARIES = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0]
BATCH_BOUNDARIES = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
STEP_TOKEN_BOUNDARIES = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0]


def batch_bucket(size: int) -> str:
    """A batch size as a small set of tag values: ``1``, ``2``, ``3-4``, ``5-8``, ``9-16``, ..."""
    if size <= 2:
        return str(max(size, 1))
    upper = 1 << (size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


class ServeMetrics:
    def __init__(self, model: str, lossy: bool = False) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = {"model": model, "lossy": "true" if lossy else "false"}
        self.requests = Counter(
            "specserve_requests", "requests finished, by finish reason (stop, length, cancelled, error)",
            (*TAGS, "finish_reason"),
        )  # fmt: skip
        self.generated_tokens = Counter("specserve_generated_tokens", "tokens delivered to clients", TAGS)
        self.drafts = Counter("specserve_drafts", "draft proposals verified (cycles that drafted >= 1 token)", TAGS)
        self.draft_tokens = Counter("specserve_draft_tokens", "draft tokens proposed to the target", TAGS)
        self.accepted_tokens = Counter("specserve_accepted_tokens", "draft tokens the target accepted", TAGS)
        self.reached_by_position = Counter(
            "specserve_reached_by_position",
            "cycles whose draft reached position i with every earlier token accepted",
            (*TAGS, "position"),
        )
        self.accepted_by_position = Counter(
            "specserve_accepted_by_position",
            "cycles that accepted draft position i; divide by reached_by_position for acceptance per position",
            (*TAGS, "position"),
        )
        self.mean_accepted_length = Histogram(
            "specserve_mean_accepted_length",
            "per request: mean tokens committed per target pass (accepted drafts + 1)",
            LENGTH_BOUNDARIES,
            TAGS,
        )
        self.gamma = Histogram(
            "specserve_gamma",
            "the budget the request's policy chose per cycle (gamma, or a tree's nodes; 0 = plain decoding), by the "
            "cycle's batch size (requests verified together: 1, 2, 3-4, 5-8, ...)",
            LENGTH_BOUNDARIES,
            (*TAGS, "batch_size"),
        )
        self.batch_size = Histogram(
            "specserve_batch_size",
            "batched replicas: requests verified together per engine step",
            BATCH_BOUNDARIES,
            TAGS,
        )
        self.tokens_per_step = Histogram(
            "specserve_tokens_per_step",
            "batched replicas: tokens committed per engine step, over all its requests",
            STEP_TOKEN_BOUNDARIES,
            TAGS,
        )
        self.tokens_per_second = Histogram(
            "specserve_tokens_per_second", "per request: generated tokens / generation time", RATE_BOUNDARIES, TAGS
        )
        self.time_to_first_token = Histogram(
            "specserve_time_to_first_token_seconds",
            "from the replica receiving a request (queue wait included) to its first token",
            LATENCY_BOUNDARIES,
            TAGS,
        )
        self.queue_length = Gauge(
            "specserve_queue_length", "requests waiting in this replica to generate (batched: for a KV slot)", TAGS
        )
        self.running = Gauge("specserve_running_requests", "requests this replica is generating right now", TAGS)
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens", "prompt tokens of finished requests (all but each prompt's last are cacheable)",
            TAGS,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "specserve_prefix_cache_hit_tokens",
            "prompt tokens whose KV came from the prefix cache instead of a prefill (hit rate: divide by "
            "specserve_prompt_tokens)",
            TAGS,
        )
        self.cache_evictions = Counter(
            "specserve_prefix_cache_evictions", "prefix-cache entries evicted to make room in the KV pool", TAGS
        )
        self.cache_tokens = Gauge(
            "specserve_prefix_cache_tokens", "KV pool positions the prefix cache holds (free to evict)", TAGS
        )
        self.inter_token_latency = Histogram(
            "specserve_inter_token_latency_seconds",
            "seconds between a request's consecutive chunks, per token of the later chunk (a chunk of k tokens "
            "after t seconds observes t / k)",
            LATENCY_BOUNDARIES,
            TAGS,
        )
        # exactness and payoff, watched on live traffic (specserve.serve.shadow, specserve.policies.drift)
        self.shadow_checks = Counter(
            "specserve_shadow_checks",
            "finished requests decoded again without speculation and compared token for token: match, mismatch "
            "(a divergence no float rounding explains), near_tie (the target's two best scores at the divergence were "
            "within its dtype's rounding), skipped (not reproducible by plain decoding, or never run: see "
            "specserve_shadow_skipped)",
            (*TAGS, "drafter", "result"),
        )
        self.shadow_skipped = Counter(
            "specserve_shadow_skipped",
            "shadow checks not made, by reason: sampled (rejection-sampled, reproducible only with "
            "drafter_invariant), lossy (a lossy acceptance rule), dropped (the bounded queue was full), preempted "
            "(live requests interrupted its plain run too often), failed (the plain run ended in an error)",
            (*TAGS, "drafter", "reason"),
        )
        self.shadow_queue = Gauge(
            "specserve_shadow_queue_length", "shadow checks waiting for the replica to be idle", TAGS
        )  # fmt: skip
        self.acceptance_rate = Gauge(
            "specserve_acceptance_rate",
            "acceptance of draft position i given every earlier one was accepted: an exponentially weighted average "
            "over the replica's recent cycles, per drafter",
            (*TAGS, "drafter", "position"),
        )
        self.drift_events = Counter(
            "specserve_acceptance_drift_events",
            "change points in a drafter's acceptance at a position (a CUSUM test against the replica's own history), "
            "by direction (down: the drafter got worse)",
            (*TAGS, "drafter", "position", "direction"),
        )
        self.speedup = Gauge(
            "specserve_speculation_speedup",
            "tokens per second now over plain decoding's, from the replica's own measured costs (a drafting cycle's "
            "time and tokens against a plain step's time); below 1: speculation is not paying",
            (*TAGS, "drafter"),
        )
        self.draft_budget = Gauge(
            "specserve_draft_budget",
            "the draft budget (gamma, or a tree's nodes) the policy chose per cycle, smoothed over the replica's "
            "recent cycles, per drafter: an adaptive policy lowers it when acceptance falls",
            (*TAGS, "drafter"),
        )
        self.policy_events = Counter(
            "specserve_policy_events",
            "the adaptive policy's measured ceiling on draft depth, per drafter: closed (drafts of some depth "
            "measured slower than shorter ones or plain decoding), reopened (a trial after the back-off paid), and "
            "among them fallback (no depth left open: plain decoding) and return (reopened from it)",
            (*TAGS, "drafter", "event"),
        )
        self._evictions = 0
        self._cache_lock = threading.Lock()
        self.queue(0, 0)  # idle: exported at 0 from the start, not missing until the first request
        self.shadow_waiting(0)

    def queue(self, waiting: int, running: int) -> None:
        self.queue_length.set(waiting, self.tags)
        self.running.set(running, self.tags)

    def step(self, batch_size: int, tokens: int) -> None:
        """One step of a batched replica's engine: ``batch_size`` requests verified, ``tokens`` committed."""
        self.batch_size.observe(batch_size, self.tags)
        self.tokens_per_step.observe(tokens, self.tags)

    def prefix_cache(self, stats: CacheStats) -> None:
        """The prefix cache now (after a step, or a distributed replica's request): its evictions since the last call,
        the positions it holds. Callers on several threads may report at once."""
        with self._cache_lock:
            _inc(self.cache_evictions, max(0, stats.evictions - self._evictions), self.tags)
            self._evictions = max(self._evictions, stats.evictions)
            self.cache_tokens.set(stats.retained_tokens, self.tags)

    def inter_token(self, seconds: float, tokens: int, lossy: bool = False) -> None:
        """A chunk of ``tokens`` tokens arrived ``seconds`` after the request's previous one."""
        if tokens > 0:
            self.inter_token_latency.observe(seconds / tokens, self.request_tags(lossy))

    def shadow_check(self, drafter: str, result: str, lossy: bool = False) -> None:
        """One shadow check's outcome: ``match``, ``mismatch``, ``near_tie`` or ``skipped``."""
        self.shadow_checks.inc(1, {**self.request_tags(lossy), "drafter": drafter, "result": result})

    def shadow_skip(self, drafter: str, reason: str, lossy: bool = False) -> None:
        """A shadow check not made (counted as ``result="skipped"`` too), and why."""
        self.shadow_check(drafter, "skipped", lossy)
        self.shadow_skipped.inc(1, {**self.request_tags(lossy), "drafter": drafter, "reason": reason})

    def shadow_waiting(self, jobs: int) -> None:
        self.shadow_queue.set(jobs, self.tags)

    def acceptance(
        self, drafter: str, rates: Sequence[float | None], budget: float | None, speedup: float | None
    ) -> None:
        """A drafter's smoothed acceptance by position (``None``: not measured yet), its smoothed budget, and its
        measured speedup (:class:`~specserve.policies.drift.DriftMonitor`)."""
        tags = {**self.tags, "drafter": drafter}
        for position, rate in enumerate(rates):
            if rate is not None:
                self.acceptance_rate.set(rate, {**tags, "position": str(position)})
        if budget is not None:
            self.draft_budget.set(budget, tags)
        if speedup is not None:
            self.speedup.set(speedup, tags)

    def policy(self, drafter: str, report: dict[str, Any]) -> None:
        """A finished request's schedule report (``stats.policy``): the ceiling's moves it saw."""
        tags = {**self.tags, "drafter": drafter}
        for event, key in (
            ("closed", "closed"),
            ("reopened", "reopened"),
            ("fallback", "fallbacks"),
            ("return", "returns"),
        ):
            _inc(self.policy_events, int(report.get(key, 0)), {**tags, "event": event})

    def drift(self, drafter: str, position: int, direction: str) -> None:
        self.drift_events.inc(1, {**self.tags, "drafter": drafter, "position": str(position), "direction": direction})

    def request_tags(self, lossy: bool) -> dict[str, str]:
        """The tags of one request's metrics: ``lossy="true"`` when it ran a lossy acceptance rule."""
        return {**self.tags, "lossy": "true"} if lossy else self.tags

    def first_token(self, seconds: float, lossy: bool = False) -> None:
        self.time_to_first_token.observe(seconds, self.request_tags(lossy))

    def finished(self, finish_reason: str, stats: RequestStats | None, lossy: bool = False) -> None:
        """One request ended; ``stats`` is ``None`` when it ended without a result (cancelled, failed)."""
        tags = self.request_tags(lossy)
        self.requests.inc(1, {**tags, "finish_reason": finish_reason})
        if stats is None:
            return
        drafts = sum(count for length, count in stats.draft_length_histogram.items() if length > 0)
        _inc(self.generated_tokens, stats.new_tokens, tags)
        _inc(self.prompt_tokens, stats.prompt_tokens, tags)
        _inc(self.cached_tokens, stats.cached_tokens, tags)
        _inc(self.drafts, drafts, tags)
        _inc(self.draft_tokens, stats.drafted_tokens, tags)
        _inc(self.accepted_tokens, stats.accepted_tokens, tags)
        for position, (reached, accepted) in enumerate(zip(stats.reached, stats.accepted, strict=True)):
            _inc(self.reached_by_position, reached, {**tags, "position": str(position)})
            _inc(self.accepted_by_position, accepted, {**tags, "position": str(position)})
        if stats.cycles:
            self.mean_accepted_length.observe(stats.mean_accepted, tags)
        sizes = [o.batch_size for o in stats.observations]
        if len(sizes) != len(stats.budgets):  # a runner that recorded budgets without observations ran alone
            sizes = [1] * len(stats.budgets)
        for budget, size in zip(stats.budgets, sizes, strict=True):
            self.gamma.observe(budget, {**tags, "batch_size": batch_bucket(size)})
        if stats.total_seconds > 0:
            self.tokens_per_second.observe(stats.tokens_per_second, tags)


def _inc(counter: Any, value: float, tags: dict[str, str]) -> None:
    if value > 0:  # Ray's Counter refuses increments <= 0
        counter.inc(value, tags)
