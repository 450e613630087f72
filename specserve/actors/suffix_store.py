"""The suffix drafter's global store shared across replicas: one Ray actor, and a mirror in each replica.

By default each replica's suffix drafters share one :class:`~specserve.drafters.suffix.SuffixCache` of
their own process's finished outputs. With ``suffix_store: cluster`` every replica also sees the
others': a :class:`SuffixStoreActor` (one per Ray namespace, by name) keeps a log of recently
published outputs, and each replica's :class:`SharedSuffixCache` — a ``SuffixCache`` its drafters
use as usual — publishes to it and pulls what the other replicas published.

Nothing waits on the actor on the drafting path: a publish is sent without waiting for it, and a
pull is a request in flight that a later query picks up once it has arrived (at most one every
``refresh_s``). A replica therefore sees another's output about ``refresh_s`` after it finished;
its own outputs it sees at once, and they are not pulled back. The actor keeps at most
``max_tokens`` tokens of log (oldest dropped), and each mirror evicts as any ``SuffixCache`` does.
If the actor is lost (its owner replica went away), the next pull creates it again, empty: the
mirrors keep what they hold. Drafts only change speed, never output, so a stale or lost store costs
acceptance, not exactness.

The cost (a publish, a pull of a given size, and their effect on a query) is measured by
``bench/suffix_store.py`` (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from specserve.drafters.suffix import SuffixCache

logger = logging.getLogger(__name__)

STORE_NAME = "specserve-suffix-store"
DEFAULT_REFRESH_S = 1.0


class SuffixStoreActor:
    """A log of published outputs, each numbered and tagged with the mirror that published it."""

    def __init__(self, max_tokens: int = 1 << 18) -> None:
        self.max_tokens = max_tokens
        self._log: deque[tuple[int, str, np.ndarray]] = deque()
        self._tokens = 0
        self._next = 1

    def publish(self, origin: str, tokens: np.ndarray) -> int:
        """Append an output; returns its number."""
        document = np.asarray(tokens, dtype=np.int64)[-self.max_tokens :]
        number = self._next
        self._next += 1
        self._log.append((number, origin, document))
        self._tokens += document.size
        while self._tokens > self.max_tokens and len(self._log) > 1:
            self._tokens -= self._log.popleft()[2].size
        return number

    def since(self, origin: str, after: int) -> tuple[int, list[np.ndarray]]:
        """The outputs numbered above ``after`` that ``origin`` did not publish, oldest first, and the latest
        number (the ``after`` of the next call)."""
        documents = [document for number, source, document in self._log if number > after and source != origin]
        return self._next - 1, documents

    def stats(self) -> dict[str, int]:
        return {"documents": len(self._log), "tokens": self._tokens, "published": self._next - 1}


def store_actor(name: str = STORE_NAME, max_tokens: int = 1 << 18) -> Any:
    """The handle of the store named ``name`` in this Ray namespace, created if there is none."""
    actor = ray.remote(num_cpus=0, max_restarts=0)(SuffixStoreActor)
    return actor.options(name=name, get_if_exists=True).remote(max_tokens)


class SharedSuffixCache(SuffixCache):
    """A replica's suffix store that also holds the other replicas' outputs (see the module docstring).

    Needs a connected Ray (``ray.init``). Thread-safe like :class:`SuffixCache`.
    """

    def __init__(self, name: str = STORE_NAME, max_tokens: int = 1 << 18, refresh_s: float = DEFAULT_REFRESH_S) -> None:
        super().__init__(max_tokens)
        self.name = name
        self.refresh_s = refresh_s
        self.origin = uuid.uuid4().hex
        self._actor = store_actor(name, max_tokens)
        self._seen = 0  # the latest store number pulled
        self._pull: Any = None  # an ObjectRef of ``since`` in flight
        self._pulled_at = -float("inf")
        self._sync = threading.Lock()
        self.pulled_documents = 0
        self.failures = 0

    def publish(self, tokens: Sequence[int] | np.ndarray) -> None:
        document = np.asarray(tokens, dtype=np.int64)
        if document.size == 0:
            return
        super().publish(document)
        try:
            self._actor.publish.remote(self.origin, document)  # not waited for
        except Exception as exc:  # an actor handle that cannot even send: the store was lost
            self._lost(exc)

    def text(self) -> np.ndarray:
        self.refresh()
        return super().text()

    def refresh(self, wait: bool = False) -> None:
        """Take a pull that has arrived, and send the next one if ``refresh_s`` passed (``wait``: block for the pull
        in flight, then send and wait for another: for tests and shutdown, not the drafting path)."""
        with self._sync:
            if self._pull is not None:
                ready, _ = ray.wait([self._pull], timeout=None if wait else 0)
                if ready:
                    self._take(self._pull)
                    self._pull = None
            now = time.monotonic()
            if self._pull is None and (wait or now - self._pulled_at >= self.refresh_s):
                self._pulled_at = now
                try:
                    self._pull = self._actor.since.remote(self.origin, self._seen)
                except Exception as exc:
                    self._lost(exc)
                    return
                if wait:
                    ray.wait([self._pull], timeout=None)
                    self._take(self._pull)
                    self._pull = None

    def _take(self, ref: Any) -> None:
        try:
            latest, documents = ray.get(ref)
        except Exception as exc:  # the actor died: start a new one (its log is gone; what we hold stays)
            self._lost(exc)
            return
        for document in documents:
            SuffixCache.publish(self, document)
        self.pulled_documents += len(documents)
        self._seen = latest

    def _lost(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            logger.warning("the shared suffix store %r was lost (%s); starting a new one", self.name, exc)
        self._seen = 0
        self._actor = store_actor(self.name, self.max_tokens)
