"""The suffix drafter's store shared across replicas (``suffix_store: cluster``): the Ray actor's log, the mirrors'
pulls, a lost store, and drafting from another replica's outputs with exact output, in process and from a
distributed replica's drafter actor."""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from conftest import TinyPair

from specserve.actors.suffix_store import SharedSuffixCache, SuffixStoreActor, store_actor
from specserve.core.batch_engine import BatchedEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import request_drafters

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]


def unique_name() -> str:
    return f"suffix-store-{uuid.uuid4().hex[:8]}"


def test_the_log_skips_the_asker_and_stays_bounded() -> None:
    store = SuffixStoreActor(max_tokens=5)
    store.publish("a", [1, 2, 3])
    store.publish("b", [4, 5])

    def since(origin: str, after: int) -> tuple[int, list[list[int]]]:
        latest, documents = store.since(origin, after)
        return latest, [d.tolist() for d in documents]

    assert since("a", 0) == (2, [[4, 5]]) and since("b", 0) == (2, [[1, 2, 3]]) and since("b", 2) == (2, [])
    store.publish("a", [6, 7, 8])  # 8 tokens: the oldest output goes
    assert store.stats() == {"documents": 2, "tokens": 5, "published": 3}
    store.publish("a", list(range(9)))  # longer than the whole log: its last 5 tokens
    assert store.stats()["tokens"] == 5 and since("b", 3) == (4, [[4, 5, 6, 7, 8]])


def test_mirrors_see_each_others_outputs_once(ray_cluster: Any) -> None:
    name = unique_name()
    first, second = SharedSuffixCache(name), SharedSuffixCache(name)
    first.publish([1, 2, 3])
    second.refresh(wait=True)
    assert second.documents == [[1, 2, 3]]
    second.publish([4, 5])
    first.refresh(wait=True)
    assert first.documents == [[1, 2, 3], [4, 5]]  # its own output is not pulled back
    second.refresh(wait=True)
    assert second.documents == [[1, 2, 3], [4, 5]] and second.pulled_documents == 1


def test_a_lost_store_is_started_again(ray_cluster: Any) -> None:
    import ray

    name = unique_name()
    first, second = SharedSuffixCache(name), SharedSuffixCache(name)
    first.publish([1, 2])
    second.refresh(wait=True)
    ray.kill(store_actor(name))
    time.sleep(0.5)
    second.refresh(wait=True)  # the pull fails: a new, empty store
    assert second.failures >= 1 and second.documents == [[1, 2]]  # what it held stays
    first.refresh(wait=True)
    first.publish([7, 8, 9])
    second.refresh(wait=True)
    assert second.documents[-1] == [7, 8, 9]


def test_a_replica_drafts_from_another_replicas_outputs(
    ray_cluster: Any, tiny_pairs: dict[str, TinyPair], hf_greedy: HfGreedy
) -> None:
    """Two batched engines with suffix drafters over one cluster store: the second drafts the first's output
    (global matches) and still gives transformers' greedy text; one with a private store has no global match."""
    pair = tiny_pairs["llama"]
    name = unique_name()
    prompt = list(pair.prompts[1])
    greedy, config = SamplingParams(), GenerationConfig(24, gamma=4)

    def run(cache: SharedSuffixCache | None) -> Any:
        new_drafter = request_drafters("suffix", pair.target, max_num_seqs=2, suffix_cache=cache)
        engine = BatchedEngine(pair.target, new_drafter, max_num_seqs=2, max_seq_len=96)
        result = engine.generate(prompt, greedy, config)
        del engine, new_drafter
        gc.collect()  # a batched engine's request drafter publishes its output when it is collected
        return result

    first, second = SharedSuffixCache(name), SharedSuffixCache(name)
    run(first)
    second.refresh(wait=True)
    assert second.tokens > 0, "the first replica's output never reached the second"
    shared = run(second)
    alone = run(None)
    for result in (shared, alone):
        assert result.output_ids == hf_greedy(pair.target, prompt, 24)
    assert shared.stats.drafter_counters["global_matches"] > 0
    assert alone.stats.drafter_counters["global_matches"] == 0
    assert shared.stats.accepted_tokens > alone.stats.accepted_tokens


@pytest.mark.timeout(300)
def test_a_distributed_replicas_drafter_publishes_to_the_cluster_store(
    ray_cluster: Any, saved_pairs: dict[str, Any], tiny_pairs: dict[str, TinyPair], hf_greedy: HfGreedy
) -> None:
    from specserve.actors.coordinator import Coordinator
    from specserve.actors.replica import ReplicaConfig
    from specserve.actors.suffix_store import STORE_NAME

    pair = tiny_pairs["llama"]
    models = saved_pairs["llama"]
    mirror = SharedSuffixCache(STORE_NAME)
    config = ReplicaConfig(target=str(models / "target"), draft="suffix", dtype="float64", suffix_store="cluster")
    coordinator = Coordinator.spawn(config)
    try:
        outputs = []
        for prompt in pair.prompts[:3]:  # each request publishes the one before it (at its start)
            got = coordinator.generate(prompt, SamplingParams(), GenerationConfig(12, gamma=3))
            assert got.output_ids == hf_greedy(pair.target, prompt, 12)
            outputs.append(got.output_ids)
        deadline = time.monotonic() + 10
        while len(mirror.documents) < 2 and time.monotonic() < deadline:
            mirror.refresh(wait=True)
            time.sleep(0.2)
        # a request's output but its last cycle's tokens (the drafter is not told the verdict that ends it)
        assert len(mirror.documents) >= 2
        for document, output in zip(mirror.documents[:2], outputs, strict=False):
            assert document and output[: len(document)] == document, (document, output)
    finally:
        coordinator.shutdown()
