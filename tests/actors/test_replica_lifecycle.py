"""A replica's lifecycle beyond plain generation: KV on every shard after every verdict, TP 4, bad configurations.

These tests spawn their own replicas (the module-scoped ones of test_distributed.py are gone by
then), so the session cluster's resources are all theirs. The KV checks and the idle replica's share one TP 2
replica (the class below; it is gone before the other tests spawn theirs).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EOS_ID, VOCAB, TinyPair
from replicas import Case, config_for, greedy_reference
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig, ReplicaStartError
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="class")
def tp2_coordinator(ray_cluster: Any, saved_pairs: dict[str, Path]) -> Iterator[Coordinator]:
    """One TP 2 replica (an n-gram drafter, co-located), its collectives timing out 6 s after a rank stops hearing
    from rank 0, for the tests of the class below; shut down once they ran."""
    case = Case("llama", 2, "ngram", "colocated", False)
    coordinator = Coordinator.spawn(config_for(case, saved_pairs["llama"], collective_timeout_s=6.0))
    try:
        yield coordinator
    finally:
        coordinator.shutdown()


class TestOneTp2Replica:
    """The KV on every shard after every verdict, then idleness: one replica (``tp2_coordinator``)."""

    @pytest.mark.parametrize("shape", ["chain", "tree"])
    def test_every_shard_holds_exactly_the_committed_kv(
        self, shape: str, tp2_coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]
    ) -> None:
        """Drive a TP-2 replica cycle by cycle; after every verdict each shard's KV equals a fresh prefill
        (chains: rolled back; trees: compacted to the accepted path on every shard)."""
        check_every_shards_kv(shape, tp2_coordinator, tiny_pairs["llama"])

    def test_an_idle_tp2_replica_outlives_the_collective_timeout(
        self, tp2_coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]
    ) -> None:
        """Followers wait for commands inside a collective that times out; rank 0's heartbeats keep an idle replica
        alive well past that timeout (here 6 s, idle 15 s), and it still serves exactly."""
        pair = tiny_pairs["llama"]
        prompt = pair.prompts[0]
        config = GenerationConfig(max_new_tokens=12, gamma=3)
        coordinator = tp2_coordinator
        assert coordinator.generate(prompt, SamplingParams(), config).output_ids == greedy_reference(pair, prompt, 12)
        time.sleep(15)
        assert coordinator.generate(prompt, SamplingParams(), config).output_ids == greedy_reference(pair, prompt, 12)


def check_every_shards_kv(shape: str, coordinator: Coordinator, pair: TinyPair) -> None:
    import ray

    from specserve.core.draft.drafter import propose
    from specserve.core.draft.schedule import Budget
    from specserve.core.sampling.warps import make_generators
    from specserve.core.tree.draft_tree import DraftTree
    from specserve.core.tree.shapes import TreeBudget, TreeSpec
    from specserve.drafters.model import DraftModelDrafter
    from specserve.rpc.verifier import VerifierStream, open_channel

    replica = coordinator.replica
    try:
        prompt = pair.length_prompts[0]
        params = SamplingParams(temperature=1.0, seed=7)
        ray.get(replica.rank0.start_request.remote("r", list(prompt), params, 24, [EOS_ID]))
        drafter = DraftModelDrafter(pair.draft, pair.target)
        drafter.start(prompt, params, make_generators(params.seed).draft)
        stream = VerifierStream(open_channel(replica.verifier_address), token=replica.verifier_token)
        committed = list(prompt)
        sequence = ray.get(replica.rank0.sequence_id.remote("r"))
        spec = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
        branched = 0
        for cycle in range(40):
            remaining = 24 - (len(committed) - len(prompt))
            draft = propose(drafter, Budget(3) if shape == "chain" else Budget(0, spec), remaining)
            if shape != "chain":
                assert isinstance(draft, DraftTree)
                branched += int(not draft.is_chain)
            stream.send("r", cycle, draft)
            info = stream.receive()
            new = info.outcome(draft, len(committed)).new_tokens
            committed.extend(new)
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
            if info.finish is not None:
                break
            drafter.accept(new)
        else:
            pytest.fail("the request never finished")
        stream.close()
        assert shape == "chain" or branched > 0, "no drafted tree had a branch"
    finally:  # the replica serves the next test
        ray.get([replica.rank0.finish_request.remote(request) for request in ("r", "fresh")])


def test_tp4_greedy_equals_transformers(
    ray_cluster: Any, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> None:
    """4 ranks, 2 KV heads: each KV head is replicated on two ranks."""
    pair = tiny_pairs["llama"]
    coordinator = Coordinator.spawn(config_for(Case("llama", 4, "ngram", "separate", True), saved_pairs["llama"]))
    try:
        for prompt in pair.prompts[:4]:
            got = coordinator.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=16, gamma=4))
            assert got.output_ids == greedy_reference(pair, prompt, 16)
    finally:
        coordinator.shutdown()


@pytest.fixture()
def three_heads(saved_pairs: dict[str, Path], tmp_path: Path) -> Path:
    """A tiny llama target with 3 attention heads (one KV head), the char tokenizer's files beside it."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for file in (saved_pairs["llama"] / "target").iterdir():
        if "token" in file.name:
            shutil.copy(file, tmp_path / file.name)
    assert json.loads((tmp_path / "config.json").read_text())["num_attention_heads"] == 3
    return tmp_path


def test_bad_configurations_fail_clearly(ray_cluster: Any, saved_pairs: dict[str, Path], three_heads: Path) -> None:
    import ray

    models = saved_pairs["llama"]
    with pytest.raises(ValueError, match=r"tp_degree\n.*must be a power of two"):
        ReplicaConfig(target=str(models / "target"), tp_degree=3)
    with pytest.raises(ReplicaStartError, match="cannot place a replica"):  # the session cluster has 8 "large"
        Coordinator.spawn(ReplicaConfig(target=str(models / "target"), tp_degree=16, ready_timeout_s=2))
    # heads that do not divide by the TP degree fail every shard as it loads (2 of them, not the 8 a 4-head model needs)
    with pytest.raises(ReplicaStartError, match="3 attention heads, which do not divide by tensor parallel size 2"):
        Coordinator.spawn(ReplicaConfig(target=str(three_heads), tp_degree=2))
    with pytest.raises(ReplicaStartError, match="does not exist"):
        Coordinator.spawn(ReplicaConfig(target=str(models / "target"), draft=str(models / "missing")))
    total = ray.cluster_resources()["large"]  # no replica is alive in this module now
    deadline = time.monotonic() + 30  # placement groups are removed asynchronously
    while ray.available_resources().get("large") != total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("large") == total, "a failed start leaked its resources"
