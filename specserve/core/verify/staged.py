"""A cycle's verdict staged on the device, read to the host with a whole batched step's in one copy.

Deciding a verify block takes the exact rules' work on the device (argmaxes, the rejection-sampling draws, keyed
noise, log-probabilities) and then a few numbers on the host: the accepted count or path, the token after it, the
draft's tokens, the probe's greedy tokens. A verifier *stages* its verdict
(:meth:`~specserve.core.target.TargetVerifier.stage`): it runs the device work and leaves those numbers as named
tensors, with a continuation that commits once they are on the host. A batched step
(:func:`~specserve.core.batch_step.verify_batch`) stages every request's, brings all of their tensors over in one
transfer (:func:`read`), and finishes each: one host synchronisation per step instead of one per request (vLLM's
rejection sampler does the same with its ``[batch, max_spec_len + 1]`` output buffer).

Does not decide anything itself, run models or touch caches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")
Host = dict[str, list[Any]]  # a staged verdict's tensors on the host: ints for integer tensors, floats otherwise


@dataclass(frozen=True)
class Staged(Generic[T]):
    """A verdict waiting for the copy: its device tensors by name (any shape), and what to do once they arrive."""

    tensors: Mapping[str, torch.Tensor]
    finish: Callable[[Host], T]

    def complete(self) -> T:
        """Read this verdict's tensors alone (one copy) and finish it: the single-request path."""
        return self.finish(read([self.tensors])[0])


def read(staged: Sequence[Mapping[str, torch.Tensor]]) -> list[Host]:
    """Every staged verdict's tensors in **one** copy to the host, back as nested lists in their own shapes.

    They travel as one float64 vector: exact for every integer below 2**53 (token ids, counts, node indices, flags)
    and for every float32, bfloat16 and float16 value; integer and boolean tensors come back as ``int``."""
    parts: list[torch.Tensor] = []
    for tensors in staged:
        parts += [t.reshape(-1).to(torch.float64) for t in tensors.values()]
    flat: list[float] = torch.cat(parts).tolist() if parts else []
    out: list[Host] = []
    at = 0
    for tensors in staged:
        host: Host = {}
        for name, t in tensors.items():
            values: list[Any] = flat[at : at + t.numel()]
            at += t.numel()
            if not (t.is_floating_point() or t.is_complex()):
                values = [int(v) for v in values]
            host[name] = _shaped(values, tuple(t.shape))
        out.append(host)
    return out


def _shaped(values: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """A flat list in ``shape`` (0-d tensors come back as a one-element list)."""
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_shaped(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
