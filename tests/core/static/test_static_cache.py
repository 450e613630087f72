"""The static-shape engine (:mod:`specserve.core.static.slots`, :mod:`specserve.core.static.graphs`) on the CPU.

* Bucketing and padding never change outputs: greedy ids equal transformers' ``generate`` for every γ, padded
  (a block of 3 or 5 runs at 4 or 8) and not, for chains (no drafter, n-gram, the draft model, the target drafting
  for itself) and trees, eagerly and through graphs. On a CPU the graphs are :class:`RecordingGraphs`: a stand-in
  backend with a graph's contract (the step's tensor operations recorded once by ``make_fx``, Python state baked in,
  inputs and outputs fixed at capture), which drives the graph path's code — full-width attention under the mask,
  the step's buffers, the keys — and, as a GPU would, breaks a step that reads Python state a replay cannot see
  (making the attended width follow the length, for one, fails 12 of 12 greedy checks).
* The static cache equals the growing one after every cycle, layer by layer, when both verify the same proposals
  (chains and trees, so rollbacks and compactions); padding queries write only past their block, and a block's
  logits do not depend on what the columns past it hold.
* The graph bookkeeping: a capture per key and replays after it; a failed capture, inputs of another shape, a key
  past the limit and no backend all run eagerly, and the output stays exact.
* The batched engine's steps at bucketed widths; the settings (``ReplicaConfig``) and the buckets' choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import REF_TOKENS, TinyPair, finish_all
from head_helpers import random_heads, trained_head
from hypothesis import given, settings
from hypothesis import strategies as st
from static_helpers import BUCKETS, RecordingGraphs

from specserve.cluster.replica_config import InvalidSetting, ReplicaConfig
from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Draft
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.buckets import CPU_BUCKETS, GPU_BUCKETS, VerifyBuckets, choose_buckets, default_buckets
from specserve.core.model.causal_lm import BatchBlock, CausalLM, select_features
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.static import slots as static_cache
from specserve.core.static.graphs import GraphCache
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import StaticCacheFull, StaticTarget
from specserve.core.target import LocalSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.medusa import MedusaDrafter

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
TOKENS = 20


def static_engine(pair: TinyPair, drafter: object, graphs: RecordingGraphs | None) -> SpeculativeEngine:
    engine = SpeculativeEngine(pair.target, drafter, static=StaticOptions(buckets=BUCKETS))  # type: ignore[arg-type]
    assert engine.static is not None
    engine.static.graphs = GraphCache(graphs)  # a CPU has no CUDA graphs: the stand-in, or none (eager)
    return engine


def make_drafter(kind: str, pair: TinyPair) -> object:
    return {
        "none": lambda: NoDrafter(),
        "ngram": lambda: NgramDrafter(),
        "model": lambda: DraftModelDrafter(pair.draft, pair.target),
        "self": lambda: DraftModelDrafter(pair.target, pair.target),
    }[kind]()


@pytest.mark.parametrize("mode", ["eager", "graphs"])
@pytest.mark.parametrize("kind", ["none", "ngram", "model", "self"])
def test_greedy_output_equals_transformers_at_every_gamma(
    pair: TinyPair, kind: str, mode: str, hf_greedy: HfGreedy
) -> None:
    """γ 1, 2, 4, 7: blocks of 2, 3, 5, 8 run at 2, 4, 8, 8 (padded and not)."""
    graphs = RecordingGraphs() if mode == "graphs" else None
    engine = static_engine(pair, make_drafter(kind, pair), graphs)
    for gamma in (1, 2, 4, 7):
        for prompt in pair.prompts[:5]:
            result = engine.generate(list(prompt), SamplingParams(), GenerationConfig(TOKENS, gamma=gamma))
            assert result.output_ids == hf_greedy(pair.target, prompt, TOKENS)[: len(result.output_ids)]
            assert len(result.output_ids) == TOKENS or result.finish_reason == "eos"
    if graphs is not None:
        assert engine.static is not None
        widths = {key[1] for key in engine.static.graphs.keys}  # type: ignore[index]
        assert widths <= set(BUCKETS.widths) and graphs.replays > graphs.captures > 0
        assert not engine.static.graphs.failures


TREES = {
    "static": TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [0, 0, 0]])),
    "dynamic": TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=8)),
    "dynamic_wide": TreeSpec("dynamic", budget=TreeBudget(depth=2, width=4, nodes=12)),
}


@pytest.mark.parametrize("mode", ["eager", "graphs"])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_trees_equal_transformers(pair: TinyPair, tree: str, mode: str, hf_greedy: HfGreedy) -> None:
    """Trees of 6, 9 and 13 blocks pad to 8 and 16; their masks are static, their rejected branches compacted away."""
    graphs = RecordingGraphs() if mode == "graphs" else None
    engine = static_engine(pair, DraftModelDrafter(pair.draft, pair.target), graphs)
    for prompt in ([5, 17, 23, 8], [60, 61, 62], *pair.eos_prompts[:1]):
        result = engine.generate(list(prompt), SamplingParams(), GenerationConfig(28, tree=TREES[tree]))
        assert result.output_ids == hf_greedy(pair.target, prompt, 28)[: len(result.output_ids)]
        assert len(result.output_ids) == 28 or result.finish_reason == "eos"


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_hidden_state_drafters_read_features_from_the_static_forwards(
    pair: TinyPair, mode: str, hf_greedy: HfGreedy
) -> None:
    """EAGLE and Medusa read the target's features from the verify forward: on static shapes (their own graph keys)
    the features of a padded block's real rows are the ones an unpadded forward gives, so they draft the same and
    greedy output stays the target's."""
    graphs = RecordingGraphs() if mode == "graphs" else None
    eagle = EagleDrafter.for_target(trained_head(pair), pair.target)
    medusa = MedusaDrafter.for_target(random_heads(pair.target), pair.target)
    for drafter in (eagle, medusa):
        static = static_engine(pair, drafter, graphs)
        dynamic = SpeculativeEngine(pair.target, drafter)
        for prompt in pair.prompts[:4]:
            config = GenerationConfig(REF_TOKENS, gamma=3)
            result = static.generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS)
            assert (
                result.stats.accepted_tokens
                == dynamic.generate(list(prompt), SamplingParams(), config).stats.accepted_tokens
            )
    if graphs is not None:
        assert static.static is not None and any(key[3] for key in static.static.graphs.keys)  # type: ignore[index]


class RecordingEagle(EagleDrafter):
    """An EAGLE drafter that keeps every proposal it makes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.proposals: list[object] = []

    def propose(self, budget: int) -> Draft:
        draft = super().propose(budget)
        self.proposals.append(draft.tokens.tolist())
        return draft

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        tree = super().propose_tree(spec)
        self.proposals.append((tree.tokens.tolist(), tuple(tree.parents)))
        return tree


EAGLE_CONFIGS = [
    GenerationConfig(REF_TOKENS, gamma=3),  # a catch-up block, then one-node steps
    GenerationConfig(REF_TOKENS, gamma=6),
    *(GenerationConfig(REF_TOKENS, tree=TREES[name]) for name in sorted(TREES)),  # levels reaching back
    # levels of 3 reach back over 3, 6, 9 nodes: padded to 4, 8, 16, taking in committed text
    GenerationConfig(REF_TOKENS, tree=TreeSpec("dynamic", budget=TreeBudget(depth=4, width=3, nodes=12))),
]


def eagle_pair(pair: TinyPair, graphs: RecordingGraphs | None) -> tuple[RecordingEagle, RecordingEagle]:
    """Two drafters over one trained head: one on the default (eager, unpadded) slots, one on bucketed slots."""
    head = trained_head(pair)
    growing = RecordingEagle.for_target(head, pair.target)
    shaped = RecordingEagle.for_target(head, pair.target)
    shaped.use_static_shapes(StaticOptions(buckets=BUCKETS), graphs)
    return growing, shaped


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_the_eagle_head_drafts_the_same_on_static_shapes(pair: TinyPair, mode: str, hf_greedy: HfGreedy) -> None:
    """The EAGLE head's blocks pad to buckets — its catch-up blocks, its one-node chain steps, and each tree level,
    whose reach back over the nodes forwarded before it pads too — and replay as graphs: every proposal equals the
    unpadded head's, and greedy output stays the target's."""
    graphs = RecordingGraphs() if mode == "graphs" else None
    growing, shaped = eagle_pair(pair, graphs)
    static = static_engine(pair, shaped, RecordingGraphs() if graphs else None)
    shaped.use_static_shapes(StaticOptions(buckets=BUCKETS), graphs)  # the engine gave it the CPU's (no graphs)
    dynamic = SpeculativeEngine(pair.target, growing)
    for config in EAGLE_CONFIGS:
        for prompt in pair.prompts[:3]:
            result = static.generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS)
            dynamic.generate(list(prompt), SamplingParams(), config)
    assert shaped.proposals == growing.proposals and len(shaped.proposals) > 40
    keys = shaped.slots.graphs.keys
    if graphs is None:
        assert keys == []
        return
    assert {key[1] for key in keys} <= set(BUCKETS.widths)  # type: ignore[index]
    assert {key[4] for key in keys} - {0} <= set(BUCKETS.widths)  # type: ignore[index]
    assert any(key[4] > 0 and shaped.slots.graphs.replays(key) > 0 for key in keys)  # type: ignore[index]
    assert (0, 1, False, False, 0) in keys  # a one-node step, captured up front
    assert graphs.replays > graphs.captures and not shaped.slots.graphs.failures


# a tree grown level by level, as a tree drafter asks for it: (nodes, tokens, parents) over node ids
LEVELS = [[0, 1, 2], [3, 4, 5, 6], [7], [8, 9], [10]]
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
TREE_PARENTS = [ROOT, ROOT, ROOT, 0, 0, 2, 1, 3, 7, 7, 9]


def head_without_a_cache(
    drafter: EagleDrafter, context: Sequence[int], features: torch.Tensor, nodes: int
) -> torch.Tensor:
    """The reference: the head over the committed positions and the first ``nodes`` tree nodes in one forward with
    no cache at all, each node's feature its parent's output (found by rerunning, level by level), tree-masked."""
    committed = len(context) - 1
    depth = [0] * nodes
    for i in range(nodes):
        depth[i] = 0 if TREE_PARENTS[i] == ROOT else depth[TREE_PARENTS[i]] + 1
    tokens = torch.tensor([*context[1:], *TREE_TOKENS[:nodes]])
    size = committed + nodes
    allowed = torch.ones(size, size, dtype=torch.bool).tril()
    allowed[committed:, committed:] = False
    for i in range(nodes):
        j = i
        while j != ROOT:
            allowed[committed + i, committed + j] = True
            j = TREE_PARENTS[j]
    mask = torch.zeros(size, size, dtype=torch.float64).masked_fill_(~allowed, torch.finfo(torch.float64).min)
    positions = torch.tensor([[*range(committed), *(committed + d for d in depth)]])
    hidden = torch.zeros(size, features.shape[-1], dtype=torch.float64)
    for _ in range(max(depth, default=0) + 2):  # each pass settles one more level's features
        rows = torch.cat(
            [
                features[:committed],
                *(hidden[[committed - 1 if p == ROOT else committed + p]] for p in TREE_PARENTS[:nodes]),
            ]
        )
        hidden = drafter.head(rows[None], drafter.embeddings(tokens)[None], None, mask[None, None], positions)[0]
    return drafter.lm_head(hidden)


@pytest.mark.parametrize("mode", ["default", "buckets", "graphs"])
def test_the_eagle_heads_logits_equal_a_forward_without_a_cache(pair: TinyPair, mode: str) -> None:
    """Every logit the head's session gives — the root's, then each level's, whose blocks reach back over the nodes
    forwarded before them (3, 7, 8, 10: padded to 4, 8, 8, 16 with buckets) — equals one forward of the head without a
    cache over the committed text and the tree so far (float64, 1e-9); then a second proposal after two committed
    tokens (a catch-up block) again."""
    drafter = EagleDrafter.for_target(trained_head(pair), pair.target)
    if mode != "default":
        drafter.use_static_shapes(StaticOptions(buckets=BUCKETS), RecordingGraphs() if mode == "graphs" else None)
    context = [5, 17, 23, 8, 9, 30, 31]
    with torch.inference_mode():
        out = pair.target.model(torch.tensor([context]), output_hidden_states=True)
        raw = select_features([h[0] for h in out.hidden_states], drafter.feature_layers)
        fused = drafter.head.fuse_features(raw)
    drafter.start(context[:5], SamplingParams(), torch.Generator())
    drafter.add_features(0, raw[:4])
    for committed_text in (context[:5], context):
        if len(committed_text) > 5:  # two tokens committed since: the next session feeds their positions first
            drafter.accept(context[5:])
            drafter.add_features(4, raw[4:6])
        session = drafter._open_session()
        reference = head_without_a_cache(drafter, committed_text, fused, 0)
        torch.testing.assert_close(session.root_logits, reference[len(committed_text) - 2], rtol=1e-9, atol=1e-9)
        done = 0
        for level in LEVELS:
            logits = session.expand(level, TREE_TOKENS, TREE_PARENTS)
            done += len(level)
            reference = head_without_a_cache(drafter, committed_text, fused, done)
            torch.testing.assert_close(logits, reference[-len(level) :], rtol=1e-9, atol=1e-9)
        session.close()
    if mode == "graphs":
        assert {key[4] for key in drafter.slots.graphs.keys} >= {4, 8, 16}  # type: ignore[index]


def test_sampled_eagle_on_static_shapes_draws_what_the_growing_one_draws(pair: TinyPair) -> None:
    """At T = 1 (chains sent with q, trees drawn without replacement) the padded, graphed head drafts the same, so
    the engine emits the same draw from the same seed."""
    growing, shaped = eagle_pair(pair, RecordingGraphs())
    static = static_engine(pair, shaped, None)
    shaped.use_static_shapes(StaticOptions(buckets=BUCKETS), RecordingGraphs())
    dynamic = SpeculativeEngine(pair.target, growing)
    params = SamplingParams(temperature=1.0, seed=11)
    for config in (GenerationConfig(24, gamma=4), GenerationConfig(24, tree=TREES["dynamic"])):
        for prompt in pair.prompts[:3]:
            assert static.generate(list(prompt), params, config).output_ids == (
                dynamic.generate(list(prompt), params, config).output_ids
            )
    assert shaped.proposals == growing.proposals


def test_sampled_output_is_the_dynamic_engines_draw(pair: TinyPair) -> None:
    """At T = 1 the static engine, padded, draws what the growing one draws from the same seed: the same logits
    reach the same rules (tiny models in float64)."""
    params = SamplingParams(temperature=1.0, seed=7)
    dynamic = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
    static = static_engine(pair, DraftModelDrafter(pair.draft, pair.target), RecordingGraphs())
    for gamma in (2, 4):
        config = GenerationConfig(24, gamma=gamma)
        for prompt in pair.prompts[:3]:
            assert static.generate(list(prompt), params, config).output_ids == (
                dynamic.generate(list(prompt), params, config).output_ids
            )


PROPOSALS = {
    "chain 3": lambda: Draft(torch.tensor([5, 6, 7]), None),
    "chain 6": lambda: Draft(torch.tensor([9, 9, 9, 9, 9, 9]), None),
    "tree": lambda: DraftTree(torch.tensor([5, 6, 7, 8, 9]), [-1, -1, 0, 0, 2]),
    "wide tree": lambda: DraftTree(torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11, 12]), [-1] * 5 + [0, 0, 1, 5, 8]),
}


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_the_static_cache_equals_the_growing_one_after_every_cycle(pair: TinyPair, mode: str) -> None:
    """Two verifiers, one on a static slot and one on a growing cache, verify the same proposals (chains and trees,
    accepted or not): after every cycle they commit the same tokens and hold the same keys and values."""
    owner = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS), RecordingGraphs() if mode == "graphs" else None)
    static_cache = owner.new_cache()
    prompt = list(pair.prompts[0])
    params = SamplingParams()
    static = TargetVerifier(LocalSequence(pair.target, static_cache), prompt, params, torch.Generator(), 60)
    grown = LocalSequence(pair.target)
    dynamic = TargetVerifier(grown, prompt, params, torch.Generator(), 60)
    static.prefill()
    dynamic.prefill()
    oracle = DraftModelDrafter(pair.target, pair.target)  # the target's own drafts: accepted, so kept and compacted
    oracle.start(prompt, params, torch.Generator())
    made: dict[str, Callable[[], Draft | DraftTree]] = {
        **PROPOSALS,
        "own chain": lambda: oracle.propose(5),
        "own tree": lambda: oracle.propose_tree(TreeSpec("dynamic", budget=TreeBudget(depth=3, width=3, nodes=9))),
    }
    for name in sorted(made) * 3:
        if static.finish is not None:
            break
        proposal = made[name]()
        a, b = static.verify(proposal), dynamic.verify(proposal)
        oracle.accept(a.new_tokens)
        if name.startswith("own"):
            assert len(a.new_tokens) > 1, "the target's own draft is accepted"
        assert a.new_tokens == b.new_tokens and a.verdict == b.verdict, name
        assert static_cache.length == grown.cache.length == len(static.committed) - 1
        for (ks, vs), (kd, vd) in zip(static_cache.snapshot(), grown.cache.snapshot(), strict=True):
            torch.testing.assert_close(ks, kd, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(vs, vd, rtol=1e-9, atol=1e-9)
    static_cache.release()


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_padding_writes_past_the_block_and_nothing_past_it_is_read(pair: TinyPair, mode: str) -> None:
    """A block of 3 at bucket 8 writes its keys at its 3 columns and the pads' at the 5 after them; its logits equal a
    growing cache's although every column past the block holds garbage (in graph mode the step attends over them
    all, masked)."""
    owner = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS), RecordingGraphs() if mode == "graphs" else None)
    cache = owner.new_cache()
    grown = pair.target.new_cache()
    prefix = torch.tensor([5, 6, 7, 8, 9, 10])
    pair.target.forward(cache, prefix)
    pair.target.forward(grown, prefix)
    slot = cache.slot
    for tensor in (*slot.keys, *slot.values):
        tensor[:, :, 6:] = 1e3  # garbage everywhere past the cached prefix
    block = torch.tensor([11, 12, 13])
    logits = pair.target.forward(cache, block)
    expected = pair.target.forward(grown, block)
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    keys = slot.keys[0]
    torch.testing.assert_close(keys[:, :, :9], grown.snapshot()[0][0])
    assert not torch.all(keys[:, :, 9:14] == 1e3)  # the five pads wrote their keys right after the block
    assert torch.all(keys[:, :, 14:] == 1e3)  # and nothing wrote further
    cache.rollback(7)  # the verifier keeps what it committed; the next block overwrites from there
    assert cache.length == 7


def test_an_eager_slot_grows_with_its_sequence(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without graphs a slot starts small and doubles as its sequence grows (a long-context model holds only what
    its sequences use), keeping what it cached: its logits and keys stay a growing cache's. A graph's slot has every
    column from the start."""
    monkeypatch.setattr(static_cache, "EAGER_COLUMNS", 16)
    owner = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS))
    cache, grown = owner.new_cache(), pair.target.new_cache()
    capacities = [cache.slot.capacity]
    for block in (torch.arange(3, 15), torch.tensor([4, 5, 6]), torch.arange(20, 45), torch.tensor([7])):
        torch.testing.assert_close(pair.target.forward(cache, block), pair.target.forward(grown, block))
        capacities.append(cache.slot.capacity)
    assert capacities == [16, 16, 16, 40, 80] and cache.length == grown.length == 41  # 15 + 25 > 32: to 40; then 80
    for (ks, vs), (kd, vd) in zip(cache.snapshot(), grown.snapshot(), strict=True):
        torch.testing.assert_close(ks, kd, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(vs, vd, rtol=1e-9, atol=1e-9)
    graphed = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS), RecordingGraphs())
    assert graphed.new_cache().slot.capacity == graphed.columns


def test_graph_keys_capture_once_and_replay(pair: TinyPair) -> None:
    graphs = RecordingGraphs()
    owner = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS), graphs)
    cache = owner.new_cache()
    pair.target.forward(cache, torch.tensor([5, 6, 7, 8, 9]))  # a prefill of 5 at bucket 8
    for _ in range(3):
        pair.target.forward(cache, torch.tensor([4]))
        pair.target.forward(cache, torch.tensor([4, 5, 6]))  # at bucket 4
    slot = cache.slot.index
    # (slot, width, last only, features, reach back): a verify block reaches back nowhere
    assert owner.graphs.keys == [(slot, 8, False, False, 0), (slot, 1, False, False, 0), (slot, 4, False, False, 0)]
    assert graphs.captures == 3 and owner.graphs.replays((slot, 4, False, False, 0)) == 3
    pair.target.forward(cache, torch.arange(3, 23))  # 20 tokens: past every bucket, eager and uncaptured
    assert len(owner.graphs.keys) == 3
    second = owner.new_cache()  # the first is in use: a second slot, graphs of its own
    pair.target.forward(second, torch.tensor([4]))
    assert (second.slot.index, 1, False, False, 0) in owner.graphs.keys and second.slot.index != slot
    cache.release()
    assert owner.new_cache().slot.index == slot  # a released slot is handed out again


def test_every_bucket_is_captured_up_front(pair: TinyPair) -> None:
    """An engine with graphs captures each bucket's verify step when it is built, and a draft model its one-token
    steps; a request then replays them and captures nothing but its prefill's width."""
    graphs = RecordingGraphs()
    owner = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS), graphs)
    keys = owner.capture()
    assert keys == [(0, width, False, False, 0) for width in BUCKETS.widths] and graphs.captures == len(BUCKETS.widths)
    assert owner.new_cache().slot.index == 0  # the slot went back
    assert StaticTarget(pair.target, StaticOptions(buckets=BUCKETS)).capture() == []  # no backend: nothing to do


def test_a_failed_capture_runs_eagerly_and_stays_exact(pair: TinyPair, hf_greedy: HfGreedy, caplog: object) -> None:
    engine = static_engine(pair, NgramDrafter(), RecordingGraphs(fail=True))
    prompt = list(pair.prompts[0])
    result = engine.generate(prompt, SamplingParams(), GenerationConfig(TOKENS, gamma=3))
    assert result.output_ids == hf_greedy(pair.target, prompt, TOKENS)[: len(result.output_ids)]
    assert engine.static is not None
    failures = engine.static.graphs.failures
    assert failures and all(reason == "RuntimeError: operation not permitted when stream is capturing"
                            for reason in failures.values())  # fmt: skip
    assert not engine.static.graphs.keys


def test_graph_cache_falls_back_for_shapes_limits_and_no_backend() -> None:
    calls: list[int] = []

    def step(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        calls.append(1)
        return (inputs[0] * 2,)

    eager = GraphCache(None)
    assert torch.equal(eager.run("k", step, [torch.ones(2)])[0], torch.full((2,), 2.0)) and not eager.keys
    cache = GraphCache(RecordingGraphs(), limit=1)
    out = cache.run("a", step, [torch.ones(2)])
    again = cache.run("a", step, [torch.full((2,), 3.0)])
    assert again[0] is out[0] and torch.equal(again[0], torch.full((2,), 6.0))  # the graph's own output, rewritten
    assert torch.equal(cache.run("a", step, [torch.ones(3)])[0], torch.full((3,), 2.0))  # another shape: eager
    assert torch.equal(cache.run("b", step, [torch.ones(2)])[0], torch.full((2,), 2.0))  # past the limit: eager
    assert cache.keys == ["a"] and cache.eager_runs == 2


def test_a_caches_rows_load_into_another_as_its_positions(pair: TinyPair) -> None:
    """rows() of one slot's first positions, loaded into a fresh slot, hold the same keys and values there; rows of
    another width are refused."""
    slots = StaticTarget(pair.target, StaticOptions(CPU_BUCKETS, cuda_graphs=False))
    source, copy = slots.new_cache(), slots.new_cache()
    pair.target.forward(source, torch.randint(3, 60, (100,)))
    copy.load_rows(source.rows(90))
    assert copy.length == 90
    for (k1, v1), (k2, v2) in zip(source.snapshot(), copy.snapshot(), strict=True):
        assert torch.equal(k1[:, :, :90], k2) and torch.equal(v1[:, :, :90], v2)
    with pytest.raises(ValueError, match="not this model's keys and values"):
        copy.load_rows(source.rows(3)[:, 1:])


def test_a_sequence_past_the_static_cache_is_refused_clearly(pair: TinyPair) -> None:
    """A slot holds max_len positions and 128 more (a padded block, a tree near the end): 16 + 128 here."""
    owner = StaticTarget(pair.target, StaticOptions(buckets=BUCKETS, max_len=16))
    assert owner.columns == 144
    cache = owner.new_cache()
    pair.target.forward(cache, torch.randint(3, 60, (141,)))
    pair.target.forward(cache, torch.tensor([4, 5, 6]))  # its bucket of 4 would not fit, the block does: unpadded
    assert cache.length == 144
    with pytest.raises(StaticCacheFull, match="does not fit the static cache of 16"):
        pair.target.forward(cache, torch.tensor([7]))


@pytest.mark.parametrize("gamma", [2, 4])
def test_batched_steps_at_bucketed_widths_equal_transformers(pair: TinyPair, gamma: int, hf_greedy: HfGreedy) -> None:
    engine = BatchedEngine(
        pair.target,
        lambda name: DraftModelDrafter(pair.draft, pair.target),
        max_num_seqs=4,
        static=StaticOptions(buckets=VerifyBuckets((1, 4, 8, 16))),
    )
    prompts = [list(p) for p in pair.prompts[:4]]
    ids = [engine.submit(p, SamplingParams(), GenerationConfig(TOKENS, gamma=gamma)) for p in prompts]
    results = finish_all(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        out = results[request_id].output_ids
        assert out == hf_greedy(pair.target, prompt, TOKENS)[: len(out)]


def test_a_batched_view_is_as_wide_as_its_bucket(pair: TinyPair) -> None:
    from specserve.core.kv.pool import KVPool

    pool = KVPool(pair.target.model, 64, scratch=2)
    a, b = pool.allocate(20), pool.allocate(20)
    blocks = [BatchBlock.chain(a, torch.tensor([5, 6, 7])), BatchBlock.chain(b, torch.tensor([8]))]
    padded = pair.target.forward_batch(pool, blocks, buckets=VerifyBuckets((1, 8)))
    pool.rollback(a, 0), pool.rollback(b, 0)
    plain = pair.target.forward_batch(pool, blocks)
    for x, y in zip(padded, plain, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="cannot hold a block of 3"):
        pool.view([a], [3], width=2)


# ---------------------------------------------------------------------------------------------
# Settings and buckets


def test_replica_settings_choose_the_engine() -> None:
    base = {"target": "t", "draft": "ngram"}
    assert ReplicaConfig(**base).static_options() is None  # auto on a CPU: growing caches
    on_gpu = ReplicaConfig(**base, device="cuda").static_options()
    assert on_gpu == StaticOptions(buckets=None, cuda_graphs=True)
    chosen = ReplicaConfig(**base, static_shapes="on", buckets="1,2,4", no_cuda_graphs=True).static_options()
    assert chosen == StaticOptions(buckets=VerifyBuckets((1, 2, 4)), cuda_graphs=False)
    assert ReplicaConfig(**base, device="cuda", static_shapes="off").static_options() is None
    assert chosen.buckets_for("cuda") == VerifyBuckets((1, 2, 4))
    assert StaticOptions().buckets_for("cuda") == GPU_BUCKETS and StaticOptions().buckets_for("cpu") == CPU_BUCKETS
    with pytest.raises((InvalidSetting, UserError), match="strictly increasing"):
        ReplicaConfig(**base, buckets="4,2")


@pytest.mark.parametrize(
    ("text", "message"),
    [("4,2", "strictly increasing"), ("0,1", "in 1..256"), ("a,b", "comma-separated"), ("1,1", "strictly")],
)
def test_bad_buckets_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        VerifyBuckets.parse(text)


def test_bucket_lookup() -> None:
    buckets = VerifyBuckets.parse("1,2,4,8")
    assert [buckets.width(k) for k in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 9, 10]
    assert buckets.bucket(9) is None and VerifyBuckets.parse("none").width(5) == 5
    assert default_buckets("cuda") == GPU_BUCKETS and default_buckets("cpu") == CPU_BUCKETS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=40), st.floats(0.0, 0.3))
def test_chosen_buckets_never_pad_to_a_dearer_width(costs: list[float], tolerance: float) -> None:
    """Every width pads to a bucket costing at most (1 + tolerance) × the cheapest width it could pad to, and a width
    that pads at all pads to a cheaper one; the widest measured width is a bucket."""
    table = {k: t for k, t in enumerate(costs, start=1)}
    buckets = choose_buckets(table, tolerance)
    assert buckets.largest == len(costs)
    for k, t in table.items():
        padded = table[buckets.width(k)]
        assert padded <= (1 + tolerance) * min(table[j] for j in table if j >= k) + 1e-12
        if buckets.width(k) != k:
            assert padded < t
