"""Replica configurations shared by the actor tests, and the greedy reference they compare with."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import EOS_ID, TinyPair, hf_greedy_ids

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig


@dataclass(frozen=True)
class Case:
    family: str
    tp: int
    draft: str  # "ngram" or "model"
    placement: str
    overlap: bool


def config_for(case: Case, models: Path, **overrides: Any) -> ReplicaConfig:
    draft = str(models / "draft") if case.draft == "model" else case.draft
    return ReplicaConfig(
        target=str(models / "target"),
        draft=draft,
        dtype="float64",
        tp_degree=case.tp,
        drafter_placement=case.placement,  # type: ignore[arg-type]
        overlap=case.overlap,
        **overrides,
    )


# transformers' greedy continuations, by (id of the model, prompt, max_new_tokens); each entry keeps its model alive so
# that a freed model's id is never taken for another's
_REFERENCES: dict[tuple[int, tuple[int, ...], int], tuple[Any, list[int]]] = {}


def greedy_reference(pair: TinyPair, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` by the pair's target, up to its first EOS (computed once per
    session for each prompt and length: greedy decoding is deterministic)."""
    key = (id(pair.target.model), tuple(prompt), max_new_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = (pair.target.model, hf_greedy_ids(pair.target.model, prompt, max_new_tokens))
    ref = list(_REFERENCES[key][1])
    return ref[: ref.index(EOS_ID) + 1] if EOS_ID in ref else ref


@contextmanager
def spawned_at_once(configs: Iterable[tuple[str, ReplicaConfig]]) -> Iterator[Callable[[str], Coordinator]]:
    """Spawns the replicas of a module's cases all at once, each on a thread of its own as soon as ``configs`` yields
    it, and gives ``take(name)``: that case's coordinator, once started (its user shuts it down). A replica's start
    keeps about one core busy at a time (its shards, then its drafter, each a process importing torch and loading
    weights), so the cases' starts overlap on a machine with more than one. Replicas nobody took are shut down at the
    end. The configurations must fit the session cluster together."""
    pool = ThreadPoolExecutor(4)
    futures: dict[str, Future[Coordinator]] = {}
    taken: set[str] = set()

    def take(name: str) -> Coordinator:
        taken.add(name)
        return futures[name].result()

    try:
        for name, config in configs:
            futures[name] = pool.submit(Coordinator.spawn, config)
        yield take
    finally:
        pool.shutdown(wait=True)
        for name, future in futures.items():
            if name not in taken and future.exception() is None:
                future.result().shutdown()


class OneAhead:
    """Spawns a module's cases' replicas one case ahead, for modules whose checks need the cluster to one replica at a
    time: ``take(name)`` gives a case's coordinator (spawned ahead, or spawned now); ``start_next(name)`` starts
    spawning the case after ``name`` (in ``order``) on a thread, to be called once ``name``'s tests no longer need the
    cluster to themselves; ``release(name)`` shuts a taken one down. Replicas nobody took are shut down by ``close``."""

    def __init__(self, order: list[str], config: Callable[[str], ReplicaConfig], settle_s: float = 30.0) -> None:
        self.order = order
        self.config = config
        self.settle_s = settle_s
        self._pool = ThreadPoolExecutor(1)
        self._futures: dict[str, Future[Coordinator]] = {}
        self._released: set[str] = set()

    def start(self, name: str) -> None:
        if name not in self._futures:
            self._futures[name] = self._pool.submit(lambda: Coordinator.spawn(self.config(name)))

    def start_next(self, name: str) -> None:
        later = self.order[self.order.index(name) + 1 :] if name in self.order else []
        if later:
            self.start(later[0])

    def take(self, name: str) -> Coordinator:
        self.start(name)
        return self._futures[name].result()

    def release(self, name: str) -> None:
        """Shuts ``name``'s replica down; then waits for the spawn in flight (if any), and for the cluster's used
        "large" and "cheap" to be what the replicas still alive hold (at most ``settle_s``: Ray frees a removed
        placement group asynchronously), as they would be for a replica spawned only now."""
        import time

        import ray

        self._futures[name].result().shutdown()
        self._released.add(name)
        held = {"large": 0.0, "cheap": 0.0}
        for other, future in self._futures.items():
            if other not in self._released and future.exception() is None:  # waits for a spawn in flight
                config = future.result().replica.config
                held["large"] += config.tp_degree
                held["cheap"] += 1.0 if config.drafter_placement == "separate" else 0.0
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            total, free = ray.cluster_resources(), ray.available_resources()
            if all(total.get(key, 0.0) - free.get(key, 0.0) == held[key] for key in held):
                return
            time.sleep(0.1)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for name, future in self._futures.items():
            if name not in self._released and future.exception() is None:
                future.result().shutdown()


@contextmanager
def replicas_at_once(config: ReplicaConfig, count: int = 2) -> Iterator[list[Coordinator]]:
    """``count`` replicas of ``config`` spawned at once (each on a thread of its own), shut down on leaving."""
    with ThreadPoolExecutor(count) as spawn:
        coordinators = list(spawn.map(lambda _: Coordinator.spawn(config), range(count)))
    try:
        yield coordinators
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
