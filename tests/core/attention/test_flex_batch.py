"""One attention call per layer for the whole batch (:mod:`specserve.core.attention.flex`).

* ``flex_attend`` under ``block_mask`` equals an independent reference written here — per row, dense scores over its
  own span under its own mask, softmax in float64 — for ragged rows of chains, trees, prefills and single queries,
  padding queries (zero out), grouped-query heads, a sliding window, soft-capped logits and attention sinks.
* A batched forward with the one-call path forced equals the row-by-row path (logits and the pool's keys and values)
  over a ragged batch of prefills, chains and a tree, twice, and attends through it in every layer.
* ``batch_attention``: ``flex`` on CUDA, ``ragged`` elsewhere, the environment variable forces either, a bad value
  is refused; a one-call forward that fails unforced finishes row by row, exactly, logs why once, and the process
  stays on the row-by-row path (forced, the failure is raised).
* Every batch-invariance and exactness suite of the batched engine passes with the one-call path forced on (the
  suites run again in a child pytest with ``SPECSERVE_BATCH_ATTENTION=flex``; FlexAttention runs its eager reference
  on the CPU).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyPair

import specserve.core.attention.flex as flex_batch
import specserve.core.attention.sdpa as attention_module
from specserve.core.attention.flex import ENV, batch_attention, block_mask, flex_attend
from specserve.core.attention.sdpa import RaggedBatch, RaggedRow
from specserve.core.attention.windows import window_mask
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock
from specserve.core.tree.draft_tree import DraftTree

LOW = torch.finfo(torch.float64).min


def reference(
    query: torch.Tensor,  # [batch, heads, width, d]
    key: torch.Tensor,  # [1, kv_heads, arena, d]
    value: torch.Tensor,
    rows: list[RaggedRow],
    masks: list[torch.Tensor | None],
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [batch, width, heads, d]
    batch, heads, width, _ = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(batch, width, heads, value.shape[-1], dtype=torch.float64)
    for b, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        for h in range(heads):
            k = key[0, h // group, row.start : row.stop]
            v = value[0, h // group, row.start : row.stop]
            for i in range(row.queries):
                scores = (query[b, h, i] @ k.T) * scaling
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                allowed = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask[i] > LOW
                logits = scores[allowed]
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h : h + 1]])
                weights = torch.softmax(logits, dim=0)[: int(allowed.sum())]
                out[b, i, h] = weights @ v[allowed]
    return out


def ragged_rows(
    spans: list[tuple[int, int, int]], generator: torch.Generator
) -> tuple[list[RaggedRow], list[torch.Tensor | None]]:
    """Rows at (start, prefix, queries) with random causal or tree masks (None for one query)."""
    rows: list[RaggedRow] = []
    masks: list[torch.Tensor | None] = []
    for start, prefix, queries in spans:
        rows.append(RaggedRow(start, start + prefix + queries, queries, None))
        if queries == 1:
            masks.append(None)
            continue
        block = torch.ones(queries, queries, dtype=torch.bool).tril()
        block &= (torch.rand(queries, queries, generator=generator) < 0.7) | torch.eye(queries, dtype=torch.bool)
        mask = torch.zeros(queries, prefix + queries, dtype=torch.float64)
        mask[:, prefix:].masked_fill_(~block, LOW)
        masks.append(mask)
    return rows, masks


@pytest.mark.parametrize("kind", ["plain", "window", "softcap", "sinks"])
def test_one_call_equals_an_independent_reference_row_by_row(kind: str) -> None:
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, width, dim, arena = 4, 2, 5, 8, 300
    spans = [(0, 40, 5), (60, 0, 3), (90, 130, 1), (230, 7, 4)]  # a chain, a prefill, one query, a tree-like block
    rows, masks = ragged_rows(spans, generator)
    if kind == "window":  # keys 16 or more positions behind their query are masked
        windowed: list[torch.Tensor | None] = []
        for (_, prefix, queries), mask in zip(spans, masks, strict=True):
            base = mask if mask is not None else torch.zeros(queries, prefix + queries, dtype=torch.float64)
            windowed.append(window_mask(base, torch.arange(prefix, prefix + queries), 16))
        masks = windowed
    query = torch.randn(len(rows), heads, width, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(1, kv_heads, arena, dim, generator=generator, dtype=torch.float64)
    value = torch.randn(1, kv_heads, arena, dim, generator=generator, dtype=torch.float64)
    softcap = 1.5 if kind == "softcap" else None
    sinks = torch.randn(heads, generator=generator, dtype=torch.float64) if kind == "sinks" else None
    blocks = block_mask(rows, masks, width, arena, query.device)
    got = flex_attend(query, key, value, blocks, 0.3, softcap, sinks)
    want = reference(query, key, value, rows, masks, 0.3, softcap, sinks)
    assert got.shape == (len(rows), width, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for b, row in enumerate(rows):  # padding queries attend to nothing
        assert not got[b, row.queries :].any()


def run_batch(pair: TinyPair, monkeypatch: pytest.MonkeyPatch, backend: str) -> tuple[list[torch.Tensor], KVPool]:
    monkeypatch.setenv(ENV, backend)
    target = pair.target
    prompts = [list(prompt) for prompt in pair.prompts[:3]]
    pool = KVPool(target.model, capacity=3 * 40)
    seqs = [pool.allocate(40) for _ in prompts]
    out = target.forward_batch(pool, [BatchBlock.chain(s, torch.tensor(p)) for s, p in zip(seqs, prompts, strict=True)])
    tree = DraftTree(torch.tensor([21, 22, 23, 24]), (-1, -1, 0, 1))
    blocks = [
        BatchBlock.chain(seqs[0], torch.tensor([9, 10, 11, 12])),
        BatchBlock.tree(seqs[1], 50, tree),
        BatchBlock.chain(seqs[2], torch.tensor([30])),
    ]
    out += target.forward_batch(pool, blocks)
    return out, pool


def test_a_batched_forward_attends_in_one_call_per_layer_and_equals_the_row_by_row_path(
    pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = attention_module.flex_attend

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "flex_attend", counted)
    ragged, ragged_pool = run_batch(pair, monkeypatch, "ragged")
    assert not calls
    flex, flex_pool = run_batch(pair, monkeypatch, "flex")
    assert len(calls) == 2 * len(flex_pool.keys)  # two forwards, one call per layer each
    for got, want in zip(flex, ragged, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    for got_pool, want_pool in ((flex_pool.keys, ragged_pool.keys), (flex_pool.values, ragged_pool.values)):
        for got, want in zip(got_pool, want_pool, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_path_is_flex_on_cuda_ragged_elsewhere_and_forced_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert batch_attention("cpu") == "ragged" and batch_attention(torch.device("cuda", 0)) == "flex"
    monkeypatch.setenv(ENV, "flex")
    assert batch_attention("cpu") == "flex"
    monkeypatch.setenv(ENV, " Ragged ")
    assert batch_attention("cuda") == "ragged"
    monkeypatch.setenv(ENV, "paged")
    with pytest.raises(ValueError, match="ragged, flex"):
        batch_attention("cpu")
    assert isinstance(RaggedBatch([]).one_call, bool)


def test_a_failing_one_call_forward_finishes_row_by_row_and_the_process_stays_there(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    generator = torch.Generator().manual_seed(4)
    rows, masks = ragged_rows([(0, 30, 3), (40, 10, 1)], generator)
    rows = [dataclasses.replace(row, mask=mask) for row, mask in zip(rows, masks, strict=True)]
    query = torch.randn(2, 4, 3, 8, generator=generator, dtype=torch.float64)
    key = torch.randn(1, 2, 60, 8, generator=generator, dtype=torch.float64)
    value = torch.randn(1, 2, 60, 8, generator=generator, dtype=torch.float64)
    want = RaggedBatch(rows, torch.float64).attend(query, key, value, 0.3)

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(attention_module, "flex_attend", broken)
    monkeypatch.setattr(flex_batch, "_failed", [])
    monkeypatch.setenv(ENV, "flex")  # forced: the failure is the caller's to see
    with pytest.raises(RuntimeError, match="no kernel"):
        RaggedBatch(rows, torch.float64, one_call=True).attend(query, key, value, 0.3)
    monkeypatch.delenv(ENV)
    assert batch_attention("cuda") == "flex"
    batch = RaggedBatch(rows, torch.float64, one_call=True)
    with caplog.at_level("WARNING", logger="specserve.core.attention.flex"):
        got = batch.attend(query, key, value, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same row-by-row calls
    assert not batch.one_call and batch_attention("cuda") == "ragged"
    assert next(r.message for r in caplog.records if "row by row" in r.message).endswith("no kernel for this device")


BATCHED_SUITES = [
    "tests/core/test_batch_engine.py",
    "tests/core/test_batch_isolation.py",
    "tests/core/kv/test_batch_kv.py",
    "tests/core/test_batch_sampling.py",
    "tests/core/verify/test_batch_verdicts.py",
    "tests/core/kv/test_prefix_cache.py",
    "tests/core/model/test_architectures.py::test_batched_engine_equals_transformers",
    "tests/core/model/test_architectures.py::test_a_batched_step_routes_each_real_token_to_the_experts_it_gets_alone",
    "tests/core/model/test_architectures.py::test_a_latent_pool_expands_only_the_positions_of_its_steps_rows",
]


@pytest.mark.slow  # about 5 minutes: the batched suites again, forced through the one-call path
def test_the_batched_suites_pass_with_one_attention_call_per_layer() -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, ENV: "flex"}
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not ray", *BATCHED_SUITES]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    assert result.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail and "skipped" not in tail, tail
