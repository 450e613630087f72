"""The emitted law inside a batch: a chi-square test of sampled requests served by the batched engine.

1200 seeded requests (T = 1, top-k 6, a draft model proposing γ = 2 from its own warped q, drafted for
the whole batch in shared forwards) run through one :class:`~specserve.core.batch_engine.BatchedEngine`
of 16 slots, joining as others leave, next to long-running companions of other prompts; all but the first few take
their prompt's keys and values from the prefix cache. Their first two
tokens must follow the target's exact joint law of two tokens (enumerated). Significance 1e-4 (seeds
fixed, so the test is deterministic; a false failure has probability < 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyPair
from stats_helpers import chi2_pvalue

from specserve.core.batch_engine import BatchedEngine
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.drafters.registry import request_drafters

PROMPT = [5, 6, 7, 8, 9]
TRIALS = 1200


@pytest.mark.timeout(600)
def test_sampled_requests_in_a_batch_follow_the_target_law(tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    warp = SamplingParams(temperature=1.0, top_k=6)

    def law(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return warp_probs(pair.target.model(input_ids=torch.tensor([ids])).logits[0, -1].double(), warp)

    first = law(PROMPT)
    joint = torch.stack([first[a] * law([*PROMPT, a]) for a in range(first.numel())])

    engine = BatchedEngine(
        pair.target,
        request_drafters(pair.draft, pair.target, max_num_seqs=16, max_seq_len=64),
        max_num_seqs=16,
        max_seq_len=64,
    )
    companions = [
        engine.submit(list(p), SamplingParams(temperature=1.0, seed=99), GenerationConfig(40, 3, ignore_eos=True))
        for p in pair.prompts[:3]
    ]
    config = GenerationConfig(max_new_tokens=2, gamma=2, ignore_eos=True)
    ids = {engine.submit(PROMPT, SamplingParams(temperature=1.0, top_k=6, seed=s), config): s for s in range(TRIALS)}
    pairs: dict[int, list[int]] = {}
    shared = accepted = hits = 0
    while engine.has_work:
        for request_id, chunk in engine.step():
            if chunk.result is not None and request_id in ids:
                pairs[ids[request_id]] = chunk.result.output_ids
                shared += sum(o.batch_size > 1 for o in chunk.result.stats.observations)
                accepted += chunk.result.stats.accepted_tokens
                hits += chunk.result.stats.cached_tokens == len(PROMPT) - 1
    assert len(pairs) == TRIALS and set(companions).isdisjoint(ids)
    assert shared >= TRIALS  # every request ran in batches
    assert 0 < accepted < TRIALS, "both the accept and the reject path must occur"
    assert hits >= TRIALS - 16  # all but the first to start took the prompt's KV from the prefix cache
    drawn = torch.tensor([a * first.numel() + b for a, b in (pairs[s] for s in range(TRIALS))])
    pvalue = chi2_pvalue(drawn, joint)
    assert pvalue > 1e-4, f"tokens emitted in a batch do not follow the target's law (p={pvalue:.2e})"
