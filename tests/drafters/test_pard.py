"""PARD drafting (``pard:DIR``): a draft causal LM whose config names a mask token drafts a block in one forward.

The checkpoints are the tiny pairs' 1-layer draft models saved as published (a plain causal-LM directory whose
``config.json`` adds ``pard_token`` and ``spd_type: "pard"``), random weights. The reference is written here from the
published semantics: the committed text followed by K − 1 mask tokens, one causal forward without a cache, the last
K positions' logits. Against it: each block's tokens and q, across cycles (the mask entries never stay in the
drafter's cache); greedy decoding equals transformers' ``generate`` with drafts accepted at every depth; sampled, the
two tokens emitted follow the target's joint law (chi-square); trees of block marginals; bad directories refused in
one line; the batched engine gives each request its solo output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import PAD_ID, REF_TOKENS, TinyPair, finish_all
from head_helpers import save_pard
from stats_helpers import draws_over_seeds, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.spec_strings import InvalidDrafterSpec, check_drafter_spec
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.pard import InvalidPardCheckpoint, PardDrafter
from specserve.drafters.pard_batch import BatchedPardModel, PooledPardDrafter
from specserve.drafters.registry import build_drafter, build_drafter_set, request_drafters

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
MASK = PAD_ID  # the tiny vocabulary's <pad>: never in a prompt or an output
GREEDY = SamplingParams()


def reference_block(draft: CausalLM, context: Sequence[int], size: int) -> torch.Tensor:  # [size, vocab]
    """The published step: the whole context then size − 1 mask tokens, one causal forward, the last size logits."""
    ids = torch.tensor([[*context, *[MASK] * (size - 1)]])
    with torch.inference_mode():
        return draft.model(input_ids=ids).logits[0, -size:].double()


def started(drafter: PardDrafter, prompt: Sequence[int], params: SamplingParams = GREEDY, seed: int = 0) -> PardDrafter:
    drafter.start(list(prompt), params, torch.Generator().manual_seed(seed))
    return drafter


@pytest.fixture(scope="module")
def pard_dir(saved_pair_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pard(
        saved_pair_dirs["draft"], tmp_path_factory.mktemp("pard") / "pard", pard_token=MASK, spd_type="pard"
    )


# ---------------------------------------------------------------------------------------------
# The block against the reference


def test_blocks_equal_the_reference_forward_across_cycles(pair: TinyPair) -> None:
    """Greedy blocks are the reference's argmaxes; after a verdict the next block continues the committed text only
    (the masks and rejected drafts left no trace in the drafter's cache)."""
    drafter = started(PardDrafter(pair.draft, MASK, pair.target), pair.prompts[4])
    context = list(pair.prompts[4])
    for size, keep in ((4, 2), (3, 0), (5, 5), (1, 1), (2, 1)):
        draft = drafter.propose(size)
        reference = reference_block(pair.draft, context, size)
        assert draft.draft_probs is None and draft.tokens.tolist() == reference.argmax(-1).tolist()
        committed = [*draft.tokens.tolist()[:keep], 3 + (keep * 7 + size) % 90]  # accepted drafts + a next token
        drafter.accept(committed)
        context += committed
    assert drafter.request_counters() == {"pard_forwards": 5}  # one forward per block, whatever its size


def test_sampled_blocks_send_each_position_s_warped_law_as_q(pair: TinyPair) -> None:
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=3)
    drafter = started(PardDrafter(pair.draft, MASK, pair.target), pair.prompts[5], params, seed=3)
    draft = drafter.propose(4)
    reference = warp_probs(reference_block(pair.draft, pair.prompts[5], 4), params)
    assert draft.draft_probs is not None
    torch.testing.assert_close(draft.draft_probs.double(), reference, atol=1e-5, rtol=1e-4)
    assert all(float(reference[i, t]) > 0 for i, t in enumerate(draft.tokens.tolist()))


def test_a_block_stops_at_the_context_end(pair: TinyPair) -> None:
    room = pair.target.info.max_positions - 3
    drafter = started(PardDrafter(pair.draft, MASK, pair.target), [7] * room)
    assert drafter.propose(8).gamma == 3
    drafter.accept([7, 7, 7])
    assert drafter.propose(8).gamma == 0


# ---------------------------------------------------------------------------------------------
# Exactness with the engine


def depths_accepted(observations: Sequence[object], depth: int) -> list[int]:
    """How many cycles accepted at least d drafts, for d = 1 .. depth."""
    return [sum(1 for o in observations if getattr(o, "accepted", 0) >= d) for d in range(1, depth + 1)]


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_greedy_decoding_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy, shape: str) -> None:
    engine = SpeculativeEngine(pair.target, PardDrafter(pair.draft, MASK, pair.target))
    trees = {
        "static": TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [0, 0, 0]])),
        "dynamic": TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6)),
    }
    drafted = accepted = 0
    observations = []
    for gamma, prompt in zip((3, 4, 2, 3, 4, 3, 4), pair.prompts, strict=False):
        config = GenerationConfig(max_new_tokens=REF_TOKENS, gamma=gamma, tree=trees.get(shape))
        result = engine.generate(prompt, GREEDY, config)
        assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), (shape, prompt)
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
        observations += result.stats.observations
        assert result.stats.drafter_counters["pard_forwards"] == sum(1 for o in result.stats.observations if o.drafted)
    assert drafted > accepted > 0
    assert all(depths_accepted(observations, 2)), "drafts must be accepted at depth 1 and at a mask position"


def test_sampled_tokens_follow_the_target_joint_law(tiny_pairs: dict[str, TinyPair]) -> None:
    """The first two of three tokens emitted after a prompt, blocks of 2 (the second drafted at a mask position), T = 1
    and top-k: chi-square against the target's exact joint law of two tokens; significance 1e-4 (false failure
    < 1e-4)."""
    pair = tiny_pairs["llama"]
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=1.0, top_k=6)
    engine = SpeculativeEngine(pair.target, PardDrafter(pair.draft, MASK, pair.target))

    def run(seed: int) -> tuple[list[int], int]:
        config = GenerationConfig(max_new_tokens=3, gamma=2, ignore_eos=True)
        result = engine.generate(prompt, SamplingParams(temperature=1.0, top_k=6, seed=seed), config)
        return result.output_ids, result.stats.accepted_tokens

    runs = draws_over_seeds(run, 1200)
    accepted = [count for _, count in runs]
    assert min(accepted) == 0 and max(accepted) == 2, "rejections, and acceptances at both depths, must occur"
    assert two_token_fit([output[:2] for output, _ in runs], pair.target, prompt, params) > 1e-4


def test_batched_requests_get_their_solo_outputs(tiny_pairs: dict[str, TinyPair], pard_dir: Path) -> None:
    """A batch of PARD requests at mixed γ beside an n-gram and a plain one: each output is the single-request
    engine's (greedy), each PARD request drafting one block per cycle."""
    pair = tiny_pairs["llama"]  # the saved PARD checkpoint is the llama pair's draft
    target = pair.target
    solo = SpeculativeEngine(target, build_drafter_set(f"pard:{pard_dir}", target))
    new_drafter = request_drafters(f"pard:{pard_dir}", target, max_num_seqs=4)
    assert isinstance(new_drafter("default"), PooledPardDrafter)  # pooled: every request's block in one forward
    engine = BatchedEngine(target, new_drafter, max_num_seqs=4)
    configs = [
        GenerationConfig(max_new_tokens=24, gamma=gamma, drafter=name)
        for gamma, name in ((3, "default"), (2, "default"), (4, "ngram"), (0, "none"))
    ]
    prompts = pair.prompts[:4]
    ids = [engine.submit(list(p), GREEDY, c) for p, c in zip(prompts, configs, strict=True)]
    results = finish_all(engine)
    for request_id, prompt, config in zip(ids, prompts, configs, strict=True):
        assert results[request_id].output_ids == solo.generate(prompt, GREEDY, config).output_ids


def test_one_forward_drafts_every_request_s_block(pair: TinyPair) -> None:
    """Three requests (greedy, sampled, drafter-invariant; one with a long prompt to catch up first) drafting blocks
    of 4, 2 and 3 in one pooled forward: each block's tokens and q are what the one-request drafter gives, over two
    cycles (the masks and the rejected drafts left no trace in the spans)."""
    batcher = BatchedPardModel(pair.draft, MASK, pair.target, max_num_seqs=3, max_seq_len=96)
    prompts = [list(pair.prompts[0]), [7, 8, 9] * 8, list(pair.prompts[5])]
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=10, seed=4), SamplingParams(temperature=1.0, seed=2,
              drafter_invariant=True)]  # fmt: skip
    pooled = [batcher.new_drafter() for _ in prompts]
    alone = [PardDrafter(pair.draft, MASK, pair.target) for _ in prompts]
    for drafter in (*pooled, *alone):
        index = (pooled + alone).index(drafter) % 3
        drafter.start(prompts[index], params[index], torch.Generator().manual_seed(index))
    for cycle, sizes in enumerate(((4, 2, 3), (3, 4, 1))):
        forwards = batcher.forwards
        together = batcher.propose_chains(pooled, list(sizes))
        assert batcher.forwards == forwards + 1
        for i, (draft, single) in enumerate(zip(together, alone, strict=True)):
            reference = single.propose(sizes[i])
            assert draft.tokens.tolist() == reference.tokens.tolist(), (cycle, i)
            assert (draft.draft_probs is None) == (reference.draft_probs is None)
            if draft.draft_probs is not None:
                torch.testing.assert_close(draft.draft_probs, reference.draft_probs, atol=1e-5, rtol=1e-4)
            committed = [*draft.tokens.tolist()[: cycle + 1], 11 + i]
            pooled[i].accept(committed)
            single.accept(committed)
    assert [d.request_counters() for d in pooled] == [{"pard_forwards": 2}] * 3
    for drafter in pooled:
        drafter.release()
    assert batcher.pool.free_tokens == batcher.pool.capacity


# ---------------------------------------------------------------------------------------------
# Loading and refusals


def test_a_published_layout_loads_and_drafts_like_the_model(pard_dir: Path, tiny_pairs: dict[str, TinyPair]) -> None:
    target = tiny_pairs["llama"].target
    drafter = build_drafter(f"pard:{pard_dir}", target)
    assert isinstance(drafter, PardDrafter) and drafter.pard_token == MASK
    check_drafter_spec(f"pard:{pard_dir}")
    fresh = drafter.fresh()
    assert fresh.model is drafter.model and fresh.pard_token == MASK


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "has no pard_token: not a PARD checkpoint"),
        ({"pard_token": 3, "spd_type": "eagle"}, "spd_type is 'eagle', not 'pard'"),
        ({"pard_token": 500}, "pard_token 500 is not an id of its vocabulary of 96"),
        ({"pard_token": "<mask>"}, "pard_token '<mask>' is not an id"),
        ({"pard_token": True}, "pard_token True is not an id"),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line(
    saved_pair_dirs: dict[str, Path], tmp_path: Path, tiny_pairs: dict[str, TinyPair], fields: dict, message: str
) -> None:
    where = save_pard(saved_pair_dirs["draft"], tmp_path / "bad", **fields)
    with pytest.raises(InvalidPardCheckpoint, match=message) as caught:
        build_drafter(f"pard:{where}", tiny_pairs["llama"].target)
    assert "\n" not in str(caught.value)


def test_specs_naming_nothing_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidDrafterSpec, match="names no directory; write pard:DIR"):
        check_drafter_spec("pard:")
    with pytest.raises(InvalidDrafterSpec, match="does not exist"):
        check_drafter_spec(f"pard:{tmp_path / 'missing'}")
