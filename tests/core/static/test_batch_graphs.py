"""Captured batched steps (:mod:`specserve.core.static.batch_graphs`) on the CPU, through the stand-in graph backend.

:class:`RecordingGraphs` records a step once per shape with ``make_fx`` (every Python value it reads baked in, every
tensor held by reference) and replays the recording, as a CUDA graph would.

* A captured step equals the same step run eagerly bit for bit, and the ordinary batched step (row by row) up to
  rounding — logits, features and the pool's keys and values — over ragged batches of prefills, chains and trees,
  with rows joining and leaving, full and last-token logits; dummy rows and padding write only to scratch.
* A step that reads Python state a replay cannot see (the rows' lengths read on the host) goes wrong under the stand-in,
  as it would on a GPU: the stand-in can tell.
* The batched engine on captured steps (target steps and the draft model's batched forwards): greedy output equals
  transformers' ``generate`` for draft-model chains, n-gram, dynamic trees and plain decoding, more requests than
  slots; seeded sampled output is what the engine without graphs emits.
* Steps past the buckets (rows, width, span), pools a captured step cannot serve, and failed captures run the ordinary
  forward, exactly; no backend, no static shapes or no width buckets build no graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import REF_TOKENS, TinyPair, assert_pool_empty, finish_all
from static_helpers import BUCKETS, RecordingGraphs

from specserve.core.batch_engine import BatchedEngine
from specserve.core.kv.pool import KVPool
from specserve.core.model.buckets import NO_BUCKETS, VerifyBuckets
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.static import batch_graphs as batch_graphs_module
from specserve.core.static.batch_graphs import BatchGraphs, batch_graphs, span_bucket
from specserve.core.static.options import StaticOptions
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.batched_model import BatchedDraftModel
from specserve.drafters.registry import request_drafters

DYNAMIC_TREE = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
Steps = list[list[torch.Tensor]]


def chain(seq: int, *tokens: int) -> BatchBlock:
    return BatchBlock.chain(seq, torch.tensor(tokens))


def scripted_steps(model: CausalLM, graphs: RecordingGraphs | bool | None) -> tuple[Steps, KVPool, BatchGraphs | None]:
    """A ragged script on a fresh pool: prefills of different lengths, chains, a tree, a row leaving and one joining,
    last-token steps and a step capturing features. ``graphs``: ``False`` runs the ordinary batched forward, ``None``
    the captured step's function eagerly, a backend records and replays it."""
    pool = KVPool(model.model, 512, scratch=3)
    owner = None if graphs is False else BatchGraphs(model, pool, BUCKETS, graphs)  # type: ignore[arg-type]
    a, b, c = (pool.allocate(120) for _ in range(3))
    capture = FeatureCapture((0, 2))
    script: list[tuple[list[BatchBlock], bool, list[FeatureCapture | None] | None]] = [
        ([chain(a, 5, 6, 7, 8, 9, 10, 11), chain(b, 8, 9), chain(c, 3)], False, None),  # prefills of 7, 2, 1
        ([chain(a, 12), BatchBlock.after(b, 11, torch.tensor([12, 13, 14]), [-1, 0, -1]), chain(c, 4, 5)], False, None),
        ([chain(a, 13, 4, 4), chain(c, 7, 7)], True, None),  # b sits this step out
        ([chain(a, 9), chain(b, 20, 21), chain(c, 22)], False, [None, capture, None]),
    ]
    outputs: Steps = []
    for blocks, last_only, captures in script:
        outputs.append(model.forward_batch(pool, blocks, last_only=last_only, capture=captures, graphs=owner))
    outputs.append([capture.value])  # type: ignore[list-item]
    pool.rollback(a, 9)  # a verdict: a's last block rejected past its first token
    pool.free(b)  # b leaves; d joins with a prompt of its own
    d = pool.allocate(120)
    outputs.append(model.forward_batch(pool, [chain(d, 30, 31, 32, 33), chain(a, 40), chain(c, 41)], graphs=owner))
    for _ in range(3):  # steady decoding at one shape: replays
        outputs.append(model.forward_batch(pool, [chain(d, 50), chain(a, 51), chain(c, 52)], graphs=owner))
    return outputs, pool, owner


def assert_steps_equal(got: Steps, want: Steps, exact: bool) -> None:
    tolerance = 0.0 if exact else 1e-10
    for step, (row_got, row_want) in enumerate(zip(got, want, strict=True)):
        for x, y in zip(row_got, row_want, strict=True):
            assert x.shape == y.shape, f"step {step}"
            assert torch.allclose(x, y, rtol=tolerance, atol=tolerance), f"step {step}: {(x - y).abs().max()}"


def assert_pools_equal(got: KVPool, want: KVPool, exact: bool) -> None:
    assert got.sequences == want.sequences
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-10, "atol": 1e-10}
    for sequence in want.sequences:
        assert got.length(sequence) == want.length(sequence)
        for (kg, vg), (kw, vw) in zip(got.snapshot(sequence), want.snapshot(sequence), strict=True):
            torch.testing.assert_close(kg, kw, **tolerance)
            torch.testing.assert_close(vg, vw, **tolerance)


def test_a_captured_step_equals_the_eager_one_and_the_ordinary_batched_step(pair: TinyPair) -> None:
    ordinary, ordinary_pool, _ = scripted_steps(pair.target, False)
    eager, eager_pool, eager_owner = scripted_steps(pair.target, None)
    recording = RecordingGraphs()
    graphed, graphed_pool, graphed_owner = scripted_steps(pair.target, recording)
    assert eager_owner is not None and graphed_owner is not None
    assert eager_owner.steps == graphed_owner.steps == 8  # every step of the script fits the buckets
    assert_steps_equal(graphed, eager, exact=True)
    assert_pools_equal(graphed_pool, eager_pool, exact=True)
    assert_steps_equal(graphed, ordinary, exact=False)
    assert_pools_equal(graphed_pool, ordinary_pool, exact=False)
    # (rows, width, span, last only, features): the steady steps replay one shape; nothing else was captured
    keys = graphed_owner.graphs.keys
    assert len(keys) == recording.captures and recording.replays == 8
    assert graphed_owner.graphs.replays((4, 1, 64, False, False)) == 3
    assert {key[2] for key in keys} == {64} and all(key[0] in (2, 4) for key in keys)


def test_dummy_rows_and_padding_write_only_to_scratch(pair: TinyPair) -> None:
    pool = KVPool(pair.target.model, 64, scratch=2)
    owner = BatchGraphs(pair.target, pool, BUCKETS, RecordingGraphs())
    a, b, c = (pool.allocate(20) for _ in range(3))
    pair.target.forward_batch(pool, [chain(a, 5, 6), chain(b, 7)], graphs=owner)  # prime two spans
    before = [(k.clone(), v.clone()) for k, v in zip(pool.keys, pool.values, strict=True)]
    # three rows pad to four (a dummy row), widths 1 and 3 pad to 4: only their own new columns and scratch change
    pair.target.forward_batch(pool, [chain(a, 8), chain(b, 9, 10, 11), chain(c, 12)], graphs=owner)
    changed = {a: (2, 3), b: (1, 4), c: (0, 1)}
    written = torch.zeros(pool.capacity + pool.scratch, dtype=torch.bool)
    for sequence, (first, stop) in changed.items():
        start = 20 * sequence
        written[start + first : start + stop] = True
    for (k_before, v_before), k, v in zip(before, pool.keys, pool.values, strict=True):
        untouched = ~written
        untouched[pool.capacity :] = False  # scratch may take anything
        assert torch.equal(k[:, untouched], k_before[:, untouched])
        assert torch.equal(v[:, untouched], v_before[:, untouched])
    assert owner.graphs.keys == [(2, 2, 64, False, False), (4, 4, 64, False, False)]


def test_a_step_reading_python_state_goes_wrong_under_the_stand_in(
    pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in must catch what a GPU replay would get wrong: a step that reads the rows' lengths on the host bakes
    the lengths of its capture into the recording, and its replays then attend and write at the wrong positions."""
    step = BatchGraphs._step

    def leaky(self: BatchGraphs, table: torch.Tensor, *rest: object) -> tuple[torch.Tensor, ...]:
        lengths = torch.tensor(table[:, 1].tolist(), device=table.device)  # a host read
        return step(self, torch.cat([table[:, :1], lengths[:, None], table[:, 2:]], dim=1), *rest)  # type: ignore[arg-type]

    def decode(graphs: RecordingGraphs | None) -> list[torch.Tensor]:
        pool = KVPool(pair.target.model, 256)
        owner = BatchGraphs(pair.target, pool, BUCKETS, graphs)
        a, b = pool.allocate(60), pool.allocate(60)
        pair.target.forward_batch(pool, [chain(a, 5, 6, 7), chain(b, 8, 9, 10, 11)], graphs=owner)
        return [pair.target.forward_batch(pool, [chain(a, t), chain(b, t)], graphs=owner)[0] for t in range(12, 18)]

    honest = decode(RecordingGraphs())
    assert all(torch.equal(x, y) for x, y in zip(honest, decode(None), strict=True))
    monkeypatch.setattr(BatchGraphs, "_step", leaky)
    eager, replayed = decode(None), decode(RecordingGraphs())
    assert all(torch.equal(x, y) for x, y in zip(eager, honest, strict=True))  # eagerly the host read is harmless
    assert torch.equal(replayed[0], eager[0])  # the capture itself is right
    assert not any(torch.allclose(x, y) for x, y in zip(replayed[1:], eager[1:], strict=True))  # every replay is wrong


def graphed_engine(pair: TinyPair, recording: RecordingGraphs | None, slots: int = 3) -> BatchedEngine:
    """The batched engine with static shapes, its target steps and its draft model's forwards on ``recording``."""
    static = StaticOptions(buckets=BUCKETS)
    drafters = request_drafters(pair.draft, pair.target, max_num_seqs=slots, max_seq_len=64)
    engine = BatchedEngine(
        pair.target, drafters, max_num_seqs=slots, max_seq_len=64, prefill_tokens=16, static=static,
        graph_backend=recording,
    )  # fmt: skip
    batcher = drafters("default").batcher  # type: ignore[attr-defined]
    assert isinstance(batcher, BatchedDraftModel)
    if recording is not None:
        batcher.graphs = BatchGraphs(pair.draft, batcher.pool, BUCKETS, recording)
    return engine


CONFIGS = [
    GenerationConfig(max_new_tokens=REF_TOKENS, gamma=3),
    GenerationConfig(max_new_tokens=REF_TOKENS, gamma=2, drafter="ngram"),
    GenerationConfig(max_new_tokens=REF_TOKENS, tree=DYNAMIC_TREE),
    GenerationConfig(max_new_tokens=REF_TOKENS, drafter="none"),
    GenerationConfig(max_new_tokens=REF_TOKENS, gamma=4),
]


def test_the_batched_engine_on_captured_steps_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    recording = RecordingGraphs()
    engine = graphed_engine(pair, recording)
    prompts = [list(p) for p in pair.prompts[: len(CONFIGS)]]  # five requests for three slots: joins and leaves
    ids = {engine.submit(p, SamplingParams(), c): p for p, c in zip(prompts, CONFIGS, strict=True)}
    results = finish_all(engine)
    for request_id, prompt in ids.items():
        out = results[request_id].output_ids
        assert out == hf_greedy(pair.target, prompt, REF_TOKENS)[: len(out)] and out, f"prompt {prompt}"
    assert_pool_empty(engine)
    assert engine.graphs is not None and engine.graphs.steps > 0
    batcher = engine.new_drafter("default").batcher  # type: ignore[attr-defined]
    assert batcher.graphs.steps > 0  # the draft model's batched forwards ran captured too
    assert recording.replays > recording.captures > 0


def test_seeded_sampled_output_on_captured_steps_is_the_eager_engines(pair: TinyPair) -> None:
    params = SamplingParams(temperature=1.0, top_k=8)
    configs = [GenerationConfig(max_new_tokens=12, gamma=3), GenerationConfig(max_new_tokens=12, tree=DYNAMIC_TREE)]

    def outputs(recording: RecordingGraphs | None) -> list[list[int]]:
        engine = graphed_engine(pair, recording)
        ids = [
            engine.submit(list(prompt), SamplingParams(**{**params.__dict__, "seed": seed}), configs[seed % 2])
            for seed, prompt in enumerate(pair.prompts[:4])
        ]
        results = finish_all(engine)
        return [results[i].output_ids for i in ids]

    assert outputs(RecordingGraphs()) == outputs(None)


def test_steps_past_the_buckets_or_pools_it_cannot_serve_run_the_ordinary_forward(pair: TinyPair) -> None:
    pool = KVPool(pair.target.model, 256)
    owner = BatchGraphs(pair.target, pool, VerifyBuckets((1, 2, 4)), RecordingGraphs(), rows=VerifyBuckets((1, 2)))
    a, b, c = (pool.allocate(80) for _ in range(3))
    assert not owner.fits([chain(a, 1), chain(b, 2), chain(c, 3)])  # three rows, two at most
    assert not owner.fits([chain(a, *range(3, 8))])  # a block of 5, 4 at most
    assert owner.fits([chain(a, 1, 2), chain(b, 3)])
    reference_pool = KVPool(pair.target.model, 256)
    for sequence in (a, b, c):
        assert reference_pool.allocate(80) == sequence
    for blocks in ([chain(a, *range(3, 8)), chain(b, 9)], [chain(a, 1), chain(b, 2), chain(c, 3)]):
        got = pair.target.forward_batch(pool, blocks, graphs=owner)
        want = pair.target.forward_batch(reference_pool, blocks)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert owner.steps == 0
    short = BatchGraphs(pair.target, pool, BUCKETS, None, max_span=64)
    assert short.fits([chain(a, 1)]) and not short.fits([chain(a, *range(60))])  # a span of 66 past 64
    assert span_bucket(1) == span_bucket(64) == 64 and span_bucket(65) == 128 and span_bucket(129) == 256


def test_a_failed_capture_runs_the_step_eagerly_and_exactly(pair: TinyPair, caplog: pytest.LogCaptureFixture) -> None:
    eager, eager_pool, _ = scripted_steps(pair.target, None)
    failing = RecordingGraphs(fail=True)
    got, got_pool, owner = scripted_steps(pair.target, failing)
    assert_steps_equal(got, eager, exact=True)
    assert_pools_equal(got_pool, eager_pool, exact=True)
    assert owner is not None and owner.graphs.failures and not owner.graphs.keys
    assert "could not capture a graph" in caplog.text


def test_which_runtimes_build_captured_steps(pair: TinyPair) -> None:
    pool = KVPool(pair.target.model, 64)
    assert batch_graphs(pair.target, pool, None, RecordingGraphs()) is None  # no static shapes
    assert batch_graphs(pair.target, pool, StaticOptions(), None) is None  # a CPU: no CUDA graphs, no buckets
    assert batch_graphs(pair.target, pool, StaticOptions(buckets=NO_BUCKETS), RecordingGraphs()) is None
    built = batch_graphs(pair.target, pool, StaticOptions(buckets=BUCKETS), RecordingGraphs())
    assert built is not None and built.widths == BUCKETS and built.max_span == span_bucket(64)
    engine = BatchedEngine(pair.target, lambda name: None, static=StaticOptions(buckets=BUCKETS))  # type: ignore[arg-type,return-value]
    assert engine.graphs is None  # static shapes on a CPU: no backend, the ordinary forward
    assert batch_graphs_module.ROW_BUCKETS.largest == 256


def test_row_buckets_come_from_the_settings() -> None:
    from specserve.cluster.replica_config import ReplicaConfig

    config = ReplicaConfig(target="t", draft="ngram", static_shapes="on", row_buckets="1,8,64")
    static = config.static_options()
    assert static is not None and static.row_buckets == VerifyBuckets((1, 8, 64))
    off = ReplicaConfig(target="t", draft="ngram", static_shapes="on", row_buckets="none").static_options()
    assert off is not None and off.row_buckets == NO_BUCKETS
    with pytest.raises(Exception, match="strictly increasing"):
        ReplicaConfig(target="t", draft="ngram", row_buckets="8,2")


def test_captured_steps_pad_to_the_row_buckets_given(pair: TinyPair) -> None:
    pool = KVPool(pair.target.model, 64)
    rows = VerifyBuckets((1, 3))
    built = batch_graphs(pair.target, pool, StaticOptions(buckets=BUCKETS, row_buckets=rows), RecordingGraphs())
    assert built is not None and built.rows == rows
    a, b = pool.allocate(20), pool.allocate(20)
    pair.target.forward_batch(pool, [chain(a, 5, 6), chain(b, 7)], graphs=built)
    assert built.graphs.keys == [(3, 2, 64, False, False)]  # two rows pad to three
    none = StaticOptions(buckets=BUCKETS, row_buckets=NO_BUCKETS)
    assert batch_graphs(pair.target, pool, none, RecordingGraphs()) is None
