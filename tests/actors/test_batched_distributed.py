"""Batched distributed replicas: rank 0 verifies its running requests' drafts together, the drafter runs their loops.

Requests run concurrently through one :class:`~specserve.actors.coordinator.Coordinator` of a replica with
``max_num_seqs = 4`` — TP 1 and TP 2, a draft model co-located or on a separate drafter, with and without
overlap. The KV pool holds only two of the requests at a time (``kv_pool_tokens``), so the others wait for
room, and the spans of those that finish are reused and moved. Every request's output equals the
single-process engine's on that request alone (greedy: also transformers'; seeded sampling without overlap:
the same tokens), the requests really shared steps, and the whole pool is free afterwards on every rank.
Prompts are prefilled 8 tokens at a time, between steps. Without overlap, the drafter actor drafts the
running requests' chains together (its request loops meet in a round), and seeded requests still emit exactly
what they emit alone. A request whose grammar gives up mid-text on rank 0 fails alone (its GrammarFailed), and the
requests verified in the same steps stay exact.
Rank 0's prefix cache serves a repeated prompt and a next turn (prompt and answer) on every rank, exactly, per
namespace; the pool's accounting is checked after clearing it.
Float64 tiny models on a real local Ray cluster; the cases' replicas are spawned at once as the module starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair, cases_in_use
from replicas import Case, config_for, greedy_reference, spawned_at_once

from specserve.actors.coordinator import Coordinator
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import GrammarFailed, RequestFailed
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter_set

pytestmark = pytest.mark.timeout(300)

SLOTS = 4
LONGEST_OUTPUT = 40  # max_new_tokens of the longest request below
CASES = {
    "llama-tp2-model-separate-overlap": Case("llama", 2, "model", "separate", True),
    "qwen2-tp1-model-colocated": Case("qwen2", 1, "model", "colocated", False),
}


@dataclass
class Running:
    case: Case
    pair: TinyPair
    coordinator: Coordinator
    engine: SpeculativeEngine
    kv_tokens: int  # the replica's KV pool


def kv_tokens_of(pair: TinyPair) -> int:
    return 2 * (max(len(p) for p in pair.prompts[:SLOTS]) + LONGEST_OUTPUT)  # two requests at a time


@pytest.fixture(scope="module")
def replicas(
    request: pytest.FixtureRequest, ray_cluster: Any, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> Iterator[Callable[[str], Coordinator]]:
    """The cases' replicas, spawned all at once (they fit the cluster together)."""
    configs = []
    for name in cases_in_use(request, "running"):
        case = CASES[name]
        config = config_for(
            case, saved_pairs[case.family], max_num_seqs=SLOTS, batch_wait_ms=200, max_batch_tokens=8,
            kv_pool_tokens=kv_tokens_of(tiny_pairs[case.family]),
        )  # fmt: skip
        configs.append((name, config))
    with spawned_at_once(configs) as take:
        yield take


@pytest.fixture(scope="module", params=list(CASES))
def running(
    request: pytest.FixtureRequest, replicas: Callable[[str], Coordinator], tiny_pairs: dict[str, TinyPair]
) -> Iterator[Running]:
    case = CASES[request.param]
    pair = tiny_pairs[case.family]
    kv_tokens = kv_tokens_of(pair)
    coordinator = replicas(request.param)
    try:
        engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
        yield Running(case, pair, coordinator, engine, kv_tokens)
    finally:
        coordinator.shutdown()


def concurrently(calls: list[Callable[[], GenerationResult]]) -> list[GenerationResult]:
    """Every call at once, on threads of its own (a replica's callers, as a Serve replica makes them)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def free_kv_tokens(running: Running, timeout_s: float = 30.0) -> list[int]:
    """Every rank's free KV positions once rank 0's prefix cache is cleared and the other ranks have applied the frees
    rank 0 broadcast (a follower applies each command as it reads it, after rank 0 has moved on): polled until every
    rank reports the same, at most ``timeout_s``."""
    import ray

    replica = running.coordinator.replica
    ray.get(replica.rank0.clear_prefix_cache.remote())
    deadline = time.monotonic() + timeout_s
    while True:
        free = list(ray.get([shard.free_kv_tokens.remote() for shard in replica.shards]))
        if len(set(free)) == 1 or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


def settled(running: Running, timeout_s: float = 30.0) -> None:
    """Until rank 0 holds no request (the coordinator ends each with a call it does not wait for)."""
    import ray

    rank0 = running.coordinator.replica.rank0
    deadline = time.monotonic() + timeout_s
    while ray.get(rank0.active_requests.remote()) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_prefixes_come_from_rank_0s_cache_on_every_rank_and_change_nothing(running: Running) -> None:
    """A prompt sent again, and a next turn that resends a prompt and its answer, copy their cached prefix on every
    rank (rank 0 decides, the others mirror the copies) and emit exactly what they emit alone; another namespace
    reuses nothing; clearing the cache frees every rank's pool."""
    import ray

    pair, coordinator = running.pair, running.coordinator
    free_kv_tokens(running)  # start from an empty cache
    prompt = list(pair.length_prompts[0])
    config = GenerationConfig(max_new_tokens=10, gamma=3)
    first = coordinator.generate(prompt, SamplingParams(), config)
    follow = [*prompt, *first.output_ids, *pair.prompts[1]]
    settled(running)  # its KV retained: prompt and answer
    again = coordinator.generate(prompt, SamplingParams(), config)
    turn = coordinator.generate(follow, SamplingParams(temperature=1.0, seed=3), config)
    elsewhere = coordinator.generate(prompt, SamplingParams(), GenerationConfig(10, 3, cache_namespace="other"))
    settled(running)
    assert first.stats.cached_tokens == 0 and elsewhere.stats.cached_tokens == 0
    assert again.stats.cached_tokens == len(prompt) - 1
    assert turn.stats.cached_tokens == len(prompt) + len(first.output_ids) - 1
    reference = greedy_reference(pair, prompt, 10)
    assert first.output_ids == again.output_ids == elsewhere.output_ids == reference
    if not running.case.overlap:  # with overlap the drafter's draws differ from the engine's (as above)
        alone = running.engine.generate(follow, SamplingParams(temperature=1.0, seed=3), config)
        assert turn.output_ids == alone.output_ids
    stats = coordinator.prefix_cache_stats()  # rank 0's, what the replica's status() and /metrics report
    assert stats is not None and stats == ray.get(coordinator.replica.rank0.prefix_cache_stats.remote())
    assert stats["hits"] >= 2 and stats["hit_tokens"] >= again.stats.cached_tokens + turn.stats.cached_tokens
    assert free_kv_tokens(running) == [running.kv_tokens] * running.case.tp


def test_concurrent_requests_share_steps_and_each_equals_itself_alone(running: Running) -> None:
    prompts = [running.pair.prompts[i] for i in range(SLOTS)]
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
    configs = [
        GenerationConfig(max_new_tokens=20, gamma=3),
        GenerationConfig(max_new_tokens=16, gamma=1),
        GenerationConfig(max_new_tokens=20, tree=tree),
        GenerationConfig(max_new_tokens=12, gamma=3, drafter="ngram"),
    ]
    results = concurrently(
        [
            lambda p=p, c=c: running.coordinator.generate(p, SamplingParams(), c)
            for p, c in zip(prompts, configs, strict=True)
        ]
    )
    shared = 0
    for prompt, config, got in zip(prompts, configs, results, strict=True):
        want = running.engine.generate(prompt, SamplingParams(), config)
        assert got.output_ids == want.output_ids == greedy_reference(running.pair, prompt, config.max_new_tokens)
        assert got.text == want.text and got.finish_reason == want.finish_reason
        shared += sum(o.batch_size > 1 for o in got.stats.observations)
    assert shared > 0, "no step verified more than one request"
    assert free_kv_tokens(running) == [running.kv_tokens] * running.case.tp


def test_concurrent_seeded_sampling(running: Running) -> None:
    """Without overlap, each seeded request emits exactly what it emits alone in the engine; with overlap the
    drafter's draws differ from the engine's, so there each must reproduce itself, batched with others."""
    prompts = [running.pair.prompts[i] for i in range(SLOTS)]
    params = [SamplingParams(temperature=1.0, top_k=20, seed=seed) for seed in range(SLOTS)]
    config = GenerationConfig(max_new_tokens=16, gamma=3)
    first = concurrently(
        [lambda p=p, s=s: running.coordinator.generate(p, s, config) for p, s in zip(prompts, params, strict=True)]
    )
    if running.case.overlap:
        again = concurrently(
            [lambda p=p, s=s: running.coordinator.generate(p, s, config) for p, s in zip(prompts, params, strict=True)]
        )
        assert [r.output_ids for r in first] == [r.output_ids for r in again]
    else:
        for prompt, sampling, got in zip(prompts, params, first, strict=True):
            assert got.output_ids == running.engine.generate(prompt, sampling, config).output_ids
        import ray

        rounds = ray.get(running.coordinator.replica.drafter.draft_rounds.remote())
        assert max(rounds) >= 2, rounds  # the drafter drafted these chains together, in shared forwards


def test_an_abandoned_stream_leaves_the_batch_and_frees_its_kv(running: Running) -> None:
    import ray

    stream = running.coordinator.stream(
        running.pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=LONGEST_OUTPUT)
    )
    next(stream)
    other = running.coordinator.generate(running.pair.prompts[1], SamplingParams(), GenerationConfig(max_new_tokens=8))
    assert other.output_ids == greedy_reference(running.pair, running.pair.prompts[1], 8)
    stream.close()
    rank0 = running.coordinator.replica.rank0
    for _ in range(50):
        if not ray.get(rank0.active_requests.remote()):
            break
        time.sleep(0.1)
    assert ray.get(rank0.active_requests.remote()) == []
    assert free_kv_tokens(running) == [running.kv_tokens] * running.case.tp


DOOMED = GrammarSpec("regex", "[a-k]{30,40}")  # longer than the request runs: it cannot end before it fails


def give_up_after(masks: int) -> Callable[[Any], None]:
    """A call for rank 0's process: the matchers it compiles for :data:`DOOMED` from now on give up after ``masks``
    masks, as llguidance's lexer does when a grammar exhausts its budget mid-text (``masks`` < 0: undo)."""

    def patch(_shard: Any) -> None:
        from specserve.core.verify.grammar import GrammarCompiler

        original = getattr(GrammarCompiler, "_unpatched_compile", GrammarCompiler.compile)
        if masks < 0:
            GrammarCompiler.compile = original  # type: ignore[method-assign]
            return

        class GivesUp:
            def __init__(self, matcher: Any) -> None:
                self._matcher, self._left = matcher, masks

            def compute_logit_bias(self) -> Any:
                self._left -= 1
                return self._matcher.compute_logit_bias()

            def is_error(self) -> bool:
                return self._left < 0 or bool(self._matcher.is_error())

            def get_error(self) -> str:
                return "lexer error: too many expressions constructed" if self._left < 0 else self._matcher.get_error()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._matcher, name)

        def compile(self: Any, spec: Any) -> Any:
            grammar = original(self, spec)
            if spec == DOOMED:
                grammar.matcher = GivesUp(grammar.matcher)
            return grammar

        GrammarCompiler._unpatched_compile = original  # type: ignore[attr-defined]
        GrammarCompiler.compile = compile  # type: ignore[method-assign]

    return patch


def fails_alone_beside_three_greedy(running: Running, doomed_params: SamplingParams, doomed: GenerationConfig) -> Any:
    """Runs the doomed request concurrently with three greedy ones on rank 0's batch; asserts the three emit exactly
    what transformers emits alone and that every rank's pool is whole afterwards; returns what the doomed request
    raised (or its result, for the caller's assertion to reject)."""
    import ray

    prompts = [running.pair.prompts[i] for i in range(SLOTS)]
    configs = [GenerationConfig(max_new_tokens=n, gamma=3) for n in (20, 16, 12)]
    calls: list[Callable[[], Any]] = [
        lambda p=p, c=c: running.coordinator.generate(p, SamplingParams(), c)
        for p, c in zip(prompts, configs, strict=False)
    ]

    def doomed_call() -> Any:
        try:
            return running.coordinator.generate(prompts[3], doomed_params, doomed)
        except Exception as exc:
            return exc

    *results, failure = concurrently([*calls, doomed_call])
    for prompt, config, got in zip(prompts, configs, results, strict=False):
        assert got.output_ids == greedy_reference(running.pair, prompt, config.max_new_tokens)
    rank0 = running.coordinator.replica.rank0
    for _ in range(50):
        if not ray.get(rank0.active_requests.remote()):
            break
        time.sleep(0.1)
    assert free_kv_tokens(running) == [running.kv_tokens] * running.case.tp
    return failure


def test_a_request_whose_grammar_gives_up_fails_alone_and_the_others_stay_exact(running: Running) -> None:
    """Rank 0 verifies the doomed request in the same steps as three others; when its grammar gives up mid-text
    (its verifier's matcher, patched on rank 0) it fails alone with its GrammarFailed — the caller's, a 400 at
    the edge — and the others emit exactly what they emit alone; the pool is free afterwards on every rank."""
    import ray

    rank0 = running.coordinator.replica.rank0
    ray.get(rank0.__ray_call__.remote(give_up_after(8)))
    try:
        failure = fails_alone_beside_three_greedy(
            running, SamplingParams(grammar=DOOMED), GenerationConfig(max_new_tokens=24, gamma=3)
        )
        assert isinstance(failure, GrammarFailed), repr(failure)
        assert "too many expressions constructed" in str(failure)
    finally:
        ray.get(rank0.__ray_call__.remote(give_up_after(-1)))


DOOMED_TEMPERATURE = 0.9  # the one request of the NaN test sampled at this temperature


def poison_after(steps: int) -> Callable[[Any], None]:
    """A call for rank 0's process: after ``steps`` verify steps with a request sampled at
    :data:`DOOMED_TEMPERATURE`, the target's logits of that request's rows are NaN (as a row that overflowed would
    be), on rank 0, which decides; the other rows are the forward's own (``steps`` < 0: undo)."""

    def patch(shard: Any) -> None:
        import torch

        pool = shard._pool
        if steps < 0:
            pool.__dict__.pop("forward_batch", None)  # the class's method again
            return
        forward = type(pool).forward_batch.__get__(pool)
        seen = [0]

        def poisoned(blocks: Any, last_only: bool = False, capture: Any = None) -> Any:
            logits = forward(blocks, last_only=last_only, capture=capture)
            doomed = {r.seq_id for r in shard._requests.values() if r.verifier.params.temperature == DOOMED_TEMPERATURE}
            if last_only or not doomed & {block.seq_id for block in blocks}:
                return logits
            seen[0] += 1
            if seen[0] <= steps:
                return logits
            return [
                torch.full_like(rows, float("nan")) if block.seq_id in doomed else rows
                for block, rows in zip(blocks, logits, strict=True)
            ]

        pool.forward_batch = poisoned

    return patch


def test_a_request_whose_logits_turn_nan_fails_alone_and_the_others_stay_exact(running: Running) -> None:
    """Rank 0 verifies a sampled request in the same steps as three greedy ones; when the target's logits of its rows
    turn NaN (patched on rank 0) it fails alone with a RequestFailed naming nothing internal, and the others emit
    exactly what they emit alone; the pool is free afterwards on every rank."""
    import ray

    rank0 = running.coordinator.replica.rank0
    ray.get(rank0.__ray_call__.remote(poison_after(2)))
    try:
        failure = fails_alone_beside_three_greedy(
            running,
            SamplingParams(temperature=DOOMED_TEMPERATURE, seed=5),
            GenerationConfig(max_new_tokens=30, gamma=3, ignore_eos=True),  # runs into the poisoned steps
        )
        assert isinstance(failure, RequestFailed), repr(failure)
    finally:
        ray.get(rank0.__ray_call__.remote(poison_after(-1)))
