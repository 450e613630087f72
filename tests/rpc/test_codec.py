"""Wire codec: round trips of every message, and clear errors for malformed, truncated or oversize input."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from specserve.core.draft.drafter import Draft
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.target import CycleOutcome, FinishReason
from specserve.core.tree.draft_tree import ChildSampling, DraftTree
from specserve.core.verify.chain import ChainVerdict, TokenKind
from specserve.core.verify.logprobs import TokenLogprob
from specserve.core.verify.tree import TreeVerdict
from specserve.rpc import codec
from specserve.rpc.codec import WireError
from specserve.rpc.gen import speculation_pb2 as pb

VOCAB = 50


def _outcome(
    verdict: ChainVerdict | TreeVerdict,
    committed_length: int,
    finish: FinishReason | None = None,
    verify_seconds: float = 0.0,
    allreduce_seconds: float = 0.0,
) -> CycleOutcome:
    """A target outcome as rank 0 returns it (the new tokens do not travel: the drafter rebuilds them)."""
    new = [*range(len(verdict.accepted)), verdict.next_token]
    return CycleOutcome(verdict, new, finish, verify_seconds, committed_length, None, allreduce_seconds)


def test_chain_without_q_round_trips() -> None:
    draft = Draft(torch.tensor([3, 1, 4, 1, 5]), None)
    request_id, cycle, back = codec.parse_draft(codec.encode_draft("r1", 7, draft).SerializeToString(), VOCAB)
    assert (request_id, cycle) == ("r1", 7)
    assert torch.equal(back.tokens, draft.tokens) and back.draft_probs is None


def test_chain_with_sparse_q_round_trips_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen)
    q = warp_probs(logits, SamplingParams(temperature=0.8, top_k=7))  # truncated support
    tokens = q.argmax(-1)
    message = codec.encode_draft("r", 0, Draft(tokens, q))
    assert all(len(d.token_ids) == 7 for d in message.draft_probs)  # only the support travels
    back = codec.decode_draft(pb.DraftTree.FromString(message.SerializeToString()), VOCAB)
    assert back.draft_probs is not None and torch.equal(back.draft_probs, q)


def test_empty_tree_and_huge_ids() -> None:
    empty = codec.decode_draft(codec.encode_draft("e", 0, Draft.empty()), VOCAB)
    assert empty.gamma == 0
    big_vocab = 2**31 - 1
    draft = Draft(torch.tensor([big_vocab - 1, 0]), None)
    assert codec.decode_draft(codec.encode_draft("h", 2**63, draft), big_vocab).tokens.tolist() == [big_vocab - 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    tensor = (torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    back = codec.decode_tensor(pb.Tensor.FromString(codec.encode_tensor(tensor).SerializeToString()))
    assert back.dtype == dtype and torch.equal(back, tensor)
    assert codec.decode_tensor(codec.encode_tensor(torch.empty(0, 5, dtype=dtype))).shape == (0, 5)


def test_verdict_round_trip() -> None:
    for verdict in (ChainVerdict(0, 9, TokenKind.RECOVERED), ChainVerdict(4, 2, TokenKind.BONUS)):
        message = codec.encode_verdict("r", 3, _outcome(verdict, committed_length=120))
        back = pb.Verdict.FromString(message.SerializeToString())
        assert codec.decode_verdict(back) == verdict and back.committed_length == 120


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda m: m.parents.append(3), "parents"),
        (lambda m: m.parents.__setitem__(1, -1), "must be a chain"),
        (lambda m: setattr(m, "rules", 9), "unknown verification rules"),
        (lambda m: (setattr(m, "rules", pb.RULES_TREE_IID), m.parents.__setitem__(1, 1)), "malformed draft tree"),
        (lambda m: (m.token_ids.append(VOCAB), m.parents.append(1)), "outside the vocabulary"),
        (lambda m: m.draft_probs.add(token_ids=[1], probs=[1.0]), "draft distributions"),
    ],
)
def test_malformed_trees_are_rejected(mutate: object, needle: str) -> None:
    message = codec.encode_draft("r", 0, Draft(torch.tensor([1, 2]), None))
    mutate(message)  # type: ignore[operator]
    with pytest.raises(WireError, match=needle):
        codec.decode_draft(message, VOCAB)


@pytest.mark.parametrize(
    ("ids", "probs", "needle"),
    [
        ([1, 1], [0.5, 0.5], "repeated"),
        ([1, 2], [0.5, 0.4], "not a probability"),
        ([1, 2], [float("nan"), 1.0], "not a probability"),
        ([2, 3], [0.5, 0.5], "zero probability"),
        ([1], [], "ids and"),
    ],
)
def test_malformed_q_is_rejected(ids: list[int], probs: list[float], needle: str) -> None:
    message = pb.DraftTree(request_id="r", token_ids=[1], parents=[-1], rules=pb.RULES_CHAIN)
    message.draft_probs.add(token_ids=ids, probs=probs)
    with pytest.raises(WireError, match=needle):
        codec.decode_draft(message, VOCAB)


def test_truncated_and_garbage_bytes() -> None:
    data = codec.encode_draft("r", 1, Draft(torch.tensor([1, 2, 3]), None)).SerializeToString()
    with pytest.raises(WireError, match="malformed"):
        codec.parse_draft(data[:-1], VOCAB)
    with pytest.raises(WireError, match="malformed"):
        codec.parse_draft(b"\xff\xff\xff", VOCAB)
    tensor = codec.encode_tensor(torch.ones(4))
    tensor.data = tensor.data[:-1]
    with pytest.raises(WireError, match="needs 16 bytes"):
        codec.decode_tensor(tensor)
    with pytest.raises(WireError, match="dtype"):
        codec.decode_tensor(pb.Tensor(dtype="object", shape=[1], data=b"x"))


def test_oversize_messages_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 64)
    with pytest.raises(WireError, match="exceeds"):
        codec.parse_draft(b"\x00" * 65, VOCAB)
    with pytest.raises(WireError, match="exceeds"):
        codec.encode_draft("r", 0, Draft(torch.arange(40), None))


def test_nothing_is_unpickled() -> None:
    import ast
    from pathlib import Path

    tree = ast.parse(Path(codec.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    called = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {"pickle", "dill", "cloudpickle"} & imported
    assert not {"load", "loads"} & called  # no torch.load / pickle.loads


# ---------------------------------------------------------------------------------------------
# Round trips through bytes (parse_draft / parse_verdict), q bit-exact in every dtype


def _sparse_q(dtype: torch.dtype, rows: int = 4, scale: float = 0.5, top_k: int = 12, seed: int = 0) -> torch.Tensor:
    """Softmax of random logits truncated to top-k (exact zeros elsewhere), computed in float64, cast to dtype."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64) * scale
    q = warp_probs(logits, SamplingParams(temperature=1.0, top_k=top_k)).to(dtype)
    q[-1] = 0  # and one point-mass row (top-k = 1)
    q[-1, 7] = 1
    return q


def _sample_tokens(q: torch.Tensor, seed: int = 0) -> torch.Tensor:
    return torch.multinomial(q.double(), 1, generator=torch.Generator().manual_seed(seed)).flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_q_travels_bit_exact_in_its_dtype(dtype: torch.dtype) -> None:
    q = _sparse_q(dtype)
    assert bool((q == 0).any()) and bool((q[:-1] > 0).sum(-1).eq(12).all())
    # precondition of the codec's sum check (see test_bf16_q_rounded_from_a_peaked_softmax_is_accepted)
    assert bool(((q.double().sum(-1) - 1).abs() <= codec.PROB_SUM_TOLERANCE).all())
    tokens = _sample_tokens(q)
    data = codec.encode_draft("req-q", 11, Draft(tokens, q)).SerializeToString()
    request_id, cycle, back = codec.parse_draft(data, VOCAB)
    assert (request_id, cycle) == ("req-q", 11)
    assert torch.equal(back.tokens, tokens) and back.tokens.dtype == torch.long
    assert back.draft_probs is not None
    assert back.draft_probs.dtype == dtype and back.draft_probs.shape == q.shape
    assert torch.equal(back.draft_probs, q)
    assert torch.equal(back.draft_probs.view(-1).view(torch.uint8), q.reshape(-1).view(torch.uint8))  # bits, not values


def test_bf16_q_rounded_from_a_peaked_softmax_is_accepted() -> None:
    for seed in range(10):
        q = _sparse_q(torch.bfloat16, scale=3.0, top_k=10, seed=seed)
        tokens = _sample_tokens(q, seed)
        back = codec.parse_draft(codec.encode_draft("r", 0, Draft(tokens, q)).SerializeToString(), VOCAB)[2]
        assert back.draft_probs is not None and torch.equal(back.draft_probs, q)


def test_empty_trees_round_trip_through_bytes() -> None:
    for draft in (Draft.empty(), Draft(torch.empty(0, dtype=torch.long), torch.empty(0, VOCAB))):
        data = codec.encode_draft("empty", 3, draft).SerializeToString()
        request_id, cycle, back = codec.parse_draft(data, VOCAB)
        assert (request_id, cycle, back.gamma) == ("empty", 3, 0)
        assert back.tokens.dtype == torch.long and back.draft_probs is None
    with pytest.raises(WireError, match="no verification rules"):  # the empty message names no rules
        codec.parse_draft(b"", VOCAB)


def test_every_proposal_names_its_rules_and_unspecified_is_refused() -> None:
    wire = {
        pb.RULES_CHAIN: Draft(torch.tensor([1, 2, 3]), None),
        pb.RULES_TREE_IID: DraftTree(torch.tensor([1, 2]), (-1, -1)),
        pb.RULES_TREE_WITHOUT_REPLACEMENT: DraftTree(
            torch.tensor([1, 2]), (-1, -1), None, ChildSampling.WITHOUT_REPLACEMENT
        ),
    }
    for rules, proposal in wire.items():
        message = codec.encode_draft("r", 1, proposal)
        assert message.rules == rules
        assert codec.decode_draft(message, VOCAB).rules is proposal.rules
    message.rules = pb.RULES_UNSPECIFIED
    with pytest.raises(WireError, match="no verification rules"):
        codec.decode_draft(message, VOCAB)
    assert "features" not in pb.DraftTree.DESCRIPTOR.fields_by_name  # the unused field is gone (reserved)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float16])
def test_tensor_round_trip_odd_shapes(dtype: torch.dtype) -> None:
    base = torch.arange(-12, 12, dtype=torch.float64).reshape(4, 6) * 1.5
    for tensor in (base.to(dtype).t(), base.to(dtype)[1:, ::2], torch.tensor(3.0).to(dtype)):  # non-contiguous, 0-d
        back = codec.decode_tensor(pb.Tensor.FromString(codec.encode_tensor(tensor).SerializeToString()))
        assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_tensor_negative_shape_and_unknown_dtypes_are_rejected() -> None:
    with pytest.raises(WireError, match="negative"):
        codec.decode_tensor(pb.Tensor(dtype="float32", shape=[-1, 4], data=b""))
    with pytest.raises(WireError, match="cannot travel"):
        codec.encode_tensor(torch.zeros(2, dtype=torch.bool))


def test_verdict_round_trips_through_bytes_with_timings() -> None:
    cases: list[tuple[ChainVerdict, int, FinishReason | None, float, float]] = [
        (ChainVerdict(0, 9, TokenKind.RECOVERED), 17, None, 0.0, 0.0),
        (ChainVerdict(5, 2, TokenKind.BONUS), 2**40, "eos", 0.0123456789, 0.000321),
        (ChainVerdict(1, 4, TokenKind.RECOVERED), 30, "length", 0.5, 0.0),
        (ChainVerdict(2, 6, TokenKind.BONUS), 31, "stop", 0.25, 0.125),
    ]
    for verdict, committed, finish, target_seconds, allreduce_seconds in cases:
        outcome = _outcome(verdict, committed, finish, target_seconds, allreduce_seconds)
        message = codec.encode_verdict("req-v", 2**63 + 5, outcome)
        info = codec.parse_verdict(message.SerializeToString())
        assert info == codec.VerdictInfo(
            "req-v", 2**63 + 5, verdict, committed, finish, target_seconds, allreduce_seconds
        )
        assert list(message.accepted_path) == list(range(verdict.num_accepted))


def test_verdicts_name_the_batched_step_that_verified_them() -> None:
    verdict = ChainVerdict(2, 6, TokenKind.BONUS)
    batched = dataclasses.replace(_outcome(verdict, 31), batch_size=12, step_positions=12 * 5)
    info = codec.parse_verdict(codec.encode_verdict("req-b", 3, batched).SerializeToString())
    assert (info.batch_size, info.step_positions) == (12, 60)
    back = info.outcome(Draft(torch.tensor([5, 7, 9, 11]), None), 28)
    assert (back.batch_size, back.step_positions, back.new_tokens) == (12, 60, [5, 7, 6])
    alone = codec.parse_verdict(codec.encode_verdict("req-a", 3, _outcome(verdict, 31)).SerializeToString())
    assert (alone.batch_size, alone.step_positions) == (1, 0)


def test_verdict_logprobs_round_trip_bit_exact_and_must_match_the_tokens() -> None:
    verdict = ChainVerdict(2, 6, TokenKind.BONUS)
    logprobs = (
        TokenLogprob(5, -0.123456789012345, ((5, -0.123456789012345), (8, -2.5))),
        TokenLogprob(7, -1e-300, ()),
        TokenLogprob(6, -30.000000000000004, ((1, -0.5), (6, -30.000000000000004))),
    )
    outcome = dataclasses.replace(_outcome(verdict, 31), new_tokens=[5, 7, 6], logprobs=logprobs)
    info = codec.parse_verdict(codec.encode_verdict("req-l", 3, outcome).SerializeToString())
    assert info.logprobs == logprobs
    back = info.outcome(Draft(torch.tensor([5, 7, 9, 11]), None), 28)
    assert back.new_tokens == [5, 7, 6] and back.logprobs == logprobs
    with pytest.raises(WireError, match="logprobs are for tokens other than"):
        info.outcome(Draft(torch.tensor([5, 8, 9, 11]), None), 28)  # another path: token 8, not 7


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        (pb.TokenLogprob(token=-1, logprob=-1.0), "token"),
        (pb.TokenLogprob(token=1, logprob=0.5), "<= 0"),
        (pb.TokenLogprob(token=1, logprob=float("nan")), "<= 0"),
        (pb.TokenLogprob(token=1, logprob=-1.0, top_tokens=[1, 2], top_logprobs=[-1.0]), "2 top tokens and 1"),
        (pb.TokenLogprob(token=1, logprob=-1.0, top_tokens=[-3], top_logprobs=[-1.0]), "top tokens"),
    ],
)
def test_malformed_verdict_logprobs_are_rejected(entry: pb.TokenLogprob, needle: str) -> None:
    message = pb.Verdict(request_id="r", accepted_path=[0], next_token=3, next_kind=pb.TOKEN_KIND_BONUS)
    message.logprobs.append(entry)
    with pytest.raises(WireError, match=needle):
        codec.parse_verdict(message.SerializeToString())


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"accepted_path": [2, 1]}, "path"),
        ({"accepted_path": [0, 0]}, "path"),
        ({"accepted_path": [-1]}, "path"),
        ({"next_kind": pb.TOKEN_KIND_UNSPECIFIED}, "next_kind"),
        ({"next_kind": 7}, "next_kind"),  # proto3 enums are open: unknown values parse
        ({"next_token": -1}, "next_token"),
        ({"finish_reason": 9}, "finish_reason"),
    ],
)
def test_malformed_verdicts_are_rejected(fields: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {"request_id": "r", "accepted_path": [0], "next_token": 3}
    base["next_kind"] = pb.TOKEN_KIND_BONUS
    message = pb.Verdict(**{**base, **fields})
    with pytest.raises(WireError, match=needle):
        codec.parse_verdict(message.SerializeToString())


# ---------------------------------------------------------------------------------------------
# Huge and out-of-vocabulary ids


@pytest.mark.parametrize("token", [2**31 - 1, VOCAB, VOCAB + 1, -1, -(2**31)])
def test_out_of_vocabulary_draft_ids_are_rejected_naming_the_field(token: int) -> None:
    message = pb.DraftTree(request_id="r", token_ids=[1, token], parents=[-1, 0], rules=pb.RULES_CHAIN)
    with pytest.raises(WireError, match=rf"draft token ids \[{token}\] are outside the vocabulary \[0, {VOCAB}\)"):
        codec.parse_draft(message.SerializeToString(), VOCAB)
    last = pb.DraftTree(token_ids=[VOCAB - 1], parents=[-1], rules=pb.RULES_CHAIN)
    assert codec.parse_draft(last.SerializeToString(), VOCAB)[2].size == 1


@pytest.mark.parametrize("support_id", [2**31 - 1, VOCAB, -1])
def test_out_of_vocabulary_q_support_ids_are_rejected(support_id: int) -> None:
    message = pb.DraftTree(request_id="r", token_ids=[1], parents=[-1], rules=pb.RULES_CHAIN)
    message.draft_probs.add(token_ids=[1, support_id], probs=[0.5, 0.5])
    with pytest.raises(WireError, match="draft distribution 0 has repeated or out-of-vocabulary ids"):
        codec.parse_draft(message.SerializeToString(), VOCAB)


def test_ids_beyond_int32_are_refused_by_the_encoder_with_wire_error() -> None:
    with pytest.raises(WireError, match="token"):
        codec.encode_draft("r", 0, Draft(torch.tensor([1, 2**31]), None))


# ---------------------------------------------------------------------------------------------
# Truncated frames, garbage, oversize


def test_truncated_draft_frames_give_wire_error() -> None:
    q = _sparse_q(torch.float32)
    data = codec.encode_draft("truncated", 1, Draft(_sample_tokens(q), q)).SerializeToString()
    for cut in (1, 3, 12, len(data) // 3, len(data) // 2, len(data) - 5, len(data) - 1):  # inside a field
        with pytest.raises(WireError):
            codec.parse_draft(data[:cut], VOCAB)
    parsed = 0
    for cut in range(len(data)):  # every cut: a WireError or (at a field boundary) a valid shorter tree
        try:
            codec.parse_draft(data[:cut], VOCAB)
            parsed += 1
        except WireError:
            pass
    assert parsed < 8


def test_truncated_verdict_frames_give_wire_error() -> None:
    message = codec.encode_verdict(
        "truncated", 9, _outcome(ChainVerdict(3, 7, TokenKind.BONUS), 100, "eos", 0.25, 0.125)
    )
    data = message.SerializeToString()
    for cut in (1, 2, 5, 6, len(data) - 1):
        with pytest.raises(WireError):
            codec.parse_verdict(data[:cut])
    for cut in range(len(data)):  # a cut at a field boundary is a valid shorter Verdict; nothing but WireError escapes
        with contextlib.suppress(WireError):
            codec.parse_verdict(data[:cut])


def test_random_garbage_gives_wire_error_and_nothing_else() -> None:
    gen = torch.Generator().manual_seed(5)
    errors = 0
    for _ in range(400):
        size = int(torch.randint(1, 200, (1,), generator=gen))
        data = bytes(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).tolist())
        for parse in (lambda d: codec.parse_draft(d, VOCAB), codec.parse_verdict):
            try:
                parse(data)
            except WireError:
                errors += 1
    assert errors > 700  # almost all of the 800 parses fail, and every failure is a WireError


def test_oversize_verdicts_and_q_trees_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _sparse_q(torch.float64)
    draft = Draft(_sample_tokens(q), q)
    data = codec.encode_draft("big", 0, draft).SerializeToString()
    verdict = codec.encode_verdict("v" * 100, 0, _outcome(ChainVerdict(1, 1, TokenKind.BONUS), 5)).SerializeToString()
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(WireError, match="exceeds the 100-byte limit"):
        codec.encode_draft("big", 0, draft)
    with pytest.raises(WireError, match="exceeds"):
        codec.parse_draft(data, VOCAB)
    with pytest.raises(WireError, match="exceeds"):
        codec.parse_verdict(verdict)
    small = codec.encode_verdict("v", 0, _outcome(ChainVerdict(0, 1, TokenKind.BONUS), 1)).SerializeToString()
    assert len(small) <= 100 and codec.parse_verdict(small).request_id == "v"


# ---------------------------------------------------------------------------------------------
# Trees: parents, per-parent q and the child-sampling rule survive the wire; verdict paths are checked


def _tree_with_q(dtype: torch.dtype) -> DraftTree:
    gen = torch.Generator().manual_seed(3)
    parents = (-1, -1, 0, 0, 1, 2)
    tokens = torch.tensor([4, 7, 1, 9, 4, 30])
    rows = torch.rand(len(parents) + 1, VOCAB, generator=gen, dtype=torch.float64)
    rows[:, ::3] = 0  # sparse support
    for i, parent in enumerate(parents):
        rows[parent + 1, tokens[i]] = 0.5  # every child lies in its parent's support
    rows = rows / rows.sum(-1, keepdim=True)
    rows[[4, 5, 6]] = 0  # leaves 3, 4 and 5 have no children: no q
    return DraftTree(tokens, parents, rows.to(dtype))


@pytest.mark.parametrize("sampling", list(ChildSampling))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tree_proposals_round_trip_with_q_bit_exact(sampling: ChildSampling, dtype: torch.dtype) -> None:
    base = _tree_with_q(dtype)
    tree = DraftTree(base.tokens, base.parents, base.child_probs, sampling)
    data = codec.encode_draft("t", 4, tree).SerializeToString()
    request_id, cycle, back = codec.parse_draft(data, VOCAB)
    assert (request_id, cycle) == ("t", 4) and isinstance(back, DraftTree)
    assert back.sampling is sampling and back.parents == tree.parents
    assert torch.equal(back.tokens, tree.tokens)
    assert back.child_probs is not None and tree.child_probs is not None
    assert back.child_probs.dtype == dtype and torch.equal(back.child_probs, tree.child_probs)


def test_deterministic_trees_and_chain_shaped_trees_keep_the_tree_rules() -> None:
    tree = DraftTree(torch.tensor([5, 6, 7]), (-1, -1, 1))
    back = codec.parse_draft(codec.encode_draft("d", 0, tree).SerializeToString(), VOCAB)[2]
    assert isinstance(back, DraftTree) and back.child_probs is None and back.parents == (-1, -1, 1)
    chain = DraftTree.chain(torch.tensor([1, 2]))  # a chain-shaped tree is still verified by the tree rules
    assert isinstance(codec.parse_draft(codec.encode_draft("c", 0, chain).SerializeToString(), VOCAB)[2], DraftTree)
    assert isinstance(
        codec.parse_draft(codec.encode_draft("c", 0, Draft(torch.tensor([1, 2]), None)).SerializeToString(), VOCAB)[2],
        Draft,
    )


def test_siblings_with_different_q_are_rejected() -> None:
    message = codec.encode_draft("s", 0, _tree_with_q(torch.float64))
    message.draft_probs[1].CopyFrom(pb.SparseDistribution(token_ids=[7, 8], probs=[0.5, 0.5]))
    with pytest.raises(WireError, match="siblings share"):
        codec.decode_draft(message, VOCAB)


def test_tree_verdicts_round_trip_and_paths_are_checked_against_the_tree() -> None:
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), (-1, -1, 1, 2))
    verdict = TreeVerdict((1, 2, 3), 11, TokenKind.BONUS)
    info = codec.parse_verdict(codec.encode_verdict("v", 1, _outcome(verdict, 10)).SerializeToString())
    assert info.verdict == verdict
    assert info.outcome(tree, 6).new_tokens == [6, 7, 8, 11]
    assert info.outcome(tree, 8).new_tokens == [6, 7]  # the target cut after two tokens (committed_length 10)
    assert info.outcome(tree, 6).committed_length == 10 and info.outcome(tree, 6).verdict == verdict

    def answer(verdict: ChainVerdict | TreeVerdict, committed_length: int = 10) -> codec.VerdictInfo:
        return codec.VerdictInfo("v", 1, verdict, committed_length)

    assert answer(ChainVerdict(1, 3, TokenKind.RECOVERED), 8).outcome(tree, 6).new_tokens == [5, 3]
    with pytest.raises(WireError, match="not a root path"):  # node 2's parent is 1, not 0
        answer(TreeVerdict((0, 2), 1, TokenKind.BONUS)).outcome(tree, 6)
    with pytest.raises(WireError, match="not a root path"):
        answer(TreeVerdict((1, 2, 3, 4), 1, TokenKind.BONUS)).outcome(tree, 6)
    with pytest.raises(WireError, match="chain"):
        answer(ChainVerdict(3, 1, TokenKind.BONUS)).outcome(Draft(torch.tensor([1, 2]), None), 6)
    with pytest.raises(WireError, match="chain"):
        answer(verdict).outcome(Draft(torch.tensor([1, 2]), None), 6)
    with pytest.raises(WireError, match="committed_length"):  # every verdict commits at least one token
        answer(verdict, 6).outcome(tree, 6)
    with pytest.raises(WireError, match="committed_length"):  # and never more than its path and next token
        answer(verdict, 11).outcome(tree, 6)


def test_verdict_features_travel_with_the_accepted_path_only() -> None:
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), (-1, -1, 1, 2))
    verdict = TreeVerdict((1, 2), 9, TokenKind.RECOVERED)
    features = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)  # root + 2 nodes
    sent = CycleOutcome(verdict, [6, 7, 9], None, 0.1, 13, features)
    info = codec.parse_verdict(codec.encode_verdict("f", 2, sent).SerializeToString())
    back = info.outcome(tree, 10)
    assert back.features is not None and back.features.dtype == torch.bfloat16 and torch.equal(back.features, features)
    assert back == CycleOutcome(verdict, [6, 7, 9], None, 0.1, 13, back.features)
    with pytest.raises(WireError, match="one row per path node"):
        codec.encode_verdict("f", 2, CycleOutcome(verdict, [6, 7, 9], None, 0.1, 13, features[:2]))
