"""A batched step copies its verdicts to the host once (:mod:`specserve.core.verify.staged`).

* The rules' device halves and :func:`~specserve.core.verify.chain.chain_verdict` equal the one-chain rules
  (:func:`~specserve.core.verify.chain.verify_chain`, greedy and sampled on one generator state, ties included, γ 0
  to 8), and :func:`~specserve.core.verify.tree.greedy_tree_walk` the greedy tree rule.
* :func:`~specserve.core.verify.staged.read` brings tensors of every dtype and shape back exactly, in one copy.
* A batched engine's step over greedy chains (draft model and n-gram, mixed lengths, EOS and max tokens) makes one
  host transfer (counted: every ``tolist``, ``item`` and scalar conversion of a tensor inside ``verify_batch``), and
  its outputs equal greedy decoding by full re-forwards (EOS ignored).
* A step that mixes every exact verdict — greedy and sampled chains and trees, penalties, logprobs, drafter-invariant
  chains and trees — also copies once, and every request equals itself alone; so does typical acceptance (which
  reads its own tensors while staging), beside them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TinyPair, finish_all, no_cache_greedy_ids

import specserve.core.batch_engine as batch_engine_module
from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.core.verify.chain import (
    chain_rows_greedy,
    chain_rows_stochastic,
    chain_verdict,
    verify_chain,
    verify_chain_stochastic,
)
from specserve.core.verify.staged import read
from specserve.core.verify.tree import greedy_tree_walk, verify_tree_greedy
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.policies.schedules import schedules


def test_the_device_rules_read_on_the_host_are_the_chain_rules() -> None:
    generator = torch.Generator().manual_seed(0)
    for case in range(400):
        gamma = case % 9
        logits = torch.randn(gamma + 1, 12, generator=generator)
        if case % 3 == 0:  # ties: two tokens share a row's maximum
            logits[:, 5] = logits.max(dim=-1).values
        argmax = logits.argmax(dim=-1)
        agree = int(torch.randint(0, gamma + 1, (1,), generator=generator))
        draft = torch.randint(0, 12, (gamma,), generator=generator)
        draft[:agree] = argmax[:agree]
        count, rows = chain_rows_greedy(logits, draft)
        assert chain_verdict(int(count), rows.tolist(), gamma) == verify_chain(logits, None, draft, None, None), case
        # sampled, q a point mass or a law: the same draws in the same order as the one-chain rule
        probs = torch.softmax(logits, dim=-1)
        q = torch.softmax(torch.randn(gamma, 12, generator=generator), dim=-1) if case % 2 else None
        count, rows = chain_rows_stochastic(probs, draft, q, torch.Generator().manual_seed(case))
        num, token = verify_chain_stochastic(probs, draft, q, torch.Generator().manual_seed(case))
        verdict = chain_verdict(int(count), rows.tolist(), gamma)
        assert (verdict.num_accepted, verdict.next_token) == (int(num), int(token)), case
    with pytest.raises(ValueError, match="rows"):
        chain_verdict(1, [1, 2], 2)


def test_the_greedy_tree_walk_is_the_greedy_tree_rule() -> None:
    generator = torch.Generator().manual_seed(1)
    tree = DraftTree(torch.tensor([3, 4, 3, 5, 4]), (-1, -1, 0, 0, 2))
    for case in range(200):
        logits = torch.randn(tree.size + 1, 6, generator=generator)
        logits[case % 6, [3, 4, 5][case % 3]] = 9.0  # often the path's way
        want = verify_tree_greedy(logits, tree)
        assert greedy_tree_walk(logits.argmax(dim=-1).tolist(), tree.tokens.tolist(), tree) == want, case
    with pytest.raises(ValueError, match="tree of 5 nodes"):
        greedy_tree_walk([0, 1], [3, 4, 3, 5, 4], tree)


def test_read_brings_every_dtype_and_shape_back_exactly_in_one_copy() -> None:
    floats = torch.randn(3, 4)
    staged = [
        {"ids": torch.tensor([0, 2**40 + 3, -1]), "flag": torch.tensor([True, False]), "f32": floats},
        {"bf16": torch.randn(5, dtype=torch.bfloat16), "none": torch.empty(2, 0), "scalar": torch.tensor(7)},
        {},
    ]
    hosts = read(staged)
    assert hosts[0]["ids"] == [0, 2**40 + 3, -1] and all(type(v) is int for v in hosts[0]["ids"])
    assert hosts[0]["flag"] == [1, 0] and hosts[0]["f32"] == floats.tolist()
    assert hosts[1]["bf16"] == staged[1]["bf16"].tolist() and hosts[1]["none"] == [[], []]
    assert hosts[1]["scalar"] == [7] and hosts[2] == {} and read([]) == []


class SyncCounter:
    """Counts a tensor's copies to the host (``tolist``, ``item`` and scalar conversions) while it is on."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))

    def _counting(self, original: Any) -> Any:
        def counted(tensor: torch.Tensor, *args: Any) -> Any:
            if self.on:
                self.count += 1
                self.on = False  # a conversion inside a conversion is the same copy
                try:
                    return original(tensor, *args)
                finally:
                    self.on = True
            return original(tensor, *args)

        return counted


def test_a_step_of_greedy_chains_copies_to_the_host_once(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    per_step = counted_steps(monkeypatch)
    engine = BatchedEngine(pair.target, request_drafters(pair.draft, pair.target), max_num_seqs=4)
    configs = [
        GenerationConfig(max_new_tokens=20, gamma=3, ignore_eos=True),
        GenerationConfig(max_new_tokens=13, gamma=5, ignore_eos=True),
        GenerationConfig(max_new_tokens=17, gamma=2, drafter="ngram", ignore_eos=True),
        GenerationConfig(max_new_tokens=9, gamma=0, ignore_eos=True),  # plain decoding is a chain of 0 drafts
    ]
    prompts = pair.prompts[:4]
    ids = [engine.submit(list(p), SamplingParams(), c) for p, c in zip(prompts, configs, strict=True)]
    results = finish_all(engine)
    for request, prompt, config in zip(ids, prompts, configs, strict=True):
        assert results[request].output_ids == no_cache_greedy_ids(pair.target.model, prompt, config.max_new_tokens)
    assert per_step and set(per_step) == {1}, per_step


def counted_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Host copies made inside each ``verify_batch`` of the batched engine, one entry per step."""
    counter = SyncCounter(monkeypatch)
    per_step: list[int] = []
    original = batch_engine_module.verify_batch

    def counted(*args: Any) -> Any:
        counter.on, counter.count = True, 0
        try:
            return original(*args)
        finally:
            counter.on = False
            per_step.append(counter.count)

    monkeypatch.setattr(batch_engine_module, "verify_batch", counted)
    return per_step


def test_every_staged_verdict_shares_the_steps_one_copy_and_equals_itself_alone(
    pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_step = counted_steps(monkeypatch)
    engine = BatchedEngine(
        pair.target, request_drafters(pair.draft, pair.target), schedules=schedules(), max_num_seqs=9
    )
    alone = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target), schedules=schedules())
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
    chain = GenerationConfig(max_new_tokens=16, gamma=3, ignore_eos=True)
    trees = GenerationConfig(max_new_tokens=16, tree=tree, ignore_eos=True)
    invariant = SamplingParams(temperature=1.0, seed=8, drafter_invariant=True)
    requests = [
        (SamplingParams(), chain),
        (SamplingParams(temperature=1.0, seed=4), chain),
        (SamplingParams(repetition_penalty=1.3), chain),
        (SamplingParams(logprobs=2), chain),
        (SamplingParams(temperature=0.8, seed=5, logprobs=3, logprobs_mode="processed"), chain),
        (SamplingParams(logprobs=1), trees),
        (invariant, chain),
        (invariant, trees),
        (SamplingParams(temperature=1.0, seed=6), trees),
    ]
    prompt = list(pair.prompts[1])
    ids = [engine.submit(prompt, params, config) for params, config in requests]
    results = finish_all(engine)
    assert per_step and set(per_step) == {1}, per_step
    for request, (params, config) in zip(ids, requests, strict=True):
        want = alone.generate(prompt, params, config)
        assert results[request].output_ids == want.output_ids, (params, config)
        if params.logprobs is not None:
            got = results[request].logprobs
            assert [lp.token for lp in got] == [lp.token for lp in want.logprobs]
            # the batch's padded forward and a lone one round differently in the last bits (BENCHMARKS §8)
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-9)
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in want.logprobs]
            flat = [v for lp in got for _, v in lp.top]
            assert flat == pytest.approx([v for lp in want.logprobs for _, v in lp.top], abs=1e-9)


def test_typical_verdicts_decided_while_staging_share_the_step_and_equal_themselves_alone(pair: TinyPair) -> None:
    engine = BatchedEngine(
        pair.target, request_drafters(pair.draft, pair.target), schedules=schedules(), max_num_seqs=4
    )
    alone = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target), schedules=schedules())
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
    trees = GenerationConfig(max_new_tokens=16, tree=tree, ignore_eos=True)
    chain = GenerationConfig(max_new_tokens=16, gamma=3, ignore_eos=True)
    requests = [
        (SamplingParams(temperature=1.0, seed=6), trees),  # sampled trees walk on the host while staging
        (
            SamplingParams(temperature=0.7, seed=2, acceptance="typical", lossy=True),
            chain,
        ),  # so does typical acceptance
        (SamplingParams(temperature=0.7, seed=3, acceptance="typical", lossy=True), trees),
        (SamplingParams(), chain),
    ]
    prompt = list(pair.prompts[2])
    ids = [engine.submit(prompt, params, config) for params, config in requests]
    results = finish_all(engine)
    for request, (params, config) in zip(ids, requests, strict=True):
        assert results[request].output_ids == alone.generate(prompt, params, config).output_ids, (params, config)
