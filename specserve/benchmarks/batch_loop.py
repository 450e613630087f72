"""The closed loop every batched-serving benchmark drives: requests kept in flight, what each one saw.

A *closed loop* keeps ``c`` requests in flight: ``c`` are submitted at once and whenever one finishes the next is
submitted, until every request ran (:func:`closed_loop`, over anything with the batched engine's ``submit`` /
``step`` API; :func:`run_hf_batching`, the same loop over transformers' continuous batching manager). Each request's
:class:`RequestRecord` keeps when it was submitted and when each token-bearing chunk came: TTFT, ITL samples and
time per output token follow from it. ``specserve bench-batch`` (:mod:`specserve.benchmarks.batch`) and the device
check's batched section (:mod:`specserve.benchmarks.device_batch`) both run it; this module imports nothing a GPU
image without Ray or pydantic lacks. Does not build engines, pick modes or write reports.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specserve.core.attention.sdpa import native_attention
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats


@dataclass(frozen=True)
class Request:
    index: int  # within the level
    prompt_index: int
    prompt_ids: list[int]
    seed: int


@dataclass
class RequestRecord:
    """One request as the load generator saw it: when it was submitted, when each token-bearing chunk came."""

    index: int
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per chunk with tokens
    output_ids: list[int] = field(default_factory=list)
    stats: RequestStats | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.submitted if self.chunks else None

    @property
    def tpot(self) -> float | None:
        tokens = sum(n for _, n in self.chunks)
        if len(self.chunks) < 2 or tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (tokens - 1)

    def itl_samples(self) -> Iterator[float]:
        """Per token after the first chunk: the gap since the previous chunk, spread over the chunk's tokens."""
        for (before, _), (now, tokens) in zip(self.chunks, self.chunks[1:], strict=False):
            yield from [(now - before) / tokens] * tokens


def level_requests(prompt_ids: list[list[int]], count_: int, seed: int) -> list[Request]:
    return [Request(j, j % len(prompt_ids), prompt_ids[j % len(prompt_ids)], seed + j) for j in range(count_)]


class Server(Protocol):
    """What the closed loop drives: :class:`BatchedEngine`, or :class:`OneAtATime` around the single engine."""

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, config: GenerationConfig | None = None
    ) -> int: ...

    def step(self) -> list[tuple[int, StreamChunk | Exception]]: ...

    @property
    def has_work(self) -> bool: ...


def closed_loop(
    server: Server, requests: Sequence[Request], concurrency: int, config: GenerationConfig, temperature: float
) -> tuple[list[RequestRecord], float]:
    """Keep ``concurrency`` requests in flight (submit the next when one finishes); every record and the wall time."""
    pending = deque(requests)
    records: dict[int, RequestRecord] = {}

    def submit_next() -> None:
        request = pending.popleft()
        params = SamplingParams(temperature=temperature, seed=request.seed)
        submitted = time.perf_counter()
        records[server.submit(request.prompt_ids, params, config)] = RequestRecord(request.index, submitted)

    start = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        submit_next()
    while server.has_work:
        chunks = server.step()
        now = time.perf_counter()
        for request_id, chunk in chunks:
            if isinstance(chunk, Exception):  # a benchmark's requests never fail on their own
                raise chunk
            record = records[request_id]
            if chunk.token_ids:
                record.chunks.append((now, len(chunk.token_ids)))
            if chunk.result is not None:
                record.output_ids, record.stats = list(chunk.result.output_ids), chunk.result.stats
                if pending:
                    submit_next()
    wall = time.perf_counter() - start
    return sorted(records.values(), key=lambda r: r.index), wall


@dataclass(frozen=True)
class HFBatching:
    """How :func:`run_hf_batching` drives transformers' continuous batching: ``concurrency`` requests in flight,
    ``max_new_tokens`` each (EOS ignored), a paged cache for ``concurrency`` requests of ``max_seq_len`` positions,
    ``max_batch_tokens = prefill_tokens + concurrency``, one ``seed`` per run, a warm-up request of
    ``warmup_tokens``."""

    concurrency: int
    max_new_tokens: int
    max_seq_len: int
    prefill_tokens: int
    temperature: float = 0.0
    seed: int = 0
    warmup_tokens: int = 8


def run_hf_batching(
    target: CausalLM, requests: Sequence[Request], settings: HFBatching
) -> tuple[list[RequestRecord], float]:
    """transformers' continuous batching manager (behind ``model.generate_batch``) in the closed loop (``settings``);
    prefix-block sharing off; token times are the timestamps it records. Runs transformers' own attention (its
    continuous batching accepts no other) and restores the model's after."""
    model: Any = target.model
    with native_attention(model), _quiet_hf_logger():
        return _closed_loop_hf(model, list(target.info.eos_token_ids), requests, settings)


def _closed_loop_hf(
    model: Any, eos: list[int], requests: Sequence[Request], settings: HFBatching
) -> tuple[list[RequestRecord], float]:
    from transformers import ContinuousBatchingConfig
    from transformers import GenerationConfig as HFGenerationConfig

    concurrency, temperature, max_new_tokens = settings.concurrency, settings.temperature, settings.max_new_tokens
    attention = model.config._attn_implementation
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    generation = HFGenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=eos[0] if eos else 0, **sampling
    )
    page_size = 256
    batching = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=concurrency * (math.ceil(settings.max_seq_len / page_size) + 1),
        max_batch_tokens=settings.prefill_tokens + concurrency,
        max_requests_per_batch=concurrency,
        allow_block_sharing=False,
        seed=settings.seed,
    )
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.start()
    try:
        _hf_wait(
            manager,
            {manager.add_request(requests[0].prompt_ids, max_new_tokens=settings.warmup_tokens)},
        )
        pending = deque(requests)
        records: dict[str, RequestRecord] = {}

        def submit_next() -> str:
            request = pending.popleft()
            submitted = time.perf_counter()
            request_id = manager.add_request(request.prompt_ids, max_new_tokens=max_new_tokens, record_timestamps=True)
            if request_id is None:
                raise RuntimeError("transformers' continuous batching refused a request")
            records[request_id] = RequestRecord(request.index, submitted)
            return str(request_id)

        start = time.perf_counter()
        in_flight = {submit_next() for _ in range(min(concurrency, len(pending)))}
        while in_flight:
            result = _hf_wait(manager, in_flight)
            in_flight.discard(result.request_id)
            record = records[result.request_id]
            record.output_ids = list(result.generated_tokens)
            record.chunks = [(t, 1) for t in result.timestamps or []]
            if pending:
                in_flight.add(submit_next())
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    if model.config._attn_implementation != attention:  # the manager swaps in a paged attention while it runs
        model.set_attn_implementation(attention)
    return sorted(records.values(), key=lambda r: r.index), wall


def _hf_wait(manager: Any, request_ids: set[str]) -> Any:
    """The next finished result among ``request_ids``; raises if the manager failed or a request did."""
    while True:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped unexpectedly")
            continue
        if result.request_id in request_ids and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
            return result


class _NoPsutilNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


@contextmanager
def _quiet_hf_logger() -> Iterator[None]:
    logger, noise = logging.getLogger("ContinuousBatchingLogger"), _NoPsutilNoise()
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
