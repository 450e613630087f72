"""Wire codec: round trips of every message, and clear errors for malformed, truncated or oversize input."""

from __future__ import annotations

import pytest
import torch

from specserve.core.draft import Draft
from specserve.core.sampling import SamplingParams, warp_probs
from specserve.core.verification import ChainVerdict, TokenKind
from specserve.rpc import codec
from specserve.rpc.codec import WireError
from specserve.rpc.gen import speculation_pb2 as pb

VOCAB = 50


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
        message = codec.encode_verdict("r", 3, verdict, committed_length=120, finished=False)
        back = pb.Verdict.FromString(message.SerializeToString())
        assert codec.decode_verdict(back) == verdict and back.committed_length == 120


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda m: m.parents.append(3), "parents"),
        (lambda m: m.parents.__setitem__(1, -1), "not a chain"),
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
    message = pb.DraftTree(request_id="r", token_ids=[1], parents=[-1])
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
