"""Codec between the engine's types and the v1 wire messages, with validation of everything received.

* tensors travel as dtype + shape + raw bytes (never pickled); :func:`decode_tensor` checks that
  the byte count matches the shape and dtype before viewing the buffer;
* a :class:`~specserve.core.draft.Draft` becomes a ``DraftTree`` whose parents form a chain; its
  dense q rows travel sparsely (the support and its probabilities, as doubles, with q's dtype
  named), which is exact: the support is where the drafter could have sampled, and the receiver
  rebuilds q bit for bit in its original dtype;
* a :class:`~specserve.core.verification.ChainVerdict` becomes a ``Verdict``.

Malformed input raises :class:`WireError` with a message naming the offending field; a server
turns that into a gRPC ``INVALID_ARGUMENT`` status instead of crashing. Trees with branches are
rejected until tree verification exists (issue 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError

from specserve.core.draft import Draft
from specserve.core.errors import UserError
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


def encode_draft(request_id: str, cycle: int, draft: Draft) -> pb.DraftTree:
    tokens = draft.tokens.tolist()
    if any(not 0 <= t <= INT32_MAX for t in tokens):
        raise WireError(
            f"draft token_ids must be in [0, 2**31); got {[t for t in tokens if not 0 <= t <= INT32_MAX][:5]}"
        )
    message = pb.DraftTree(
        request_id=request_id, cycle=cycle, token_ids=tokens, parents=list(range(-1, len(tokens) - 1))
    )
    if draft.draft_probs is not None:
        probs = draft.draft_probs.detach().cpu()
        if probs.dtype not in _DTYPE_NAMES or not probs.dtype.is_floating_point:
            raise WireError(f"draft probabilities of dtype {probs.dtype} cannot travel")
        message.draft_probs_dtype = _DTYPE_NAMES[probs.dtype]
        for row in probs:
            support = torch.nonzero(row > 0).flatten()
            # float64 holds every float32 / bfloat16 / float16 value exactly: q arrives bit-exact.
            message.draft_probs.add(token_ids=support.tolist(), probs=row[support].double().tolist())
    _check_size(message)
    return message


def decode_draft(message: pb.DraftTree, vocab_size: int, device: torch.device | str = "cpu") -> Draft:
    """Validate a received tree and turn it into a chain draft with dense q rows (or none)."""
    nodes = len(message.token_ids)
    if len(message.parents) != nodes:
        raise WireError(f"draft tree has {nodes} tokens but {len(message.parents)} parents")
    if list(message.parents) != list(range(-1, nodes - 1)):
        raise WireError("draft tree is not a chain (parents must be -1, 0, 1, ...); trees arrive with issue 5")
    bad = [t for t in message.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise WireError(f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    tokens = torch.tensor(list(message.token_ids), dtype=torch.long, device=device)
    if not message.draft_probs:
        return Draft(tokens, None)
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
    dense = dense.to(dtype)
    return Draft(tokens, dense.to(device))


def parse_draft(data: bytes, vocab_size: int, device: torch.device | str = "cpu") -> tuple[str, int, Draft]:
    """Bytes from the wire -> (request id, cycle, draft)."""
    message = _parse(pb.DraftTree, data)
    return message.request_id, int(message.cycle), decode_draft(message, vocab_size, device)


# ---------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class VerdictInfo:
    """A decoded ``Verdict``: the rules' decision plus what the drafter needs to continue."""

    request_id: str
    cycle: int
    verdict: ChainVerdict
    committed_length: int
    finished: bool
    target_seconds: float = 0.0
    allreduce_seconds: float = 0.0


def encode_verdict(
    request_id: str,
    cycle: int,
    verdict: ChainVerdict,
    committed_length: int,
    finished: bool,
    target_seconds: float = 0.0,
    allreduce_seconds: float = 0.0,
) -> pb.Verdict:
    return pb.Verdict(
        request_id=request_id,
        cycle=cycle,
        accepted_path=list(range(verdict.num_accepted)),
        next_token=verdict.next_token,
        next_kind=_KIND_TO_WIRE[verdict.next_kind],
        committed_length=committed_length,
        finished=finished,
        target_seconds=target_seconds,
        allreduce_seconds=allreduce_seconds,
    )


def decode_verdict(message: pb.Verdict) -> ChainVerdict:
    path = list(message.accepted_path)
    if path != list(range(len(path))):
        raise WireError(f"verdict path {path[:8]} is not a chain prefix 0, 1, 2, ...")
    kind = _KIND_FROM_WIRE.get(message.next_kind)
    if kind is None:
        raise WireError(f"verdict has no valid next_kind (got {message.next_kind})")
    if message.next_token < 0:
        raise WireError(f"verdict next_token {message.next_token} is negative")
    return ChainVerdict(len(path), int(message.next_token), kind)


def parse_verdict(data: bytes) -> VerdictInfo:
    """Bytes from the wire -> a validated :class:`VerdictInfo`."""
    message = _parse(pb.Verdict, data)
    return VerdictInfo(
        request_id=message.request_id,
        cycle=int(message.cycle),
        verdict=decode_verdict(message),
        committed_length=int(message.committed_length),
        finished=bool(message.finished),
        target_seconds=float(message.target_seconds),
        allreduce_seconds=float(message.allreduce_seconds),
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
