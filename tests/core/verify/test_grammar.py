"""Structured output under speculation: exactly plain constrained decoding of the target.

The reference is a plain loop written here: a full forward per token, the logits masked by a fresh llguidance
matcher advanced over the output so far, then argmax (greedy) or the exact two-token law (chi-square). The engine
must match it with every drafter, chains and trees, in process and in a batch, and cut drafts that leave the
grammar before the target scores them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import EOS_ID, MAX_POSITIONS, VOCAB, TinyPair, char_tokenizer, finish_all
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Draft
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.request import GenerationConfig
from specserve.core.resume import Resume, continuation
from specserve.core.sampling.params import GrammarSpec, InvalidSamplingParams, SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.target import _as_sent
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec
from specserve.core.verify.chain import ChainVerdict, TokenKind
from specserve.core.verify.grammar import compiler_for
from specserve.core.verify.tree import TreeVerdict
from specserve.drafters import DraftModelDrafter, build_drafter_set
from specserve.drafters.batched_model import BatchedDraftModel
from specserve.drafters.registry import request_drafters

ALPHA = 1e-3  # per chi-square test; two of them: a false failure at most 2e-3 per run
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=3, nodes=8))
GRAMMARS = {
    "regex": GrammarSpec("regex", "[0-9a-f]{4}-[0-9a-f]{2,6}"),
    "lark": GrammarSpec("lark", 'start: "(" item ("," item)* ")"\nitem: /[a-k]+/ | /[0-9]/'),
}
DRAFTS = {
    "draft-chain": ("default", None),
    "draft-tree": ("default", DYNAMIC),
    "ngram": ("ngram", None),
    "none": ("none", None),
}


def reference_constrained(
    pair: TinyPair, prompt: Sequence[int], params: SamplingParams, new: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Plain constrained greedy decoding (no cache, no speculation) and each position's mask."""
    assert params.grammar is not None
    grammar = compiler_for(pair.target.tokenizer, VOCAB).compile(params.grammar)
    ids, masks = list(prompt), []
    with torch.inference_mode():
        for _ in range(new):
            logits = pair.target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].double()
            allowed = grammar.allowed()
            masks.append(allowed)
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            ids.append(token)
            if token == EOS_ID:
                break
            grammar.advance([token])
    return ids[len(prompt) :], masks


@pytest.fixture(scope="module")
def engines(tiny_pairs: dict[str, TinyPair]) -> dict[str, SpeculativeEngine]:
    return {f: SpeculativeEngine(p.target, build_drafter_set(p.draft, p.target)) for f, p in tiny_pairs.items()}


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_greedy_output_equals_plain_constrained_decoding(
    pair: TinyPair, engines: dict[str, SpeculativeEngine], draft: str, grammar: str
) -> None:
    params = SamplingParams(grammar=GRAMMARS[grammar])
    drafter, tree = DRAFTS[draft]
    config = GenerationConfig(max_new_tokens=30, gamma=4, drafter=drafter, tree=tree)
    for prompt in pair.prompts[:3]:
        expected, _ = reference_constrained(pair, prompt, params, 30)
        result = engines[pair.family].generate(list(prompt), params, config)
        assert result.output_ids == expected, (draft, prompt)
        text = pair.target.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        if result.finish_reason == "eos" and grammar == "regex":
            assert len(text) >= 7 and text[4] == "-", text


def test_the_grammar_binds_and_drafts_are_cut(pair: TinyPair, engines: dict[str, SpeculativeEngine]) -> None:
    """Free text and constrained text differ; the draft model's drafts outside the grammar are cut, so fewer
    positions are verified than drafted, and what remains is accepted at a good rate."""
    prompt = list(pair.prompts[0])
    config = GenerationConfig(max_new_tokens=30, gamma=4)
    free = engines[pair.family].generate(prompt, SamplingParams(), config)
    bound = engines[pair.family].generate(prompt, SamplingParams(grammar=GRAMMARS["lark"]), config)
    assert free.output_ids != bound.output_ids
    assert bound.text.startswith("(") and bound.finish_reason in ("eos", "length")


def test_a_batch_mixes_grammars_and_free_text(pair: TinyPair) -> None:
    drafters = request_drafters(pair.draft, pair.target, max_num_seqs=4, max_seq_len=128)
    engine = BatchedEngine(pair.target, drafters, max_num_seqs=4, max_seq_len=96)
    config = GenerationConfig(max_new_tokens=24, gamma=3)
    cases = [
        (pair.prompts[0], SamplingParams(grammar=GRAMMARS["regex"])),
        (pair.prompts[0], SamplingParams()),
        (pair.prompts[1], SamplingParams(grammar=GRAMMARS["lark"])),
        (pair.prompts[2], SamplingParams(grammar=GRAMMARS["lark"], presence_penalty=1.0)),
    ]
    ids = [engine.submit(list(prompt), params, config) for prompt, params in cases]
    results = finish_all(engine)
    alone = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    for request_id, (prompt, params) in zip(ids, cases, strict=True):
        assert results[request_id].output_ids == alone.generate(list(prompt), params, config).output_ids


@pytest.mark.parametrize("tree", [None, DYNAMIC], ids=["chain", "tree"])
def test_sampled_output_follows_the_constrained_law(tiny_pairs: dict[str, TinyPair], tree: TreeSpec | None) -> None:
    """Chi-square on the first two tokens against the masked, renormalised target law. The draft model samples
    most of its drafts outside the grammar, so refused sampled tokens (kept as leaves for the residual rule)
    occur in most cycles. 1,500 seeds as requests of one batched engine, whose first seeds the single-request
    engine emits alike."""
    pair = tiny_pairs["llama"]
    batched = BatchedEngine(pair.target, request_drafters(pair.draft, pair.target, max_num_seqs=32), max_num_seqs=32)
    spec = GrammarSpec("regex", "[a-h][a-h0-5]+")
    base = SamplingParams(temperature=1.0, grammar=spec)
    prompt = [5, 6, 7, 5, 6]
    config = GenerationConfig(max_new_tokens=2, gamma=2, tree=tree)
    compiler = compiler_for(pair.target.tokenizer, VOCAB)

    def process(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        grammar, output = compiler.compile(spec), ids[len(prompt) :]
        if grammar.valid_prefix(output) < len(output):
            return logits  # after a token the grammar refuses: a row of probability 0, never read
        grammar.advance(output)
        return logits.masked_fill(~grammar.allowed(), float("-inf"))

    runs = batched_runs(batched, prompt, base, config, 1500)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, base, process) > ALPHA
    single = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    check_single_engine_agrees(single, runs, prompt, base, config)


# ---------------------------------------------------------------------------------------------
# The cut, the masks and the verdict's renumbering


def tiny_grammar(spec: str = "[a-c]+x") -> object:
    return compiler_for(char_tokenizer(), VOCAB).compile(GrammarSpec("regex", spec))


def ids(text: str) -> list[int]:
    return list(char_tokenizer()(text, add_special_tokens=False)["input_ids"])


def test_a_chain_is_cut_at_its_first_refused_token() -> None:
    grammar = tiny_grammar()
    draft = Draft(torch.tensor(ids("abzc")), None)
    cut, kept = grammar.prune(draft, keep_refused=False)
    assert cut.tokens.tolist() == ids("ab") and kept == [0, 1]
    cut, kept = grammar.prune(draft, keep_refused=True)  # a sampled refused token stays, as the last
    assert cut.tokens.tolist() == ids("abz") and kept == [0, 1, 2]
    whole, kept = grammar.prune(Draft(torch.tensor(ids("abc")), None), keep_refused=False)
    assert whole.tokens.tolist() == ids("abc") and kept == [0, 1, 2]


def test_a_tree_loses_what_hangs_below_a_refused_token() -> None:
    grammar = tiny_grammar()
    #        a(0) -> b(2) -> x(4) -> c(6)   z(1) -> a(3)   a(0) -> q(5)
    tokens = torch.tensor(ids("azbaxqc"))
    parents = (ROOT, ROOT, 0, 1, 2, 0, 4)
    tree = DraftTree(tokens, parents)
    cut, kept = grammar.prune(tree, keep_refused=False)
    assert kept == [0, 2, 4] and cut.parents == (ROOT, 0, 1)  # x ends the text: c after it is refused
    cut, kept = grammar.prune(tree, keep_refused=True)
    assert kept == [0, 1, 2, 4, 5, 6] and cut.parents == (ROOT, ROOT, 0, 2, 0, 3)
    masks = grammar.row_masks(cut.tokens, cut.parents)
    allowed = [set(torch.nonzero(row).flatten().tolist()) for row in masks]
    assert allowed[0] == set(ids("abc")) and allowed[1] == set(ids("abcx"))
    assert allowed[2] == set(range(VOCAB))  # after the refused z: never read
    assert allowed[4] == {EOS_ID}  # after a, b, x: only the end


def test_verdicts_on_the_cut_name_the_nodes_sent() -> None:
    tree = DraftTree(torch.tensor(ids("azbaxqc")), (ROOT, ROOT, 0, 1, 2, 0, 4))
    verdict = TreeVerdict((0, 1), 9, TokenKind.RECOVERED)  # on the cut [0, 2, 4]: nodes 0 and 2 of the sent tree
    assert _as_sent(verdict, tree, [0, 2, 4]) == TreeVerdict((0, 2), 9, TokenKind.RECOVERED)
    assert _as_sent(TreeVerdict((0, 1, 2), 9, TokenKind.BONUS), tree, [0, 2, 4]).next_kind == TokenKind.RECOVERED
    chain = Draft(torch.tensor(ids("abzc")), None)
    assert _as_sent(ChainVerdict(2, 5, TokenKind.BONUS), chain, [0, 1]) == ChainVerdict(2, 5, TokenKind.RECOVERED)


# ---------------------------------------------------------------------------------------------
# Resumption and bad grammars


def test_a_resumed_request_continues_its_grammar(pair: TinyPair, engines: dict[str, SpeculativeEngine]) -> None:
    engine = engines[pair.family]
    prompt = list(pair.prompts[1])
    params = SamplingParams(grammar=GRAMMARS["regex"])  # at least 7 characters, then the end
    config = GenerationConfig(max_new_tokens=20, gamma=3)
    whole = engine.generate(prompt, params, config).output_ids
    assert len(whole) >= 7
    ids_, resumed, rest = continuation(prompt, params, config, Resume.of(whole[:5], ""))
    assert engine.generate(ids_, resumed, rest).output_ids == whole[5:]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("regex", "[a-"), "the regex grammar is not valid"),
        (GrammarSpec("lark", "start: nothing_defined"), "the lark grammar is not valid"),
        (GrammarSpec("json_schema", "{not json"), "the json_schema grammar is not valid"),
    ],
)
def test_bad_grammars_are_refused_with_the_reason(
    pair: TinyPair, engines: dict[str, SpeculativeEngine], spec: GrammarSpec, words: str
) -> None:
    with pytest.raises(InvalidRequest, match=words):
        engines[pair.family].generate([5, 6], SamplingParams(grammar=spec), GenerationConfig(4))


def test_grammar_specs_and_ignore_eos_are_checked(pair: TinyPair, engines: dict[str, SpeculativeEngine]) -> None:
    with pytest.raises(InvalidSamplingParams, match="json_schema, regex or lark"):
        GrammarSpec("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidSamplingParams, match="the regex grammar is empty"):
        GrammarSpec("regex", "")
    with pytest.raises(InvalidRequest, match="cannot be combined with ignore_eos"):
        engines[pair.family].generate(
            [5, 6], SamplingParams(grammar=GRAMMARS["regex"]), GenerationConfig(4, ignore_eos=True)
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_model_drafts_only_what_the_grammar_allows(pair: TinyPair, temperature: float) -> None:
    """Its q is the masked law it sampled from (zero outside the grammar), and it stops at a finished text."""
    spec = GrammarSpec("regex", "[0-9a-f]{4}-[0-9a-f]{2,6}")
    drafter = DraftModelDrafter(pair.draft, pair.target)
    prompt = list(pair.prompts[0])
    params = SamplingParams(temperature=temperature, seed=1, grammar=spec)
    drafter.start(prompt, params, make_generators(1).draft)
    check = compiler_for(pair.target.tokenizer, VOCAB).compile(spec)
    committed: list[int] = []
    for _ in range(6):
        draft = drafter.propose(4)
        tokens = draft.tokens.tolist()
        assert check.valid_prefix(tokens) == len(tokens), tokens
        if draft.draft_probs is not None:
            allowed = check.row_masks(draft.tokens, draft.parents)[: len(tokens)]
            assert float(draft.draft_probs.masked_fill(allowed, 0.0).abs().max()) == 0.0
        if not tokens:
            break
        committed, step = [*committed, tokens[0]], tokens[:1]  # as if the target accepted the first only
        check.advance(step)
        drafter.accept(step)
    assert len(committed) >= 4


def test_pooled_drafts_under_grammars_equal_the_one_row_drafters(pair: TinyPair) -> None:
    """Batched serving's draft model (one forward per drafted position for every request) masks and stops under
    each request's grammar exactly as the one-row drafter does: the same tokens and the same q, cycle by cycle."""
    batcher = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=4, max_seq_len=MAX_POSITIONS)
    cases = [
        SamplingParams(grammar=GRAMMARS["regex"]),
        SamplingParams(temperature=1.0, seed=3, grammar=GRAMMARS["lark"]),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0.8, seed=5, grammar=GRAMMARS["regex"]),
    ]
    pooled, alone, checks = [], [], []
    for prompt, params in zip(pair.prompts, cases, strict=False):
        mine, theirs = batcher.new_drafter(), DraftModelDrafter(pair.draft, pair.target)
        mine.start(list(prompt), params, make_generators(params.seed).draft)
        theirs.start(list(prompt), params, make_generators(params.seed).draft)
        pooled.append(mine)
        alone.append(theirs)
        checks.append(compiler_for(pair.target.tokenizer, VOCAB).compile(params.grammar) if params.grammar else None)
    ended = [False] * len(cases)
    for cycle in range(6):
        budgets = [0 if done else 4 for done in ended]
        got = batcher.propose_chains(pooled, budgets)
        for i, (mine_draft, theirs) in enumerate(zip(got, alone, strict=True)):
            want = theirs.propose(budgets[i])
            assert mine_draft.tokens.tolist() == want.tokens.tolist(), (cycle, i)
            if want.draft_probs is not None:
                assert mine_draft.draft_probs is not None
                torch.testing.assert_close(mine_draft.draft_probs, want.draft_probs, rtol=1e-9, atol=1e-12)
            if ended[i]:
                continue
            accepted = want.tokens.tolist()[: (cycle + i) % (want.gamma + 1)]
            check = checks[i]
            if check is not None:
                check.advance(accepted)
                nxt = int(torch.nonzero(check.allowed())[0])  # the lowest allowed token: a valid verdict
                check.advance([nxt])
            else:
                nxt = 3 + (7 * cycle + 5 * i) % (VOCAB - 3)
            committed = [*accepted, nxt]
            ended[i] = EOS_ID in committed
            pooled[i].accept(committed)
            theirs.accept(committed)
    assert any(ended), "no grammar reached its end: the stop was not exercised"
