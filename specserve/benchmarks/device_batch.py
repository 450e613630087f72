"""The device check's batched section: what a server's path does on the device, against transformers' batching.

For one model — the shipped target with its draft model, or the random 1.1B-shape Llama in bf16 — at each
concurrency ``c`` (:data:`LEVELS`: 1, 16 and 64; ``--quick``: 1 and 4), ``c`` requests at once through the closed loop
of :mod:`specserve.benchmarks.batch_loop` (held-out prompts in turn, ``max_new_tokens`` each, EOS ignored, greedy):

* ``ours/batched-plain`` — :class:`~specserve.core.batch_engine.BatchedEngine` with no drafter;
* ``ours/batched-gamma-3`` — the same engine with the draft model at γ 3 (the shipped pair only: a random Llama has
  no draft model, and its tokens mean nothing to one);
* ``ours/batched-plain-ragged`` — on CUDA, batched plain again with the row-by-row attention forced, beside the
  one-call FlexAttention path the device takes by default (:mod:`specserve.core.attention.flex`);
* ``ours/batched-plain-graphed`` and ``ours/batched-gamma-3-graphed`` — on CUDA, with static shapes: the target's
  steps and the draft model's forwards captured as CUDA graphs at bucketed shapes
  (:mod:`specserve.core.static.batch_graphs`);
* ``hf/generate-batch`` — transformers' continuous batching (the manager behind ``generate_batch``: its paged
  attention, same device, same requests).

Per run: tokens/s (all tokens over the wall time, prefill included), ITL p50 and TTFT p50, the attention path the
batched forward took (:func:`~specserve.core.attention.flex.batch_attention`), and how many of our outputs equal the
request's greedy tokens one at a time (:class:`~specserve.core.engine.SpeculativeEngine`, no drafter). On CUDA, at the
largest level, a few decode steps of batched plain are counted, eager and graphed: host synchronisations (CUDA's sync
debug mode) and kernel launches (the profiler's CUDA events), per step. A target takes the faster of a method and its
graphed run. Every run is appended to the report's ``batched`` list and saved as it finishes. :func:`batched_targets`
judges the issue's targets from them. Last, the section times one step by rows (1 to the largest level) and width,
captured and not, and records the row buckets that table implies (:mod:`specserve.benchmarks.step_costs`). Does not
tune anything.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from specserve.benchmarks.batch_loop import (
    HFBatching,
    RequestRecord,
    closed_loop,
    level_requests,
    percentile,
    run_hf_batching,
)
from specserve.benchmarks.step_costs import step_costs
from specserve.core.attention.flex import ENV, batch_attention
from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.static.options import StaticOptions
from specserve.drafters.none import NoDrafter
from specserve.drafters.registry import request_drafters
from specserve.policies.schedules import schedules

T = TypeVar("T")

LEVELS = (1, 16, 64)
QUICK_LEVELS = (1, 4)
MAX_NEW_TOKENS = 64
GAMMA = 3
PREFILL_TOKENS = 256
WARMUP_TOKENS = 8
COUNTED_STEPS = 5  # decode steps whose syncs and kernel launches are counted
STEP_WIDTHS = (1, 4)  # block widths of the T(rows, width) table: plain decoding, and γ 3
STEP_REPEATS = 3
PLAIN_OVER_HF = 1.5  # ours/batched-plain over hf/generate-batch at the largest level (the Llama)
SPECULATIVE_OVER_PLAIN = 1.3  # ours/batched-gamma-3 over ours/batched-plain at 16 requests (the shipped pair)


def one_at_a_time(model: CausalLM, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from the single-request engine: what every batched output must equal."""
    engine = SpeculativeEngine(model, NoDrafter(model.device))
    config = GenerationConfig(max_new_tokens=max_new_tokens, gamma=0, ignore_eos=True)
    return [engine.generate(prompt, None, config).output_ids for prompt in prompts]


def batched_engine(
    model: CausalLM,
    draft: CausalLM | None,
    concurrency: int,
    max_seq_len: int,
    max_new_tokens: int,
    prefill_tokens: int = PREFILL_TOKENS,
    graphed: bool = False,
) -> tuple[BatchedEngine, GenerationConfig, GenerationConfig]:
    """An engine for ``concurrency`` requests; its request and warm-up configurations (γ 3 with ``draft``).
    ``graphed``: static shapes, the target's steps and the draft model's forwards captured as CUDA graphs."""
    dtype, device = str(model.dtype).removeprefix("torch."), str(model.device)
    static = StaticOptions() if graphed else None
    drafters = request_drafters(draft if draft is not None else "none", model, dtype=dtype, device=device,
                                max_num_seqs=concurrency, max_seq_len=max_seq_len, static=static)  # fmt: skip
    engine = BatchedEngine(model, drafters, schedules=schedules(), max_num_seqs=concurrency, max_seq_len=max_seq_len,
                           prefill_tokens=prefill_tokens, static=static)  # fmt: skip
    gamma, drafter = (GAMMA, "default") if draft is not None else (0, "none")
    config = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma, drafter=drafter, ignore_eos=True)
    return engine, config, GenerationConfig(max_new_tokens=WARMUP_TOKENS, gamma=gamma, drafter=drafter, ignore_eos=True)


def row_of(
    name: str, method: str, concurrency: int, records: list[RequestRecord], wall: float, reference: list[list[int]]
) -> dict[str, Any]:
    tokens = sum(len(r.output_ids) for r in records)
    itl = [s for r in records for s in r.itl_samples()]
    ttft = [t for r in records if (t := r.ttft) is not None]
    equal = sum(r.output_ids == reference[r.index % len(reference)] for r in records)
    return {
        "model": name,
        "method": method,
        "concurrency": concurrency,
        "requests": len(records),
        "tokens": tokens,
        "seconds": round(wall, 4),
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "itl_p50_ms": None if not itl else round(1000 * (percentile(itl, 50) or 0.0), 3),
        "ttft_p50_ms": None if not ttft else round(1000 * (percentile(ttft, 50) or 0.0), 3),
        "equal_to_one_at_a_time": equal,
    }


def run_level(
    model: CausalLM,
    draft: CausalLM | None,
    prompts: list[list[int]],
    concurrency: int,
    max_seq_len: int,
    max_new_tokens: int,
    graphed: bool = False,
) -> tuple[list[RequestRecord], float]:
    """``concurrency`` requests at once through a fresh engine, after a warm-up request on it."""
    engine, config, warmup = batched_engine(model, draft, concurrency, max_seq_len, max_new_tokens, graphed=graphed)
    closed_loop(engine, level_requests(prompts, 1, seed=0), 1, warmup, 0.0)
    return closed_loop(engine, level_requests(prompts, concurrency, seed=0), concurrency, config, 0.0)


def ragged(run: Callable[..., T], *args: Any) -> T:
    """``run(*args)`` with the batched forward's row-by-row attention forced (``SPECSERVE_BATCH_ATTENTION``)."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "ragged"
    try:
        return run(*args)
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def step_counts(
    model: CausalLM,
    prompts: list[list[int]],
    concurrency: int,
    max_seq_len: int,
    max_new_tokens: int,
    graphed: bool = False,
) -> dict[str, Any]:
    """Host synchronisations and kernel launches per decode step of batched plain at ``concurrency`` (CUDA only;
    ``graphed``: with the steps captured as CUDA graphs)."""
    if model.device.type != "cuda":
        return {"status": "not counted: CUDA's sync debug mode and the profiler's CUDA events need a CUDA device"}
    from torch.profiler import ProfilerActivity, profile

    requests = level_requests(prompts, concurrency, seed=0)
    every_prompt = sum(len(r.prompt_ids) for r in requests)  # prefilled in the first step: the counted ones decode
    engine, config, _ = batched_engine(model, None, concurrency, max_seq_len, max_new_tokens, every_prompt, graphed)
    for request in requests:
        engine.submit(request.prompt_ids, None, config)
    for _ in range(3):  # the prefill, then two decode steps
        engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(COUNTED_STEPS):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(COUNTED_STEPS):
            engine.step()
        torch.cuda.synchronize(model.device)
    kernels = sum(e.count for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "status": "ok",
        "concurrency": concurrency,
        "steps": COUNTED_STEPS,
        "host_syncs_per_step": syncs / COUNTED_STEPS,
        "kernel_launches_per_step": kernels / COUNTED_STEPS,
    }


def batched_section(
    name: str,
    model: CausalLM,
    prompts: list[list[int]],
    draft_dir: Path | None,
    levels: Sequence[int],
    record: Callable[[dict[str, Any]], None],
    max_new_tokens: int = MAX_NEW_TOKENS,
    every_row_count: bool = True,
) -> dict[str, Any]:
    """Every level's runs of ``model`` (``draft_dir``: a draft model to speculate with); each row goes to ``record``
    as it finishes. The section's summary: levels, the attention path, the step counts, T(rows, width) — at every row
    count up to the largest level (and the row buckets it implies), or at the levels only without
    ``every_row_count`` (a large model's steps, within the check's budget)."""
    start = time.perf_counter()
    reference = one_at_a_time(model, prompts, max_new_tokens)
    draft = None
    if draft_dir is not None and (draft_dir / "config.json").is_file():
        draft = CausalLM.load(draft_dir, dtype=str(model.dtype).removeprefix("torch."), device=str(model.device))
    max_seq_len = max(map(len, prompts)) + max_new_tokens
    attention = batch_attention(model.device)
    graphs = model.device.type == "cuda"
    for concurrency in levels:
        runs: list[tuple[str, Callable[[], tuple[list[RequestRecord], float]]]] = [
            ("ours/batched-plain", partial(run_level, model, None, prompts, concurrency, max_seq_len, max_new_tokens)),
        ]
        if attention == "flex":  # the row-by-row path beside it: which is faster here is measured, not assumed
            runs.append(("ours/batched-plain-ragged", partial(ragged, run_level, model, None, prompts, concurrency,
                                                              max_seq_len, max_new_tokens)))  # fmt: skip
        if graphs:  # the steps captured as CUDA graphs (core/static/batch_graphs.py)
            runs.append(("ours/batched-plain-graphed", partial(run_level, model, None, prompts, concurrency,
                                                               max_seq_len, max_new_tokens, True)))  # fmt: skip
        if draft is not None:
            runs.append((f"ours/batched-gamma-{GAMMA}", partial(run_level, model, draft, prompts, concurrency,
                                                                max_seq_len, max_new_tokens)))  # fmt: skip
        if draft is not None and graphs:
            speculative = partial(run_level, model, draft, prompts, concurrency, max_seq_len, max_new_tokens, True)
            runs.append((f"ours/batched-gamma-{GAMMA}-graphed", speculative))
        requests = level_requests(prompts, concurrency, seed=0)
        settings = HFBatching(concurrency, max_new_tokens, max_seq_len, PREFILL_TOKENS, warmup_tokens=WARMUP_TOKENS)
        runs.append(("hf/generate-batch", partial(run_hf_batching, model, requests, settings)))
        for method, run in runs:
            try:
                records, wall = run()
                row = row_of(name, method, concurrency, records, wall, reference)
                row["status"] = "ok"
                if method.startswith("ours/"):
                    graphed = method.endswith("-graphed")
                    row["attention"] = "ragged" if method.endswith("-ragged") else "gathered" if graphed else attention
                    row["graphed"] = graphed
            except Exception as exc:  # the other runs still go
                row = {"model": name, "method": method, "concurrency": concurrency, "status": "error",
                       "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
            record(row)
            print(f"  {name} c={concurrency} {describe(row)}", flush=True)
    counts: dict[str, Any] = {}
    for kind, graphed in (("eager", False), ("graphed", True)):
        if graphed and not graphs:
            continue
        try:
            counts[kind] = step_counts(model, prompts, max(levels), max_seq_len, max_new_tokens, graphed)
        except Exception as exc:  # counting is a detail: the runs above are the section
            counts[kind] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    try:  # T(rows, width) of the captured step and the ordinary one, and the row buckets it implies
        counts_timed = range(1, max(levels) + 1) if every_row_count else sorted(set(levels))
        costs = step_costs(model, counts_timed, STEP_WIDTHS, repeats=STEP_REPEATS)
    except Exception as exc:  # a detail beside the runs above
        costs = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    return {
        "levels": list(levels),
        "max_new_tokens": max_new_tokens,
        "attention": attention,
        "draft": draft is not None,
        "step_counts": counts,
        "step_costs": costs,
        "reference_seconds": round(time.perf_counter() - start, 2),
    }


def describe(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row['method']}: {row.get('error', row.get('status'))}"
    itl = "-" if row["itl_p50_ms"] is None else f"{row['itl_p50_ms']:.2f} ms"
    equal = f"{row['equal_to_one_at_a_time']}/{row['requests']}"
    return f"{row['method']}: {row['tokens_per_second']:.1f} tok/s, ITL p50 {itl}, equal to one at a time {equal}"


def batched_targets(rows: Sequence[dict[str, Any]], entry: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's batched targets from the section's rows (``entry``: the check's target constructor)."""
    ok = [r for r in rows if r.get("status") == "ok"]

    def rate(model: str, method: str, concurrency: int) -> float | None:
        """The faster of ``method`` and its graphed run (a server runs whichever its settings say)."""
        methods = (method, f"{method}-graphed")
        found = [r["tokens_per_second"] for r in ok if (r["model"], r["method"], r["concurrency"]) in
                 ((model, m, concurrency) for m in methods)]  # fmt: skip
        return max(found) if found else None

    targets = []
    largest = max((r["concurrency"] for r in ok if r["model"] == "llama_1b"), default=None)
    ours = hf = None
    if largest is not None:
        ours, hf = rate("llama_1b", "ours/batched-plain", largest), rate("llama_1b", "hf/generate-batch", largest)
    targets.append(entry(
        f"batched plain >= {PLAIN_OVER_HF:g}x transformers generate_batch at {largest or max(LEVELS)} requests "
        "(llama_1b)", None if not ours or not hf else ours / hf, PLAIN_OVER_HF,
        "not measured" if not ours or not hf else f"{ours:.1f} vs {hf:.1f} tok/s"))  # fmt: skip
    spec, plain = rate("target", f"ours/batched-gamma-{GAMMA}", 16), rate("target", "ours/batched-plain", 16)
    targets.append(entry(
        f"batched γ {GAMMA} >= {SPECULATIVE_OVER_PLAIN:g}x batched plain at 16 requests (target)",
        None if not spec or not plain else spec / plain, SPECULATIVE_OVER_PLAIN,
        "not measured" if not spec or not plain else f"{spec:.1f} vs {plain:.1f} tok/s"))  # fmt: skip
    ours_rows = [r for r in ok if r["model"] == "target" and r["method"].startswith("ours/")]
    compared = sum(r["requests"] for r in ours_rows)
    equal = sum(r["equal_to_one_at_a_time"] for r in ours_rows)
    targets.append(entry(
        "batched greedy outputs 100 % equal to one at a time (target)", 100.0 * equal / compared if compared else None,
        100.0, f"{equal}/{compared} outputs over {len(ours_rows)} runs"))  # fmt: skip
    return targets
