"""``ShadowChecks``: a replica re-decodes a sample of its finished requests without speculation, when it is idle.

A :class:`~specserve.serve.model_server.ModelServer` offers every finished request; a fraction
(``shadow_fraction``: every ``1/fraction``-th) of them is kept in a bounded queue. A checkable request
(greedy, or sampled drafter-invariantly: :func:`~specserve.core.shadow.skip_reason`) waits there; the others
are counted ``skipped`` at once with their reason. One task on the replica's event loop takes the queue's
oldest job when the replica has held **no live request** for :data:`QUIET_S`, runs it again plainly through
the replica's own runner (:func:`~specserve.core.shadow.plain_request`: the batched engine or the distributed
runtime, the same path its live requests take), and compares token for token as the tokens come (a divergence
ends the run at once). The moment a live request arrives, the run is closed — at the next step boundary — and
its job goes back to the head of the queue, so a check never holds a batch slot, a runner slot or the KV a
live request needs for longer than one step.

Results go to the metrics (``specserve_shadow_checks{result}``, ``specserve_shadow_skipped{reason}``,
``specserve_shadow_queue_length``). A ``mismatch`` or ``near_tie`` writes a repro bundle
(:func:`~specserve.core.shadow.write_bundle`) and logs it, a mismatch at error level. Bounded:
at most ``max_jobs`` jobs wait (each holds its prompt and output ids); offering one more drops the
oldest (``skipped``, reason ``dropped``), and a job preempted :data:`MAX_PREEMPTIONS` times is
dropped (reason ``preempted``): a replica that is never idle checks nothing, and says so.

Does not: check a request resumed from a lost replica (its output was produced by two replicas), run
in another process, or rate-limit a replica that is idle (an idle replica's spare time is what it uses).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.core.shadow import ShadowJob, classify, plain_request, skip_reason, write_bundle
from specserve.core.stats import RequestStats
from specserve.core.verify.logprobs import TokenLogprob
from specserve.serve.metrics import ServeMetrics

logger = logging.getLogger("ray.serve")

MAX_PREEMPTIONS = 32  # a job whose plain run live requests interrupted this often is dropped
IDLE_POLL_S = 0.01  # how often a waiting check looks whether the replica is idle
QUIET_S = 0.05
"""How long the replica must have held no live request before a check starts: a client sending requests one after
another leaves gaps of a few milliseconds between them, too short to finish a check in, long enough to start one
that the next request would close at once."""

PlainRun = Callable[[list[int], SamplingParams, GenerationConfig], AsyncIterator[StreamChunk]]


class ShadowChecks:
    def __init__(
        self,
        fraction: float,
        run: PlainRun,
        busy: Callable[[], bool],
        directory: str | Path,
        context: Mapping[str, Any],
        vocab: int,
        dtype: torch.dtype,
        metrics: ServeMetrics | None = None,
        max_jobs: int = 64,
        on_plain: Callable[[RequestStats], None] | None = None,
    ) -> None:
        """``run`` streams a request through the replica's runner; ``busy`` says whether a live request is held;
        ``context`` is what a bundle records of the replica (model, versions are added, dtype, device, settings). Every
        ``1 / fraction``-th request is kept (a systematic sample: a replica's checks are spread evenly over its
        traffic, and a test knows which). ``on_plain`` is handed a finished plain
        run's statistics."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"shadow_fraction must be between 0 and 1, got {fraction}")
        self.fraction = fraction
        self.run = run
        self.busy = busy
        self.directory = Path(directory)
        self.context = dict(context)
        self.vocab = vocab
        self.dtype = dtype
        self.metrics = metrics
        self.max_jobs = max_jobs
        self.on_plain = on_plain
        self._credit = 0.0  # offers kept: one each time the credit reaches 1
        self._jobs: deque[tuple[ShadowJob, int]] = deque()  # (job, times preempted)
        self._task: asyncio.Task[None] | None = None
        self.counts: Counter[str] = Counter()  # match, mismatch, near_tie, skipped:<reason>, preempted
        self.bundles: list[Path] = []  # written by this replica, newest last

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def offer(self, job: ShadowJob) -> None:
        """A request finished (on the replica's event loop): keep it for a check with probability ``fraction``."""
        self._credit += self.fraction
        if self._credit < 1.0:
            return
        self._credit -= 1.0
        reason = skip_reason(job.params)
        if reason is not None:
            self._skip(job, reason)
            return
        if len(self._jobs) >= self.max_jobs:
            self._skip(self._jobs.popleft()[0], "dropped")
        self._jobs.append((job, 0))
        self._report_queue()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="specserve-shadow")

    async def drained(self) -> None:
        """Until every waiting check ran (tests; a replica never waits for its checks)."""
        while self._task is not None and not self._task.done():
            await asyncio.sleep(IDLE_POLL_S)

    def status(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "waiting": self.waiting, **dict(self.counts)}

    # -----------------------------------------------------------------------------------------

    async def _drain(self) -> None:
        while self._jobs:
            await self._quiet()
            job, preempted = self._jobs.popleft()
            self._report_queue()
            try:
                done = await self._check(job)
            except Exception:  # the plain run failed: the replica serves on, the check is lost
                logger.exception("a shadow check's plain run failed")
                self._skip(job, "failed")
                continue
            if done:
                continue
            self.counts["preempted"] += 1
            if preempted + 1 >= MAX_PREEMPTIONS:
                self._skip(job, "preempted")
            else:
                self._jobs.appendleft((job, preempted + 1))
                self._report_queue()

    async def _quiet(self) -> None:
        """Until the replica has held no live request for :data:`QUIET_S`."""
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        while True:
            if self.busy():
                idle_since = loop.time()
            elif loop.time() - idle_since >= QUIET_S:
                return
            await asyncio.sleep(IDLE_POLL_S)

    async def _check(self, job: ShadowJob) -> bool:
        """Run ``job`` plainly and record the verdict; ``False``: a live request arrived first (nothing recorded)."""
        params, config = plain_request(job.params, job.config)
        plain: list[int] = []
        logprobs: list[TokenLogprob] = []
        async with aclosing(self.run(job.prompt_ids, params, config)) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                plain.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs)
                if chunk.result is not None:
                    if self.on_plain is not None:  # a plain run's costs are worth knowing (the speedup's baseline)
                        self.on_plain(chunk.result.stats)
                    break
                if plain != job.output_ids[: len(plain)]:
                    break  # diverged (or ran past the speculative output's end): the verdict is known
                if self.busy():
                    return False
        self._record(job, plain, logprobs)
        return True

    def _record(self, job: ShadowJob, plain: list[int], logprobs: list[TokenLogprob]) -> None:
        divergence = classify(
            job.output_ids, plain, logprobs, job.params, len(job.prompt_ids), self.vocab, self.dtype
        )  # fmt: skip
        result = "match" if divergence is None else divergence.result
        self.counts[result] += 1
        if self.metrics is not None:
            self.metrics.shadow_check(job.drafter, result, job.params.lossy_acceptance)
        if divergence is None:
            return
        path = write_bundle(self.directory, job, plain, divergence, self.context)
        self.bundles.append(path)
        where = (
            f"output token {divergence.position}: speculative {divergence.speculative}, plain {divergence.plain}; "
            f"score gap {divergence.gap} (near-tie tolerance {divergence.tolerance:.3g})"
        )
        if divergence.near_tie:
            logger.warning("shadow check: a near tie changed the output at %s; bundle %s", where, path)
        else:
            logger.error(
                "shadow check MISMATCH: speculation changed the output (drafter %s, policy %s) at %s; "
                "re-run it with `specserve replay %s`",
                job.drafter, job.config.policy, where, path,
            )  # fmt: skip

    def _skip(self, job: ShadowJob, reason: str) -> None:
        self.counts[f"skipped:{reason}"] += 1
        if self.metrics is not None:
            self.metrics.shadow_skip(job.drafter, reason, job.params.lossy_acceptance)

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.shadow_waiting(len(self._jobs))
