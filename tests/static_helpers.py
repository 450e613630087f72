"""Test helpers for the static-shape engine: a CPU stand-in for CUDA graphs and the buckets the tests pad to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from specserve.core.model.buckets import VerifyBuckets

BUCKETS = VerifyBuckets((1, 2, 4, 8, 16))


class RecordingGraphs:
    """A graph backend for the CPU with a CUDA graph's contract: a capture records the step's tensor operations once
    (``make_fx``: every Python value the step reads is baked in, every tensor it reads or writes — the inputs, the KV
    slots — is held by reference), and a replay runs that recording, writing the outputs fixed at capture. A step
    that read Python state a replay cannot see (a length, a width) would go wrong here as on a GPU. Counts captures
    and replays."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.captures = 0
        self.replays = 0

    def capture(self, run: Callable[[], Sequence[torch.Tensor]]) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        self.captures += 1
        recording = make_fx(lambda: tuple(run()), tracing_mode="real")()
        outputs = tuple(t.clone() for t in recording())

        def replay() -> None:
            self.replays += 1
            for static, new in zip(outputs, recording(), strict=True):
                static.copy_(new)

        return replay, outputs
