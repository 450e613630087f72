"""Codec between the engine's types and the v1 wire messages, with validation of everything received.

* tensors travel as dtype + shape + raw bytes (never pickled); :func:`decode_tensor` checks that
  the byte count matches the shape and dtype before viewing the buffer;
* a :class:`~specserve.core.draft.Draft` becomes a ``DraftTree`` whose parents form a chain
  (``rules = RULES_CHAIN``); a :class:`~specserve.core.tree.DraftTree` keeps its parents and
  names how its children were sampled (``RULES_TREE_*``). q travels per node — the distribution that
  node was drawn from, i.e. its parent's children's — sparsely (support + probabilities, as
  doubles, with q's dtype named), which is exact: the support is where the drafter could have
  sampled, and the receiver rebuilds q bit for bit in its original dtype;
* a chain or tree verdict becomes a ``Verdict`` (the accepted path's node indices), with the
  target's features of the root and the accepted path when the drafter reads hidden states
  (EAGLE, Medusa): only the accepted path's features travel, never the rejected branches'.

Malformed input raises :class:`WireError` with a message naming the offending field; a server
turns that into a gRPC ``INVALID_ARGUMENT`` status instead of crashing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError

from specserve.core.draft import Draft
from specserve.core.errors import UserError
from specserve.core.tree import ChildSampling, DraftTree, InvalidTree
from specserve.core.tree_verification import TreeVerdict
from specserve.core.verification import ChainVerdict, TokenKind
from specserve.rpc.gen import speculation_pb2 as pb

M = TypeVar("M", pb.DraftTree, pb.Verdict)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # gRPC's default is 4 MiB: servers and channels set this explicitly
PROB_SUM_TOLERANCE = 1e-3  # widened to the dtype's epsilon for q computed in bfloat16 / float16
INT32_MAX = 2**31 - 1

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_KIND_TO_WIRE = {TokenKind.RECOVERED: pb.TOKEN_KIND_RECOVERED, TokenKind.BONUS: pb.TOKEN_KIND_BONUS}
_KIND_FROM_WIRE = {v: k for k, v in _KIND_TO_WIRE.items()}
_RULES_TO_WIRE = {
    ChildSampling.IID: pb.RULES_TREE_IID,
    ChildSampling.WITHOUT_REPLACEMENT: pb.RULES_TREE_WITHOUT_REPLACEMENT,
}
_RULES_FROM_WIRE = {v: k for k, v in _RULES_TO_WIRE.items()}


class WireError(UserError):
    """A message from the wire is malformed or too large; the message names the field."""


# ---------------------------------------------------------------------------------------------
# Tensors


def encode_tensor(tensor: torch.Tensor) -> pb.Tensor:
    if tensor.dtype not in _DTYPE_NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot travel; use one of {', '.join(WIRE_DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return pb.Tensor(dtype=_DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape), data=data)


def decode_tensor(message: pb.Tensor) -> torch.Tensor:
    dtype = WIRE_DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"tensor dtype {message.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    shape = list(message.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} has a negative dimension")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = math.prod(shape)
    if numel * itemsize != len(message.data):
        raise WireError(f"tensor of shape {shape} and dtype {message.dtype} needs {numel * itemsize} bytes, got "
                        f"{len(message.data)}")  # fmt: skip
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Drafts


def encode_draft(request_id: str, cycle: int, draft: Draft | DraftTree) -> pb.DraftTree:
    """A chain draft (verified by the chain rules) or a draft tree (tree rules) as a wire message."""
    if isinstance(draft, Draft):
        tokens, parents, probs = draft.tokens.tolist(), list(range(-1, draft.gamma - 1)), draft.draft_probs
        rules = pb.RULES_CHAIN
    else:
        tree = draft
        tokens, parents, rules = tree.tokens.tolist(), list(tree.parents), _RULES_TO_WIRE[draft.sampling]
        # per node: the q it was drawn from = its parent's children's distribution
        probs = tree.child_probs[[p + 1 for p in tree.parents]] if tree.child_probs is not None else None
    if any(not 0 <= t <= INT32_MAX for t in tokens):
        raise WireError(
            f"draft token_ids must be in [0, 2**31); got {[t for t in tokens if not 0 <= t <= INT32_MAX][:5]}"
        )
    message = pb.DraftTree(request_id=request_id, cycle=cycle, token_ids=tokens, parents=parents, rules=rules)
    if probs is not None:
        probs = probs.detach().cpu()
        if probs.dtype not in _DTYPE_NAMES or not probs.dtype.is_floating_point:
            raise WireError(f"draft probabilities of dtype {probs.dtype} cannot travel")
        message.draft_probs_dtype = _DTYPE_NAMES[probs.dtype]
        for row in probs:
            support = torch.nonzero(row > 0).flatten()
            # float64 holds every float32 / bfloat16 / float16 value exactly: q arrives bit-exact.
            message.draft_probs.add(token_ids=support.tolist(), probs=row[support].double().tolist())
    _check_size(message)
    return message


def decode_draft(message: pb.DraftTree, vocab_size: int, device: torch.device | str = "cpu") -> Draft | DraftTree:
    """Validate a received message: a chain draft with dense q rows (or none) under the chain rules, a
    :class:`~specserve.core.tree.DraftTree` under the tree rules."""
    nodes = len(message.token_ids)
    if len(message.parents) != nodes:
        raise WireError(f"draft tree has {nodes} tokens but {len(message.parents)} parents")
    if message.rules == pb.RULES_CHAIN:
        if list(message.parents) != list(range(-1, nodes - 1)):
            raise WireError("a draft sent under the chain rules must be a chain (parents -1, 0, 1, ...)")
    elif message.rules not in _RULES_FROM_WIRE:
        raise WireError(f"draft tree names unknown verification rules {message.rules}")
    bad = [t for t in message.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise WireError(f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    tokens = torch.tensor(list(message.token_ids), dtype=torch.long, device=device)
    probs = _decode_probs(message, vocab_size)
    if message.rules == pb.RULES_CHAIN:
        return Draft(tokens, probs.to(device) if probs is not None else None)
    sampling = _RULES_FROM_WIRE[message.rules]
    try:
        tree = DraftTree(tokens, tuple(int(p) for p in message.parents), sampling=sampling)
    except InvalidTree as exc:
        raise WireError(f"malformed draft tree: {exc}") from exc
    if probs is not None:
        tree = DraftTree(tokens, tree.parents, _child_probs(tree, probs).to(device), sampling)
    return tree


def _decode_probs(message: pb.DraftTree, vocab_size: int) -> torch.Tensor | None:
    """Per node, the dense q it was drawn from (in q's own dtype), validated; ``None`` when no q was sent."""
    nodes = len(message.token_ids)
    if not message.draft_probs:
        return None
    if len(message.draft_probs) != nodes:
        raise WireError(f"draft tree has {nodes} tokens but {len(message.draft_probs)} draft distributions")
    dtype = WIRE_DTYPES.get(message.draft_probs_dtype or "float32")
    if dtype is None or not dtype.is_floating_point:
        raise WireError(f"draft_probs_dtype {message.draft_probs_dtype!r} is not a floating-point dtype")
    dense = torch.zeros(nodes, vocab_size, dtype=torch.float64)
    # Each q value is rounded to its dtype, so a row sums to 1 only within the dtype's epsilon.
    tolerance = max(PROB_SUM_TOLERANCE, torch.finfo(dtype).eps)
    for i, dist in enumerate(message.draft_probs):
        ids = torch.tensor(dist.token_ids, dtype=torch.long)
        probs = torch.tensor(dist.probs, dtype=torch.float64)
        if ids.numel() != probs.numel() or not ids.numel():
            raise WireError(f"draft distribution {i} has {ids.numel()} ids and {probs.numel()} probabilities")
        if bool(((ids < 0) | (ids >= vocab_size)).any()) or ids.unique().numel() != ids.numel():
            raise WireError(f"draft distribution {i} has repeated or out-of-vocabulary ids")
        total = float(probs.sum())
        if not bool(torch.isfinite(probs).all() & (probs >= 0).all()) or abs(total - 1.0) > tolerance:
            raise WireError(f"draft distribution {i} is not a probability distribution (sum {total:.6f})")
        dense[i, ids] = probs
        if dense[i, message.token_ids[i]] <= 0:
            raise WireError(f"draft token {message.token_ids[i]} at node {i} has zero probability under its q")
    return dense.to(dtype)


def _child_probs(tree: DraftTree, node_probs: torch.Tensor) -> torch.Tensor:
    """Per-node q rows -> the tree's per-parent rows (siblings must agree; childless parents get zeros)."""
    rows = node_probs.new_zeros(tree.size + 1, node_probs.shape[1])
    for parent, children in enumerate(tree.children):
        if children:
            first = node_probs[children[0]]
            if any(not torch.equal(node_probs[c], first) for c in children[1:]):
                raise WireError(f"the children of node {parent - 1} carry different q; siblings share their parent's q")
            rows[parent] = first
    return rows


def parse_draft(data: bytes, vocab_size: int, device: torch.device | str = "cpu") -> tuple[str, int, Draft | DraftTree]:
    """Bytes from the wire -> (request id, cycle, chain draft or tree proposal)."""
    message = _parse(pb.DraftTree, data)
    return message.request_id, int(message.cycle), decode_draft(message, vocab_size, device)


# ---------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class VerdictInfo:
    """A decoded ``Verdict``: the rules' decision plus what the drafter needs to continue."""

    request_id: str
    cycle: int
    verdict: ChainVerdict | TreeVerdict  # a chain verdict whenever the path is 0, 1, 2, ...
    committed_length: int
    finished: bool
    target_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    features: torch.Tensor | None = None  # hidden-state drafters: root + accepted path, one row each


def encode_verdict(
    request_id: str,
    cycle: int,
    verdict: ChainVerdict | TreeVerdict,
    committed_length: int,
    finished: bool,
    target_seconds: float = 0.0,
    allreduce_seconds: float = 0.0,
    features: torch.Tensor | None = None,
) -> pb.Verdict:
    path = list(verdict.accepted) if isinstance(verdict, TreeVerdict) else list(range(verdict.num_accepted))
    if features is not None and features.shape[0] != len(path) + 1:
        raise WireError(f"a verdict's features need one row per path node plus the root, got {features.shape[0]}")
    message = pb.Verdict(
        request_id=request_id,
        cycle=cycle,
        accepted_path=path,
        next_token=verdict.next_token,
        next_kind=_KIND_TO_WIRE[verdict.next_kind],
        committed_length=committed_length,
        finished=finished,
        target_seconds=target_seconds,
        allreduce_seconds=allreduce_seconds,
    )
    if features is not None:
        message.features.CopyFrom(encode_tensor(features))
    _check_size(message)
    return message


def decode_verdict(message: pb.Verdict) -> ChainVerdict | TreeVerdict:
    """A chain verdict when the path is 0, 1, 2, ... (how chains are answered), else a tree verdict whose
    path the drafter checks against the tree it sent (:func:`accepted_tokens`)."""
    path = [int(node) for node in message.accepted_path]
    if any(node < 0 for node in path) or any(b <= a for a, b in itertools.pairwise(path)):
        raise WireError(f"verdict path {path[:8]} must hold increasing node indices >= 0")
    kind = _KIND_FROM_WIRE.get(message.next_kind)
    if kind is None:
        raise WireError(f"verdict has no valid next_kind (got {message.next_kind})")
    if message.next_token < 0:
        raise WireError(f"verdict next_token {message.next_token} is negative")
    if path == list(range(len(path))):
        return ChainVerdict(len(path), int(message.next_token), kind)
    return TreeVerdict(tuple(path), int(message.next_token), kind)


def accepted_tokens(sent: Draft | DraftTree, verdict: ChainVerdict | TreeVerdict) -> list[int]:
    """The tokens a verdict commits (accepted path + next token), checked against the draft that was sent."""
    if isinstance(sent, Draft):
        if isinstance(verdict, TreeVerdict) or verdict.num_accepted > sent.gamma:
            raise WireError(f"the verdict accepts {verdict.num_accepted} tokens of a {sent.gamma}-token chain")
        return [*sent.tokens[: verdict.num_accepted].tolist(), verdict.next_token]
    tree = sent
    path = list(verdict.accepted) if isinstance(verdict, TreeVerdict) else list(range(verdict.num_accepted))
    expected = -1
    for node in path:
        if node >= tree.size or tree.parents[node] != expected:
            raise WireError(f"the verdict's path {path} is not a root path of the {tree.size}-node tree sent")
        expected = node
    return [*(int(tree.tokens[node]) for node in path), verdict.next_token]


def parse_verdict(data: bytes) -> VerdictInfo:
    """Bytes from the wire -> a validated :class:`VerdictInfo`."""
    message = _parse(pb.Verdict, data)
    features = None
    if message.HasField("features"):
        features = decode_tensor(message.features)
        if features.dim() != 2 or features.shape[0] != len(message.accepted_path) + 1:
            raise WireError(
                f"verdict features of shape {list(features.shape)} must be [path length + 1, width] "
                f"(path length {len(message.accepted_path)})"
            )
        if not features.is_floating_point():
            raise WireError(f"verdict features must be floating point, got {features.dtype}")
    return VerdictInfo(
        request_id=message.request_id,
        cycle=int(message.cycle),
        verdict=decode_verdict(message),
        committed_length=int(message.committed_length),
        finished=bool(message.finished),
        target_seconds=float(message.target_seconds),
        allreduce_seconds=float(message.allreduce_seconds),
        features=features,
    )


def _parse(kind: type[M], data: bytes) -> M:
    """Size check, then protobuf decoding; both failures become :class:`WireError`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return kind.FromString(data)
    except DecodeError as exc:
        raise WireError(f"malformed {kind.__name__}: {exc}") from exc


def _check_size(message: pb.DraftTree | pb.Verdict) -> None:
    size = message.ByteSize()
    if size > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
