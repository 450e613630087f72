"""Captured forwards: record a step once per key as a CUDA graph, then replay it with new inputs.

A small model's decode step on a GPU is bound by kernel launches, not arithmetic: replaying a captured graph
launches the whole forward at once. :class:`GraphCache` keeps one captured graph per key (a static-shape
engine's key is its slot, bucket width and outputs: :mod:`specserve.core.static.slots`). A graph reads its
inputs from, and writes its outputs to, tensors fixed at capture, so a call copies the new inputs into the
captured ones, replays, and hands back the captured outputs — which the next replay of that key overwrites, so
a caller keeps what it needs by copying it.

Everything that is not a graph falls back to running the step eagerly, never to an error: no backend (a CPU,
or ``--no-cuda-graphs``), a key whose capture failed (its reason is logged once and kept in
:attr:`GraphCache.failures`), inputs shaped unlike the captured ones, or more keys than ``limit``. The capture
itself is behind :class:`GraphBackend`, so the bookkeeping runs on a CPU with a stand-in backend in the tests.
Knows nothing of models or caches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

GRAPH_LIMIT = 64
"""Keys captured at most per cache (a graph holds its own activations in a shared memory pool)."""

WARMUP_RUNS = 2
"""Eager runs before a capture, on a side stream: lazy initialisations (cuBLAS handles, autotuning) must not
happen inside the capture."""

Step = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


class GraphBackend(Protocol):
    """Records a step and replays it."""

    def capture(self, run: Callable[[], Sequence[torch.Tensor]]) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        """Record ``run`` (which reads the static inputs it closes over and may write state, as a replay will);
        return the replay and the static outputs every replay writes."""
        ...


class CudaGraphs:
    """The real backend: ``torch.cuda.CUDAGraph``, warmed up on a side stream, every graph in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self.pool: Any = None  # the pool handle of the first graph, shared by the rest

    def capture(self, run: Callable[[], Sequence[torch.Tensor]]) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = tuple(run())
        self.pool = graph.pool()
        return graph.replay, outputs


@dataclass
class _Graph:
    inputs: tuple[torch.Tensor, ...]
    replay: Callable[[], None]
    outputs: tuple[torch.Tensor, ...]
    replays: int = 0


@dataclass
class GraphCache:
    """One captured graph per key; eager runs wherever a graph cannot serve (see the module docstring)."""

    backend: GraphBackend | None
    limit: int = GRAPH_LIMIT
    failures: dict[Hashable, str] = field(default_factory=dict)  # key -> why its capture failed
    eager_runs: int = 0  # calls that ran eagerly although a backend was there (failures, shapes, the limit)
    _graphs: dict[Hashable, _Graph] = field(default_factory=dict)

    @property
    def keys(self) -> list[Hashable]:
        """The keys captured so far, in capture order."""
        return list(self._graphs)

    def replays(self, key: Hashable) -> int:
        graph = self._graphs.get(key)
        return 0 if graph is None else graph.replays

    def run(self, key: Hashable, step: Step, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``step(inputs)``, from the key's graph when there is (or can now be) one. The outputs of a replay are the
        graph's own tensors: valid until the next call with this key."""
        if self.backend is None:
            return tuple(step(inputs))
        graph = self._graphs.get(key)
        if graph is None:
            if key in self.failures or len(self._graphs) >= self.limit:
                self.eager_runs += 1
                return tuple(step(inputs))
            graph = self._capture(key, step, inputs)
            if graph is None:
                self.eager_runs += 1
                return tuple(step(inputs))
        if any(s.shape != t.shape or s.dtype != t.dtype for s, t in zip(graph.inputs, inputs, strict=True)):
            self.eager_runs += 1
            return tuple(step(inputs))
        for static, value in zip(graph.inputs, inputs, strict=True):
            static.copy_(value, non_blocking=True)
        graph.replay()
        graph.replays += 1
        return graph.outputs

    def _capture(self, key: Hashable, step: Step, inputs: Sequence[torch.Tensor]) -> _Graph | None:
        assert self.backend is not None
        static = tuple(t.clone() for t in inputs)
        try:
            replay, outputs = self.backend.capture(lambda: step(static))
        except Exception as exc:  # any failure to capture costs speed, never the request
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            self.failures[key] = reason
            logger.warning("could not capture a graph for %s (running it eagerly): %s", key, reason)
            return None
        graph = self._graphs[key] = _Graph(static, replay, outputs)
        return graph
