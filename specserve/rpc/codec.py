"""Codec between the engine's types and the v1 wire messages, with validation of everything received.

* tensors travel as dtype + shape + raw bytes (never pickled); :func:`decode_tensor` checks that
  the byte count matches the shape and dtype before viewing the buffer;
* a proposal (:data:`~specserve.core.draft.drafter.Proposal`: a chain or a tree, through their one
  interface) becomes a ``DraftTree`` message: its nodes' tokens and parents, the rules that
  verify it (``RULES_CHAIN`` for a :class:`~specserve.core.draft.drafter.Draft`, ``RULES_TREE_*`` for a
  :class:`~specserve.core.tree.draft_tree.DraftTree` by how its children were sampled), and per node the q
  it was drawn from, sparsely (support + probabilities, as doubles, with q's dtype named), which
  is exact: the support is where the drafter could have sampled, and the receiver rebuilds q bit
  for bit in its original dtype; and a probe's nodes (Lookahead's window), when the proposal has one;
* the target's :class:`~specserve.core.target.CycleOutcome` becomes a ``Verdict``: the accepted
  path's node indices, the next token, the committed length, the finish reason (an enum: the
  drafter's side never guesses it), and the target's features of the root and the accepted path
  when the drafter reads hidden states (EAGLE, Medusa): never the rejected branches'; and the
  target's greedy token after each probe node when the proposal had a probe. The
  receiver matches it with the proposal it answers (:meth:`VerdictInfo.outcome`) to get the same
  outcome back.

Malformed input raises :class:`WireError` with a message naming the offending field; a server
turns that into a gRPC ``INVALID_ARGUMENT`` status instead of crashing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError

from specserve.core.draft.drafter import Proposal, proposal_from_nodes
from specserve.core.draft.spec_strings import MAX_PROBE_NODES
from specserve.core.errors import UserError
from specserve.core.target import CycleOutcome, FinishReason, Verdict
from specserve.core.tree.draft_tree import DraftTree, VerifyRules
from specserve.core.tree.shapes import InvalidTree
from specserve.core.verify.chain import ChainVerdict, TokenKind
from specserve.core.verify.logprobs import TokenLogprob
from specserve.core.verify.tree import TreeVerdict
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
    VerifyRules.CHAIN: pb.RULES_CHAIN,
    VerifyRules.TREE_IID: pb.RULES_TREE_IID,
    VerifyRules.TREE_WITHOUT_REPLACEMENT: pb.RULES_TREE_WITHOUT_REPLACEMENT,
}
_RULES_FROM_WIRE = {v: k for k, v in _RULES_TO_WIRE.items()}
_FINISH_TO_WIRE: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "eos": pb.FINISH_REASON_EOS,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
}
_FINISH_FROM_WIRE = {v: k for k, v in _FINISH_TO_WIRE.items()}


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


def encode_draft(request_id: str, cycle: int, proposal: Proposal) -> pb.DraftTree:
    """A proposal as a wire message: its nodes, the rules that verify it, and per node the q it was drawn from."""
    tokens = proposal.tokens.tolist()
    if any(not 0 <= t <= INT32_MAX for t in tokens):
        raise WireError(
            f"draft token_ids must be in [0, 2**31); got {[t for t in tokens if not 0 <= t <= INT32_MAX][:5]}"
        )
    message = pb.DraftTree(
        request_id=request_id,
        cycle=cycle,
        token_ids=tokens,
        parents=list(proposal.parents),
        rules=_RULES_TO_WIRE[proposal.rules],
    )
    if proposal.probe is not None:
        probe = proposal.probe.tokens.tolist()
        if any(not 0 <= t <= INT32_MAX for t in probe):
            raise WireError(f"probe token_ids must be in [0, 2**31); got {probe[:5]}")
        message.probe_token_ids.extend(probe)
        message.probe_parents.extend(proposal.probe.parents)
    probs = proposal.node_probs
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


def decode_draft(message: pb.DraftTree, vocab_size: int, device: torch.device | str = "cpu") -> Proposal:
    """Validate a received message: a chain :class:`~specserve.core.draft.drafter.Draft` under the chain rules, a
    :class:`~specserve.core.tree.draft_tree.DraftTree` under the tree rules, with q rebuilt bit for bit (or none)."""
    nodes = len(message.token_ids)
    if len(message.parents) != nodes:
        raise WireError(f"draft tree has {nodes} tokens but {len(message.parents)} parents")
    if message.rules == pb.RULES_UNSPECIFIED:
        raise WireError("draft tree names no verification rules (RULES_UNSPECIFIED); send RULES_CHAIN or a tree rule")
    rules = _RULES_FROM_WIRE.get(message.rules)
    if rules is None:
        raise WireError(f"draft tree names unknown verification rules {message.rules}")
    bad = [t for t in message.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise WireError(f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    tokens = torch.tensor(list(message.token_ids), dtype=torch.long)
    probs = _decode_probs(message, vocab_size)
    try:
        proposal = proposal_from_nodes(tokens, tuple(int(p) for p in message.parents), probs, rules)
        probe = _decode_probe(message, vocab_size)
    except InvalidTree as exc:
        raise WireError(f"malformed draft tree: {exc}") from exc
    if probe is not None:
        proposal = dataclasses.replace(proposal, probe=probe)
    return proposal.to(device)


def _decode_probe(message: pb.DraftTree, vocab_size: int) -> DraftTree | None:
    """The probe nodes sent with a draft (``None`` when there are none), validated like the draft's."""
    if len(message.probe_parents) != len(message.probe_token_ids):
        raise WireError(f"probe has {len(message.probe_token_ids)} tokens but {len(message.probe_parents)} parents")
    if not message.probe_token_ids:
        return None
    if len(message.probe_token_ids) > MAX_PROBE_NODES:
        raise WireError(f"probe of {len(message.probe_token_ids)} nodes exceeds the limit of {MAX_PROBE_NODES}")
    bad = [t for t in message.probe_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise WireError(f"probe token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    tokens = torch.tensor(list(message.probe_token_ids), dtype=torch.long)
    return DraftTree(tokens, tuple(int(p) for p in message.probe_parents))


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


def parse_draft(data: bytes, vocab_size: int, device: torch.device | str = "cpu") -> tuple[str, int, Proposal]:
    """Bytes from the wire -> (request id, cycle, chain or tree proposal)."""
    message = _parse(pb.DraftTree, data)
    return message.request_id, int(message.cycle), decode_draft(message, vocab_size, device)


# ---------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class VerdictInfo:
    """A decoded ``Verdict``: the rules' decision and what the target committed, before it is matched with the
    proposal it answers (:meth:`outcome`)."""

    request_id: str
    cycle: int
    verdict: Verdict  # a chain verdict whenever the path is 0, 1, 2, ...
    committed_length: int
    finish: FinishReason | None = None  # None while the request runs on
    target_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    features: torch.Tensor | None = None  # hidden-state drafters: root + accepted path, one row each
    batch_size: int = 1  # requests in the target forward that verified it
    step_positions: int = 0  # positions that forward computed; 0 = this proposal's alone
    probe_argmax: tuple[int, ...] = ()  # the target's greedy token after each probe node
    logprobs: tuple[TokenLogprob, ...] = ()  # one per committed token when the request asked for them

    def outcome(self, sent: Proposal, committed: int) -> CycleOutcome:
        """The target's :class:`~specserve.core.target.CycleOutcome` for ``sent``, given ``committed`` tokens before
        it: the verdict's path is checked against the proposal, and the new tokens are cut where the target cut."""
        try:
            tokens = sent.committed_by(self.verdict)
        except InvalidTree as exc:
            raise WireError(str(exc)) from exc
        count = self.committed_length - committed
        if not 1 <= count <= len(tokens):
            raise WireError(
                f"verdict committed_length {self.committed_length} does not follow {committed} committed tokens "
                f"and a path of {len(tokens) - 1}"
            )
        probe_size = sent.probe.size if sent.probe is not None else 0
        if len(self.probe_argmax) not in (0, probe_size):
            raise WireError(f"verdict has {len(self.probe_argmax)} probe tokens for a probe of {probe_size} nodes")
        if self.logprobs and [entry.token for entry in self.logprobs] != tokens[:count]:
            raise WireError(f"verdict logprobs are for tokens other than the {count} it committed")
        return CycleOutcome(
            self.verdict,
            tokens[:count],
            self.finish,
            self.target_seconds,
            self.committed_length,
            self.features,
            self.allreduce_seconds,
            self.batch_size,
            self.step_positions,
            self.probe_argmax,
            self.logprobs,
        )


def encode_verdict(request_id: str, cycle: int, outcome: CycleOutcome) -> pb.Verdict:
    """The target's outcome of one cycle as a ``Verdict``: the path, the next token, what was committed and why
    the request ended (if it did); the new tokens themselves the drafter rebuilds from the proposal it sent."""
    verdict, features = outcome.verdict, outcome.features
    path = list(verdict.accepted)
    if features is not None and features.shape[0] != len(path) + 1:
        raise WireError(f"a verdict's features need one row per path node plus the root, got {features.shape[0]}")
    message = pb.Verdict(
        request_id=request_id,
        cycle=cycle,
        accepted_path=path,
        next_token=verdict.next_token,
        next_kind=_KIND_TO_WIRE[verdict.next_kind],
        committed_length=outcome.committed_length,
        finish_reason=_FINISH_TO_WIRE[outcome.finish],
        target_seconds=outcome.verify_seconds,
        allreduce_seconds=outcome.allreduce_seconds,
        batch_size=outcome.batch_size,
        step_positions=outcome.step_positions,
        probe_argmax=list(outcome.probe_argmax),
        logprobs=[
            pb.TokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                top_tokens=[token for token, _ in entry.top],
                top_logprobs=[logprob for _, logprob in entry.top],
            )
            for entry in outcome.logprobs
        ],
    )
    if features is not None:
        message.features.CopyFrom(encode_tensor(features))
    _check_size(message)
    return message


def decode_verdict(message: pb.Verdict) -> Verdict:
    """A chain verdict when the path is 0, 1, 2, ... (how chains are answered), else a tree verdict whose
    path the drafter checks against the tree it sent (:meth:`VerdictInfo.outcome`)."""
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
    if message.finish_reason not in _FINISH_FROM_WIRE:
        raise WireError(f"verdict has an unknown finish_reason {message.finish_reason}")
    return VerdictInfo(
        request_id=message.request_id,
        cycle=int(message.cycle),
        verdict=decode_verdict(message),
        committed_length=int(message.committed_length),
        finish=_FINISH_FROM_WIRE[message.finish_reason],
        target_seconds=float(message.target_seconds),
        allreduce_seconds=float(message.allreduce_seconds),
        features=features,
        batch_size=max(1, int(message.batch_size)),  # 0: a target that does not batch
        step_positions=int(message.step_positions),
        probe_argmax=tuple(_check_tokens(message.probe_argmax, "verdict probe_argmax")),
        logprobs=tuple(_decode_logprob(entry) for entry in message.logprobs),
    )


def _decode_logprob(entry: pb.TokenLogprob) -> TokenLogprob:
    (token,) = _check_tokens([entry.token], "a verdict logprob's token")
    tops = _check_tokens(entry.top_tokens, "a verdict logprob's top tokens")
    if len(tops) != len(entry.top_logprobs):
        raise WireError(f"a verdict logprob has {len(tops)} top tokens and {len(entry.top_logprobs)} top logprobs")
    values = [float(entry.logprob), *(float(v) for v in entry.top_logprobs)]
    if any(math.isnan(v) or v > 0 for v in values):
        raise WireError("verdict logprobs must be numbers <= 0")
    return TokenLogprob(token, values[0], tuple(zip(tops, values[1:], strict=True)))


def _check_tokens(tokens: Iterable[int], field: str) -> list[int]:
    ids = [int(t) for t in tokens]
    if any(t < 0 for t in ids):
        raise WireError(f"{field} holds negative token ids {[t for t in ids if t < 0][:5]}")
    return ids


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
