"""The KV pool and the batched forward: each row of a batch behaves exactly as its sequence alone.

* ``CausalLM.forward_batch`` over a mix of prefill chunks, verify chains and draft trees, in spans
  that are and are not adjacent, gives each block the logits its own ``forward`` /
  ``forward_tree`` gives (float64, both tiny architectures);
* after rollback and tree compaction each sequence's keys and values equal a fresh prefill of its text;
* greedy decoding of requests that join and leave the batch at different steps equals
  transformers' own greedy ``generate``, token for token;
* the pool's accounting in tokens: freed tokens come back, scattered free tokens are gathered for a
  newcomer without changing anyone's keys and values, and a sequence that cannot fit is refused, saying why.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, TinyPair, hf_greedy_ids

from specserve.core.batch_engine import BatchedEngine
from specserve.core.kv import pool as kv_pool
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import KVPool, PoolFull, pool_tokens, token_bytes
from specserve.core.model.causal_lm import BatchBlock, CausalLM
from specserve.core.tree.draft_tree import DraftTree
from specserve.drafters.ngram import NgramDrafter

ATOL = 1e-10  # float64: a row differs from its sequence alone only by the batch's summation order


def random_tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def assert_same_kv(pool: KVPool, seq_id: int, target: CausalLM, text: torch.Tensor) -> None:
    """The sequence holds exactly what a fresh prefill of ``text`` caches."""
    fresh = target.new_cache()
    target.forward(fresh, text)
    got, want = pool.snapshot(seq_id), fresh.snapshot()
    assert len(got) == len(want)
    for (keys, values), (fresh_keys, fresh_values) in zip(got, want, strict=True):
        assert keys.shape == fresh_keys.shape
        torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=ATOL)
        torch.testing.assert_close(values, fresh_values, rtol=0, atol=ATOL)


@pytest.mark.parametrize("packed", [True, False], ids=["adjacent-spans", "spans-with-gaps"])
def test_each_row_of_a_batch_equals_its_sequence_alone(pair: TinyPair, packed: bool) -> None:
    target = pair.target
    pool = KVPool(target.model, capacity=5 * 48)
    seqs = [pool.allocate(48) for _ in range(5)]
    if not packed:  # sequences 0, 2 and 4: freed spans lie between them
        for seq_id in (seqs[1], seqs[3]):
            pool.free(seq_id)
        seqs = [seqs[0], seqs[2], seqs[4]]
    else:
        for seq_id in seqs[3:]:
            pool.free(seq_id)
        seqs = seqs[:3]
    prompts = [random_tokens(n, seed) for seed, n in enumerate((7, 2, 12))]
    alone = [target.new_cache() for _ in prompts]

    prefill = target.forward_batch(pool, [BatchBlock.chain(s, p) for s, p in zip(seqs, prompts, strict=True)])
    for prompt, cache, logits in zip(prompts, alone, prefill, strict=True):
        torch.testing.assert_close(logits, target.forward(cache, prompt), rtol=0, atol=ATOL)

    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), (-1, -1, 0, 2, 1))
    chain = torch.tensor([4, 9, 10, 11])
    blocks = [
        BatchBlock.chain(seqs[0], chain),
        BatchBlock.tree(seqs[1], 11, tree),
        BatchBlock.chain(seqs[2], chain[:1]),
    ]
    got = target.forward_batch(pool, blocks)
    want = [
        target.forward(alone[0], chain),
        target.forward_tree(alone[1], 11, tree),
        target.forward(alone[2], chain[:1]),
    ]
    for logits, reference in zip(got, want, strict=True):
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, rtol=0, atol=ATOL)

    # keep two of the chain's four tokens, the tree's path 0 -> 2 -> 3, the whole one-token block
    pool.rollback(seqs[0], 7 + 2)
    prefix = 2  # the tree's sequence holds its prompt, then [root] + 5 nodes
    pool.compact(seqs[1], [*range(prefix + 1), prefix + 1 + 0, prefix + 1 + 2, prefix + 1 + 3])
    assert [pool.length(s) for s in seqs] == [9, 6, 13]
    assert_same_kv(pool, seqs[0], target, torch.cat([prompts[0], chain[:2]]))
    assert_same_kv(pool, seqs[1], target, torch.cat([prompts[1], torch.tensor([11, 5, 7, 8])]))
    assert_same_kv(pool, seqs[2], target, torch.cat([prompts[2], chain[:1]]))


def test_last_only_gives_each_rows_last_logits(pair: TinyPair) -> None:
    target = pair.target
    pool = KVPool(target.model, capacity=96)
    seqs = [pool.allocate(32) for _ in range(3)]
    tree = DraftTree(torch.tensor([5, 6, 7]), (-1, -1, 0))
    blocks = [
        BatchBlock.chain(seqs[0], random_tokens(9, 0)),
        BatchBlock.tree(seqs[1], 11, tree),
        BatchBlock.chain(seqs[2], random_tokens(1, 1)),
    ]
    full = target.forward_batch(pool, blocks)
    for seq_id in seqs:
        pool.rollback(seq_id, 0)
    last = target.forward_batch(pool, blocks, last_only=True)
    assert [pool.length(s) for s in seqs] == [9, 4, 1]  # the whole blocks are cached all the same
    for logits, reference in zip(last, full, strict=True):
        assert logits.shape == (1, VOCAB)
        torch.testing.assert_close(logits, reference[-1:], rtol=0, atol=ATOL)


def test_greedy_requests_joining_and_leaving_equal_transformers(pair: TinyPair) -> None:
    """Plain greedy decoding, one token per request per step, requests joining at different steps."""
    target = pair.target
    prompts = [list(p) for p in (pair.prompts[0], pair.prompts[1], pair.eos_prompts[0], pair.prompts[2])]
    budgets = [12, 5, 9, 7]
    needs = [len(prompt) + budget for prompt, budget in zip(prompts, budgets, strict=True)]
    pool = KVPool(target.model, capacity=sum(sorted(needs)[-3:]))  # never room for all four at once
    joins = [0, 0, 2, 4]  # step at which each request joins; the fourth waits for room
    running: dict[int, tuple[int, list[int]]] = {}  # request -> (seq_id, committed text)
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(outputs) < len(prompts):
        for request, join in enumerate(joins):
            if request not in running and request not in outputs and join <= step and pool.fits(needs[request]):
                seq_id = pool.allocate(needs[request])
                running[request] = (seq_id, list(prompts[request]))
        order = list(running.items())
        # a newcomer prefills its whole prompt; the others feed their last token (the cache holds the rest)
        blocks = [
            BatchBlock.chain(seq_id, torch.tensor(text if pool.length(seq_id) == 0 else text[-1:]))
            for _, (seq_id, text) in order
        ]
        for (request, (seq_id, text)), logits in zip(order, target.forward_batch(pool, blocks), strict=True):
            text.append(int(logits[-1].argmax()))
            new = len(text) - len(prompts[request])
            if new == budgets[request] or text[-1] in target.info.eos_token_ids:
                outputs[request] = text[len(prompts[request]) :]
                del running[request]
                pool.free(seq_id)
        step += 1
    assert pool.free_tokens == pool.capacity and pool.num_sequences == 0
    for request, prompt in enumerate(prompts):
        want = hf_greedy_ids(target.model, prompt, budgets[request])
        assert outputs[request] == want, f"request {request}"


def test_tokens_are_accounted_and_what_cannot_fit_is_refused(pair: TinyPair) -> None:
    target = pair.target
    pool = KVPool(target.model, capacity=12)
    with pytest.raises(PoolFull, match="does not fit a KV pool of 12"):
        pool.allocate(13)
    first, second = pool.allocate(8), pool.allocate(3)
    assert (first, second) == (0, 1) and pool.free_tokens == 1
    assert pool.fits(1) and not pool.fits(2)
    with pytest.raises(PoolFull, match="2 tokens asked, 1 of the KV pool's 12 are free"):
        pool.allocate(2)
    with pytest.raises(ValueError, match="distinct sequences"):
        target.forward_batch(pool, [BatchBlock.chain(first, random_tokens(1, 0))] * 2)
    for seed in (0, 1):
        target.forward_batch(pool, [BatchBlock.chain(first, random_tokens(4, seed))])
    one = [BatchBlock.chain(second, random_tokens(1, 2)), BatchBlock.chain(first, random_tokens(1, 3))]
    with pytest.raises(PoolFull, match="sequence 0 would hold 9 positions, more than the 8 it reserved"):
        target.forward_batch(pool, one)
    assert (pool.length(first), pool.length(second)) == (8, 0)  # a refused step changes no sequence
    pool.free(first)
    with pytest.raises(ValueError, match="not allocated"):
        pool.length(first)
    with pytest.raises(ValueError, match="roll sequence 1 of length 0 back to 1"):
        pool.rollback(second, 1)
    assert pool.allocate(2) == first  # the lowest free id again, empty
    assert pool.length(first) == 0
    pool.free(first)
    pool.free(second)
    assert pool.free_tokens == 12 and pool.num_sequences == 0


def test_padding_never_reaches_another_row(pair: TinyPair) -> None:
    """Blocks of very different widths: the short rows' padding queries write only the scratch columns."""
    target = pair.target
    pool = KVPool(target.model, capacity=64)
    ids = [pool.allocate(20), pool.allocate(20), pool.allocate(20)]
    texts = [random_tokens(3, 1), random_tokens(17, 2), random_tokens(1, 3)]
    got = target.forward_batch(pool, [BatchBlock.chain(i, t) for i, t in zip(ids, texts, strict=True)])
    for seq_id, text, logits in zip(ids, texts, got, strict=True):
        torch.testing.assert_close(logits, target.forward(target.new_cache(), text), rtol=0, atol=ATOL)
        assert_same_kv(pool, seq_id, target, text)


def test_kv_cache_and_pool_agree_on_compaction_rules(pair: TinyPair) -> None:
    """The pool refuses what KVCache.compact refuses: unordered or out-of-range positions."""
    pool = KVPool(pair.target.model, capacity=16)
    seq_id = pool.allocate(8)
    pair.target.forward_batch(pool, [BatchBlock.chain(seq_id, random_tokens(4, 0))])
    cache: KVCache = pair.target.new_cache()
    pair.target.forward(cache, random_tokens(4, 0))
    for keep in ([1, 0], [0, 4], [2, 2]):
        with pytest.raises(ValueError, match="strictly increasing"):
            pool.compact(seq_id, keep)
        with pytest.raises(ValueError, match="strictly increasing"):
            cache.compact(keep)


def test_scattered_free_tokens_are_gathered_for_a_newcomer(pair: TinyPair) -> None:
    """Free positions split between spans: the spans move down together, keeping their keys and values."""
    target = pair.target
    pool = KVPool(target.model, capacity=6 * 16)
    ids = [pool.allocate(16) for _ in range(6)]
    texts = [random_tokens(3 + i, 20 + i) for i in range(6)]
    target.forward_batch(pool, [BatchBlock.chain(i, text) for i, text in zip(ids, texts, strict=True)])
    for seq_id in (ids[1], ids[3], ids[5]):
        pool.free(seq_id)
    assert pool.free_tokens == 48
    newcomer = pool.allocate(40)  # no free run of 40: spans 0, 2 and 4 move down
    assert newcomer == 1 and pool.free_tokens == 8
    for seq_id in (ids[0], ids[2], ids[4]):
        assert_same_kv(pool, seq_id, target, texts[seq_id])
    later = random_tokens(5, 9)
    batch = [BatchBlock.chain(newcomer, later), BatchBlock.chain(ids[2], later[:2])]
    got = target.forward_batch(pool, batch)
    torch.testing.assert_close(got[0], target.forward(target.new_cache(), later), rtol=0, atol=ATOL)
    assert_same_kv(pool, newcomer, target, later)
    assert_same_kv(pool, ids[2], target, torch.cat([texts[2], later[:2]]))


def test_the_pool_is_sized_from_the_memory_it_may_take(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for max_num_seqs requests of max_seq_len, unless a share of the free memory holds fewer positions; one
    that cannot hold a single request is refused, naming what to change. Bytes per position are checked against
    the tensors a pool allocates."""
    model = pair.target.model
    pool = KVPool(model, 10)
    allocated = sum(t.numel() * t.element_size() for t in pool.keys + pool.values)
    assert token_bytes(model) * (pool.capacity + pool.scratch) == allocated
    per_token = token_bytes(model)
    monkeypatch.setattr(kv_pool, "free_memory", lambda device: 1000 * per_token)
    assert pool_tokens(model, max_num_seqs=4, max_seq_len=100, memory_fraction=0.5) == 400  # all 4 fit in 500
    assert pool_tokens(model, max_num_seqs=8, max_seq_len=100, memory_fraction=0.5) == 500  # 8 x 100 do not
    with pytest.raises(PoolFull, match=r"0\.05 of .*50 token positions.*max_seq_len 100.*raise kv_cache_memory"):
        pool_tokens(model, max_num_seqs=8, max_seq_len=100, memory_fraction=0.05)
    engine = BatchedEngine(pair.target, lambda name: NgramDrafter(), max_num_seqs=8, max_seq_len=100,
                           kv_memory_fraction=0.5)  # fmt: skip
    assert engine.pool.capacity == 500
    assert BatchedEngine(pair.target, lambda name: NgramDrafter(), max_num_seqs=8, max_seq_len=100,
                         kv_pool_tokens=900).pool.capacity == 900  # fmt: skip
