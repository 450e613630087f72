"""A lost drafter costs speed, never a request: kill the drafter actor mid-stream, the request finishes exactly.

Greedy: the tokens of an undisturbed run (transformers' greedy reference). Drafter-invariant sampling: the same
tokens as an undisturbed run with the same seed. On the batched replica the killed run takes its prompt's KV from the
prefix cache (the undisturbed run cached it), so the fault path is exercised on a cache hit. Ray restarts the
drafter, and the next request drafts again.
One replica at a time, one at a time and batched (the distributed runtime at TP 1); test_faults.py goes on with the
same two replicas (``shared_replicas``), each module through a coordinator of its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import SharedReplicas, TinyPair, cases_in_use
from replicas import Case, config_for, greedy_reference

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(300)


def longest(pair: TinyPair, prompt: tuple[int, ...]) -> GenerationConfig:
    """Greedy-or-seeded generation to the end of the tiny target's context, so that the kill lands mid-request
    (checked: the result shows plain cycles)."""
    return GenerationConfig(max_new_tokens=pair.target.info.max_positions - len(prompt), gamma=3, ignore_eos=True)


def tp1_config(models: Path, max_num_seqs: int) -> ReplicaConfig:
    """The replica of this module and of test_faults.py (they share it: ``shared_replicas``)."""
    return config_for(Case("llama", 1, "model", "colocated", False), models, max_num_seqs=max_num_seqs)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-at-a-time", "batched"])
def coordinator(
    request: pytest.FixtureRequest, shared_replicas: SharedReplicas, saved_pairs: dict[str, Path]
) -> Coordinator:
    # both kinds' replicas start at once
    shared_replicas.prepare(tp1_config(saved_pairs["llama"], kind) for kind in cases_in_use(request, "coordinator"))
    return shared_replicas.coordinator(tp1_config(saved_pairs["llama"], request.param))


def generate_killing_the_drafter(
    coordinator: Coordinator, prompt: tuple[int, ...], params: SamplingParams, config: GenerationConfig
) -> GenerationResult:
    """Stream one request and kill the replica's drafter actor (Ray restarts it) after its first chunk."""
    import ray

    result = None
    for index, chunk in enumerate(coordinator.stream(prompt, params, config)):
        if index == 1:
            ray.kill(coordinator.replica.drafter, no_restart=False)
        result = chunk.result or result
    assert result is not None
    return result


def wait_for_the_drafter(coordinator: Coordinator, timeout_s: float = 60.0) -> None:
    """Until the replica's drafter answers again (Ray restarts a killed one)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(coordinator.replica.drafter.node_id.remote(), timeout=5)
            return
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def cache_hit(coordinator: Coordinator, prompt: tuple[int, ...]) -> int:
    """What a request whose whole prompt an earlier one cached takes from the prefix cache: all but the prompt's last
    token on a batched replica; nothing one at a time (no pool, no cache)."""
    return len(prompt) - 1 if coordinator.replica.config.max_num_seqs > 1 else 0


def plain_cycles(result: GenerationResult) -> int:
    """Cycles that drafted nothing: the coordinator's own without a drafter (and a request's last cycle, when only
    one token was left to emit)."""
    return result.stats.draft_length_histogram.get(0, 0)


def test_greedy_request_survives_its_drafter(coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]) -> None:
    """The killed run emits the tokens of the undisturbed one, which are transformers' greedy tokens up to EOS (past
    it, ``ignore_eos`` keeps the request going: the same argmax rule), with the same logprobs: those of the cycles
    whose reports died with the drafter come from rank 0's record."""
    pair = tiny_pairs["llama"]
    params = SamplingParams(logprobs=2)
    prompt = pair.prompts[0]
    config = longest(pair, prompt)
    undisturbed = coordinator.generate(prompt, params, config)
    reference = greedy_reference(pair, prompt, config.max_new_tokens)
    assert undisturbed.output_ids[: len(reference)] == reference
    result = generate_killing_the_drafter(coordinator, prompt, params, config)
    assert plain_cycles(result) > plain_cycles(undisturbed), "the kill came after the request ended: nothing tested"
    assert result.output_ids == undisturbed.output_ids and result.finish_reason == "length"
    assert result.stats.cached_tokens == cache_hit(coordinator, prompt)  # killed during a prefix-cache hit
    assert result.logprobs is not None and undisturbed.logprobs is not None
    assert [entry.token for entry in result.logprobs] == result.output_ids
    assert [e.logprob for e in result.logprobs] == pytest.approx([e.logprob for e in undisturbed.logprobs], abs=1e-6)

    coordinator.check_health(timeout_s=10)  # a drafter Ray is restarting leaves the replica healthy
    # once Ray has restarted the drafter (a request meanwhile would go on without it), requests speculate again
    wait_for_the_drafter(coordinator)
    again = coordinator.generate(prompt, params, config)
    assert again.output_ids == undisturbed.output_ids
    assert plain_cycles(again) == plain_cycles(undisturbed) and again.stats.accepted_tokens > 0


def test_drafter_invariant_request_emits_the_undisturbed_tokens(
    coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]
) -> None:
    prompt = tiny_pairs["llama"].prompts[1]
    params = SamplingParams(temperature=1.0, top_k=30, seed=7, drafter_invariant=True)
    config = longest(tiny_pairs["llama"], prompt)
    undisturbed = coordinator.generate(prompt, params, config)
    result = generate_killing_the_drafter(coordinator, prompt, params, config)
    assert plain_cycles(result) > plain_cycles(undisturbed), "the kill came after the request ended: nothing tested"
    assert result.output_ids == undisturbed.output_ids
    assert result.stats.cached_tokens == cache_hit(coordinator, prompt)
