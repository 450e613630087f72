"""A batched step copies its verdicts' inputs to the host once: greedy chains are decided from host argmaxes.

* The host rule equals :func:`~specserve.core.verification.verify_chain`'s greedy rule on random logits (ties
  included: both take the first maximum) and drafts that agree with the target for a random prefix, γ 0 to 8.
* A batched engine's step over greedy chains (draft model and n-gram, mixed lengths, EOS and max tokens) makes one
  host transfer (counted: every ``tolist``, ``item`` and scalar conversion of a tensor inside ``verify_batch``), and
  its outputs equal greedy decoding by full re-forwards (EOS ignored).
* Requests that are not greedy chains (sampled, penalised, logprobs, trees) still decide from their own rows, in the
  same step, and equal themselves alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TinyPair, finish_all, no_cache_greedy_ids

import specserve.core.batch_engine as batch_engine_module
from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.sampling import SamplingParams
from specserve.core.target import _greedy_chain_verdict
from specserve.core.tree import TreeBudget, TreeSpec
from specserve.core.verification import verify_chain
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.policies.schedules import schedules


def test_the_host_rule_is_the_greedy_chain_rule() -> None:
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
        want = verify_chain(logits, None, draft, None, None)
        verdict, new, rows = _greedy_chain_verdict(argmax.tolist(), draft.tolist())
        assert verdict == want, case
        assert new == [*draft[: want.num_accepted].tolist(), want.next_token]
        assert rows == list(range(want.num_accepted + 1))
    with pytest.raises(ValueError, match="argmaxes"):
        _greedy_chain_verdict([1, 2], [1, 2])


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


def test_other_verdicts_share_the_step_and_equal_themselves_alone(pair: TinyPair) -> None:
    engine = BatchedEngine(
        pair.target, request_drafters(pair.draft, pair.target), schedules=schedules(), max_num_seqs=5
    )
    alone = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target), schedules=schedules())
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
    chain = GenerationConfig(max_new_tokens=16, gamma=3, ignore_eos=True)
    requests = [
        (SamplingParams(), chain),  # decided on the host
        (SamplingParams(temperature=1.0, seed=4), chain),
        (SamplingParams(repetition_penalty=1.3), chain),
        (SamplingParams(logprobs=2), chain),
        (SamplingParams(), GenerationConfig(max_new_tokens=16, tree=tree, ignore_eos=True)),
    ]
    prompt = list(pair.prompts[1])
    ids = [engine.submit(prompt, params, config) for params, config in requests]
    results = finish_all(engine)
    for request, (params, config) in zip(ids, requests, strict=True):
        want = alone.generate(prompt, params, config)
        assert results[request].output_ids == want.output_ids, (params, config)
        if params.logprobs is not None:
            got = results[request].logprobs
            assert [lp.token for lp in got] == [lp.token for lp in want.logprobs]
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-9)
