"""The distributed runtime against the single-process engine and transformers, on a real local Ray cluster.

Each replica configuration (TP degree, drafter placement, overlap, drafter) is spawned once per
module and shared by the tests that use it; the Ray cluster is shared by the whole session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EOS_ID, TinyPair, hf_greedy_ids

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig, ReplicaStartError
from specserve.cluster.placement import InvalidClusterSpec
from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.sampling import SamplingParams
from specserve.drafters.registry import build_drafter

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Case:
    family: str
    tp: int
    draft: str  # "ngram" or "model"
    placement: str
    overlap: bool


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


def _config(case: Case, models: Path, **overrides: Any) -> ReplicaConfig:
    draft = str(models / "draft") if case.draft == "model" else case.draft
    return ReplicaConfig(
        target=str(models / "target"),
        draft=draft,
        dtype="float64",
        tp_degree=case.tp,
        drafter_placement=case.placement,  # type: ignore[arg-type]
        overlap=case.overlap,
        **overrides,
    )


@pytest.fixture(scope="module", params=list(CASES))
def running(
    request: pytest.FixtureRequest, ray_cluster: Any, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> Iterator[Running]:
    case = CASES[request.param]
    pair = tiny_pairs[case.family]
    coordinator = Coordinator.spawn(_config(case, saved_pairs[case.family]))
    drafter = build_drafter(pair.draft if case.draft == "model" else "ngram", pair.target)
    try:
        yield Running(case, pair, coordinator, SpeculativeEngine(pair.target, drafter))
    finally:
        coordinator.shutdown()


def _reference(pair: TinyPair, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    ref = hf_greedy_ids(pair.target.model, prompt, max_new_tokens)
    return ref[: ref.index(EOS_ID) + 1] if EOS_ID in ref else ref


def test_greedy_equals_engine_and_transformers(running: Running) -> None:
    overlap_hits = 0
    for gamma in (1, 3, 8):
        for prompt in running.pair.prompts:
            config = GenerationConfig(max_new_tokens=20, gamma=gamma)
            got = running.coordinator.generate(prompt, SamplingParams(), config)
            want = running.engine.generate(prompt, SamplingParams(), config)
            assert got.output_ids == want.output_ids == _reference(running.pair, prompt, 20), (gamma, prompt)
            assert got.finish_reason == want.finish_reason
            assert got.text == want.text
            assert got.stats.new_tokens == len(got.output_ids)
            overlap_hits += got.stats.overlap_hits
    if running.case.overlap and running.case.draft == "model":
        assert overlap_hits > 0, "overlap mode never had the next tree ready"
    if not running.case.overlap:
        assert overlap_hits == 0


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


def test_resources_follow_the_placement(running: Running) -> None:
    import ray

    total, available = ray.cluster_resources(), ray.available_resources()
    case = running.case
    assert total["large"] - available.get("large", 0.0) == case.tp
    assert total["cheap"] - available.get("cheap", 0.0) == (1 if case.placement == "separate" else 0)
    placement = running.coordinator.placement()
    assert len(placement["shards"]) == case.tp and placement["verifier"].startswith("127.0.0.1:")


# ---------------------------------------------------------------------------------------------
# KV on every shard, TP 4, bad configurations


def test_every_shard_holds_exactly_the_committed_kv(
    ray_cluster: Any, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> None:
    """Drive a TP-2 replica cycle by cycle; after every verdict each shard's KV equals a fresh prefill."""
    import ray

    from specserve.core.draft import propose_within
    from specserve.core.sampling import make_generators
    from specserve.drafters.model import DraftModelDrafter
    from specserve.rpc.verifier import VerifierStream, open_channel

    pair = tiny_pairs["llama"]
    coordinator = Coordinator.spawn(_config(Case("llama", 2, "ngram", "colocated", False), saved_pairs["llama"]))
    replica = coordinator.replica
    try:
        prompt = pair.length_prompts[0]
        params = SamplingParams(temperature=1.0, seed=7)
        ray.get(replica.rank0.start_request.remote("r", list(prompt), params, 24, [EOS_ID]))
        drafter = DraftModelDrafter(pair.draft, pair.target)
        drafter.start(prompt, params, make_generators(params.seed).draft)
        stream = VerifierStream(open_channel(replica.verifier_address))
        committed = list(prompt)
        sequence = ray.get(replica.rank0.sequence_id.remote("r"))
        for cycle in range(40):
            draft = propose_within(drafter, 3, 24 - (len(committed) - len(prompt)))
            stream.send("r", cycle, draft)
            info = stream.receive()
            new = [*draft.tokens[: info.verdict.num_accepted].tolist(), info.verdict.next_token]
            committed.extend(new[: info.committed_length - len(committed)])
            assert ray.get(replica.rank0.committed.remote("r")) == committed

            ray.get(replica.rank0.start_request.remote("fresh", committed, params, 1, [EOS_ID]))
            fresh = ray.get(replica.rank0.sequence_id.remote("fresh"))
            for rank, shard in enumerate(replica.shards):
                got = ray.get(shard.kv_snapshot.remote(sequence))
                want = ray.get(shard.kv_snapshot.remote(fresh))
                assert len(got) == len(want) == pair.target.model.config.num_hidden_layers
                for (keys, values), (fresh_keys, fresh_values) in zip(got, want, strict=True):
                    assert keys.shape[-2] == len(committed) - 1, f"rank {rank} caches {keys.shape[-2]} positions"
                    assert keys.shape[1] == 1, "each of 2 ranks holds 1 of the 2 KV heads"
                    torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=1e-10)
                    torch.testing.assert_close(values, fresh_values, rtol=0, atol=1e-10)
            ray.get(replica.rank0.finish_request.remote("fresh"))
            if info.finished:
                break
            drafter.accept(new)
        else:
            pytest.fail("the request never finished")
        stream.close()
    finally:
        coordinator.shutdown()


def test_tp4_greedy_equals_transformers(
    ray_cluster: Any, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> None:
    """4 ranks, 2 KV heads: each KV head is replicated on two ranks."""
    pair = tiny_pairs["llama"]
    coordinator = Coordinator.spawn(_config(Case("llama", 4, "ngram", "separate", True), saved_pairs["llama"]))
    try:
        for prompt in pair.prompts[:4]:
            got = coordinator.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=16, gamma=4))
            assert got.output_ids == _reference(pair, prompt, 16)
    finally:
        coordinator.shutdown()


def test_bad_configurations_fail_clearly(ray_cluster: Any, saved_pairs: dict[str, Path]) -> None:
    import ray

    models = saved_pairs["llama"]
    with pytest.raises(InvalidClusterSpec, match="tp_degree"):
        ReplicaConfig(target=str(models / "target"), tp_degree=3)
    before = ray.available_resources()
    with pytest.raises(ReplicaStartError, match="cannot place a replica"):  # the session cluster has 8 "large"
        Coordinator.spawn(ReplicaConfig(target=str(models / "target"), tp_degree=16, ready_timeout_s=2))
    with pytest.raises(ReplicaStartError, match="4 attention heads, which do not divide by tensor parallel size 8"):
        Coordinator.spawn(ReplicaConfig(target=str(models / "target"), tp_degree=8))
    with pytest.raises(ReplicaStartError, match="does not exist"):
        Coordinator.spawn(ReplicaConfig(target=str(models / "target"), draft=str(models / "missing")))
    deadline = time.monotonic() + 30  # placement groups are removed asynchronously
    while ray.available_resources().get("large") != before.get("large") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("large") == before.get("large"), "a failed start leaked its resources"
