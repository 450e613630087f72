"""The distributed runtime against the single-process engine and transformers, on a real local Ray cluster.

Each replica configuration (TP degree, drafter placement, overlap, drafter) is spawned once per
module and shared by the tests that use it; the Ray cluster is shared by the whole session. The next
configuration's replica starts spawning while a configuration's tests run, once its first test, the resource
check, has seen the cluster hold only its own replica.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair, cases_in_use
from replicas import Case, OneAhead, config_for, greedy_reference

from specserve.actors.coordinator import Coordinator
from specserve.core.engine import SpeculativeEngine
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.registry import build_drafter

pytestmark = pytest.mark.timeout(300)


CASES = {
    "llama-tp1-model-colocated": Case("llama", 1, "model", "colocated", False),
    "llama-tp2-model-separate-overlap": Case("llama", 2, "model", "separate", True),
    "llama-tp2-ngram-colocated": Case("llama", 2, "ngram", "colocated", False),
    "qwen2-tp2-model-separate": Case("qwen2", 2, "model", "separate", False),
    "qwen2-tp1-model-colocated-overlap": Case("qwen2", 1, "model", "colocated", True),
}


@dataclass
class Running:
    case: Case
    pair: TinyPair
    coordinator: Coordinator
    engine: SpeculativeEngine  # the single-process reference with the same drafter


@pytest.fixture(scope="module")
def replicas(request: pytest.FixtureRequest, ray_cluster: Any, saved_pairs: dict[str, Path]) -> Iterator[OneAhead]:
    """The cases' replicas, one spawned ahead: the next case's starts once this case's resource check has run."""
    spawner = OneAhead(
        cases_in_use(request, "running"), lambda name: config_for(CASES[name], saved_pairs[CASES[name].family])
    )
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture(scope="module", params=list(CASES))
def running(request: pytest.FixtureRequest, replicas: OneAhead, tiny_pairs: dict[str, TinyPair]) -> Iterator[Running]:
    case = CASES[request.param]
    pair = tiny_pairs[case.family]
    coordinator = replicas.take(request.param)
    drafter = build_drafter(pair.draft if case.draft == "model" else "ngram", pair.target)
    try:
        yield Running(case, pair, coordinator, SpeculativeEngine(pair.target, drafter))
    finally:
        replicas.release(request.param)


@pytest.fixture(autouse=True)
def the_next_case_starts_after_the_resource_check(request: pytest.FixtureRequest, replicas: OneAhead) -> None:
    """test_resources_follow_the_placement (each case's first test) needs the cluster to this case's replica; the
    case's other tests do not, so the next case's replica starts spawning as they run."""
    if request.node.originalname != "test_resources_follow_the_placement":  # type: ignore[attr-defined]
        replicas.start_next(request.node.callspec.params["running"])  # type: ignore[attr-defined]


def test_resources_follow_the_placement(running: Running) -> None:
    import ray

    total, available = ray.cluster_resources(), ray.available_resources()
    case = running.case
    assert total["large"] - available.get("large", 0.0) == case.tp
    assert total["cheap"] - available.get("cheap", 0.0) == (1 if case.placement == "separate" else 0)
    placement = running.coordinator.placement()
    assert len(placement["shards"]) == case.tp and placement["verifier"].startswith("127.0.0.1:")


def test_greedy_equals_engine_and_transformers(running: Running) -> None:
    overlap_hits = 0
    for gamma in (1, 3, 8):
        for prompt in running.pair.prompts:
            config = GenerationConfig(max_new_tokens=20, gamma=gamma)
            got = running.coordinator.generate(prompt, SamplingParams(), config)
            want = running.engine.generate(prompt, SamplingParams(), config)
            assert got.output_ids == want.output_ids == greedy_reference(running.pair, prompt, 20), (gamma, prompt)
            assert got.finish_reason == want.finish_reason
            assert got.text == want.text
            assert got.stats.new_tokens == len(got.output_ids)
            overlap_hits += got.stats.overlap_hits
    if running.case.overlap and running.case.draft == "model":
        assert overlap_hits > 0, "overlap mode never had the next tree ready"
    if not running.case.overlap:
        assert overlap_hits == 0


def test_request_chooses_its_drafter(running: Running) -> None:
    """``ngram`` and ``none`` per request, whatever the replica's configured drafter: the same greedy text."""
    drafted = {"ngram": 0, "none": 0}
    for prompt in running.pair.prompts[:4]:
        want = greedy_reference(running.pair, prompt, 20)
        for name in drafted:
            config = GenerationConfig(max_new_tokens=20, gamma=3, drafter=name)
            got = running.coordinator.generate(prompt, SamplingParams(), config)
            assert got.output_ids == want, (name, prompt)
            drafted[name] += got.stats.drafted_tokens
    assert drafted["ngram"] > 0 and drafted["none"] == 0
    # ... and the configured drafter is still the default afterwards
    prompt = running.pair.prompts[0]
    again = running.coordinator.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=3))
    assert again.output_ids == greedy_reference(running.pair, prompt, 20)


def test_seeded_sampling(running: Running) -> None:
    """Without overlap a seeded distributed run emits exactly the single-process run; with overlap the
    drafter's random stream differs (it drafts ahead), so there a seed must still reproduce itself."""
    for seed, prompt in enumerate(running.pair.prompts[:4]):
        params = SamplingParams(temperature=1.0, top_k=20, seed=seed)
        config = GenerationConfig(max_new_tokens=16, gamma=3)
        got = running.coordinator.generate(prompt, params, config)
        if running.case.overlap:
            again = running.coordinator.generate(prompt, params, config)
            assert got.output_ids == again.output_ids
        else:
            want = running.engine.generate(prompt, params, config)
            assert got.output_ids == want.output_ids, (seed, prompt)


TREES = {
    "static": TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])),
    "dynamic": TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=7)),
}


@pytest.mark.parametrize("shape", list(TREES))
def test_trees_equal_the_engine_greedy_and_seeded(running: Running, shape: str) -> None:
    """Trees drafted by the drafter actor and verified with tree attention on every shard: greedy equals
    transformers, and a seeded sampled run equals the single-process engine's (trees never overlap)."""
    spec = TREES[shape]
    branched = 0
    for prompt in running.pair.prompts[:4]:
        config = GenerationConfig(max_new_tokens=20, tree=spec)
        got = running.coordinator.generate(prompt, SamplingParams(), config)
        want = running.engine.generate(prompt, SamplingParams(), config)
        assert got.output_ids == want.output_ids == greedy_reference(running.pair, prompt, 20), prompt
        assert got.stats.tree_shapes == want.stats.tree_shapes  # the same trees, cycle by cycle
        branched += sum(nodes > depth for nodes, depth in got.stats.tree_shapes)
    assert branched > 0, "no drafted tree had a branch"
    for seed, prompt in enumerate(running.pair.prompts[:3]):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
        config = GenerationConfig(max_new_tokens=16, tree=spec)
        got = running.coordinator.generate(prompt, params, config)
        assert got.output_ids == running.engine.generate(prompt, params, config).output_ids, (seed, prompt)


def test_drafter_invariant_output_is_the_same_whatever_the_drafter(running: Running) -> None:
    """Drafter-invariant sampling: for one seed every drafter, gamma and tree on this replica (TP 1 or 2) emits
    exactly what plain in-process decoding emits with the same noise."""
    prompt = running.pair.prompts[1]
    none = SpeculativeEngine(running.pair.target, build_drafter("none", running.pair.target))
    for seed in (3, 11):
        params = SamplingParams(temperature=1.0, top_k=30, seed=seed, drafter_invariant=True)
        want = none.generate(prompt, params, GenerationConfig(max_new_tokens=16, gamma=1)).output_ids
        configs = [
            GenerationConfig(max_new_tokens=16, gamma=g, drafter=d)
            for d in ("default", "ngram", "none")
            for g in (2, 5)
        ]
        configs.append(GenerationConfig(max_new_tokens=16, tree=TREES["dynamic"]))
        for config in configs:
            got = running.coordinator.generate(prompt, params, config)
            assert got.output_ids == want, (seed, config)


def test_policies_keep_greedy_exact(running: Running) -> None:
    """The drafter actor decides each cycle's budget (heuristic, adaptive): the greedy text never changes."""
    for policy in ("heuristic", "adaptive"):
        for prompt in running.pair.prompts[:3]:
            config = GenerationConfig(max_new_tokens=20, gamma=3, policy=policy)
            got = running.coordinator.generate(prompt, SamplingParams(), config)
            assert got.output_ids == greedy_reference(running.pair, prompt, 20), (policy, prompt)
            assert len(got.stats.budgets) == got.stats.cycles > 0


def test_stop_string_and_streaming(running: Running) -> None:
    prompt = running.pair.length_prompts[0]
    full = running.engine.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=3))
    stop = full.text[5:7]
    config = GenerationConfig(max_new_tokens=20, gamma=3, stop=(stop,))
    chunks = list(running.coordinator.stream(prompt, SamplingParams(), config))
    want = running.engine.generate(prompt, SamplingParams(), config)
    result = chunks[-1].result
    assert result is not None and result.finish_reason == "stop"
    assert result.output_ids == want.output_ids and result.text == want.text
    assert "".join(chunk.text for chunk in chunks) == result.text


def test_abandoned_stream_frees_the_request(running: Running) -> None:
    import ray

    stream = running.coordinator.stream(running.pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=40))
    next(stream)
    stream.close()  # the caller went away mid-generation
    rank0 = running.coordinator.replica.rank0
    for _ in range(50):
        if not ray.get(rank0.active_requests.remote()):
            break
        time.sleep(0.1)
    assert ray.get(rank0.active_requests.remote()) == []
    # ... and the replica keeps serving
    again = running.coordinator.generate(running.pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=8))
    assert len(again.output_ids) >= 1


def test_penalties_and_logprobs_cross_the_wire(running: Running) -> None:
    """Penalties and grammars run on rank 0 with each row's own history (a grammar also cuts the drafts there and
    renumbers the verdict for the drafter), and every token's logprobs come back over gRPC: the distributed replica
    emits what the single-process engine emits, with the same logprobs."""
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.8, "frequency_penalty": 0.3, "logit_bias": {9: 2.0}}
    lark = GrammarSpec("lark", 'start: "(" item ("," item)* ")"\nitem: /[a-k]+/ | /[0-9]/')
    cases = [SamplingParams(logprobs=3, **penalties), SamplingParams(logprobs=1, grammar=lark)]  # type: ignore[arg-type]
    if not running.case.overlap:  # with overlap the drafter's random stream differs: greedy only
        cases.append(SamplingParams(temperature=1.0, top_k=20, seed=7, logprobs=2, **penalties))  # type: ignore[arg-type]
    for params in cases:
        for prompt in running.pair.prompts[:3]:
            config = GenerationConfig(max_new_tokens=16, gamma=3)
            got = running.coordinator.generate(prompt, params, config)
            want = running.engine.generate(prompt, params, config)
            assert got.output_ids == want.output_ids, (params.temperature, prompt)
            assert got.logprobs is not None and want.logprobs is not None
            assert [entry.token for entry in got.logprobs] == got.output_ids
            for ours, theirs in zip(got.logprobs, want.logprobs, strict=True):
                assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-6)
                assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def test_shadow_checks_run_through_the_distributed_runtime(running: Running, tmp_path: Path) -> None:
    """A replica on the distributed runtime re-decodes its finished requests plainly (drafter none, through the same
    shards) when idle: greedy chains and trees and a drafter-invariant sample all match; a rejection-sampled one is
    skipped."""
    import asyncio

    from specserve.serve.config import ServeConfig
    from specserve.serve.model_server import ModelServer

    config = ServeConfig(
        target=running.coordinator.replica.config.target, dtype="float64", max_num_seqs=1, shadow_fraction=1.0,
        shadow_dir=str(tmp_path),
    )  # fmt: skip
    server = ModelServer(config, lambda c: running.coordinator)  # not shut down: the replica is the module's
    assert server.shadow is not None
    chain = GenerationConfig(max_new_tokens=16, gamma=3)
    tree = GenerationConfig(max_new_tokens=16, tree=TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6)))
    invariant = SamplingParams(temperature=1.0, drafter_invariant=True, seed=17)
    requests = [(SamplingParams(), chain), (SamplingParams(), tree), (invariant, chain)]
    requests.append((SamplingParams(temperature=1.0, seed=3), chain))

    async def main() -> None:
        for params, generation in requests:
            async for _ in server.generate(list(running.pair.prompts[1]), params, generation):
                pass
        await server.shadow.drained()  # type: ignore[union-attr]

    asyncio.run(main())
    counts = server.shadow.counts
    assert counts["match"] == 3 and counts["skipped:sampled"] == 1 and not counts.get("mismatch"), dict(counts)
