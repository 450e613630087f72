"""The KV pool and the batched forward: each row of a batch behaves exactly as its sequence alone.

* ``CausalLM.forward_batch`` over a mix of prefill chunks, verify chains and draft trees, in slots
  that are and are not consecutive, gives each block the logits its own ``forward`` /
  ``forward_tree`` gives (float64, both tiny architectures);
* after rollback and tree compaction each slot's keys and values equal a fresh prefill of its text;
* greedy decoding of requests that join and leave the batch at different steps equals
  transformers' own greedy ``generate``, token for token;
* the pool's accounting: slots come back, and a sequence that cannot fit is refused, saying why.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, TinyPair, hf_greedy_ids

from specserve.core.kv_pool import KVPool, PoolFull
from specserve.core.model import BatchBlock, CausalLM, KVCache
from specserve.core.tree import DraftTree

ATOL = 1e-10  # float64: a row differs from its sequence alone only by the batch's summation order


def random_tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def assert_same_kv(pool: KVPool, slot: int, target: CausalLM, text: torch.Tensor) -> None:
    """The slot holds exactly what a fresh prefill of ``text`` caches."""
    fresh = target.new_cache()
    target.forward(fresh, text)
    got, want = pool.snapshot(slot), fresh.snapshot()
    assert len(got) == len(want)
    for (keys, values), (fresh_keys, fresh_values) in zip(got, want, strict=True):
        assert keys.shape == fresh_keys.shape
        torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=ATOL)
        torch.testing.assert_close(values, fresh_values, rtol=0, atol=ATOL)


@pytest.mark.parametrize("consecutive", [True, False], ids=["consecutive-slots", "scattered-slots"])
def test_each_row_of_a_batch_equals_its_sequence_alone(pair: TinyPair, consecutive: bool) -> None:
    target = pair.target
    pool = KVPool(target.model, num_slots=5, slot_capacity=64, scratch=16)
    slots = [pool.allocate(48) for _ in range(5)]
    if not consecutive:  # rows 0, 2 and 4 of the pool: the batch reads them through an index
        for slot in (slots[1], slots[3]):
            pool.free(slot)
        slots = [slots[0], slots[2], slots[4]]
    else:
        for slot in slots[3:]:
            pool.free(slot)
        slots = slots[:3]
    prompts = [random_tokens(n, seed) for seed, n in enumerate((7, 2, 12))]
    alone = [target.new_cache() for _ in prompts]

    prefill = target.forward_batch(pool, [BatchBlock.chain(s, p) for s, p in zip(slots, prompts, strict=True)])
    for prompt, cache, logits in zip(prompts, alone, prefill, strict=True):
        torch.testing.assert_close(logits, target.forward(cache, prompt), rtol=0, atol=ATOL)

    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), (-1, -1, 0, 2, 1))
    chain = torch.tensor([4, 9, 10, 11])
    blocks = [
        BatchBlock.chain(slots[0], chain),
        BatchBlock.tree(slots[1], 11, tree),
        BatchBlock.chain(slots[2], chain[:1]),
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
    pool.rollback(slots[0], 7 + 2)
    prefix = 2  # the tree's slot holds its prompt, then [root] + 5 nodes
    pool.compact(slots[1], [*range(prefix + 1), prefix + 1 + 0, prefix + 1 + 2, prefix + 1 + 3])
    assert [pool.length(s) for s in slots] == [9, 6, 13]
    assert_same_kv(pool, slots[0], target, torch.cat([prompts[0], chain[:2]]))
    assert_same_kv(pool, slots[1], target, torch.cat([prompts[1], torch.tensor([11, 5, 7, 8])]))
    assert_same_kv(pool, slots[2], target, torch.cat([prompts[2], chain[:1]]))


def test_last_only_gives_each_rows_last_logits(pair: TinyPair) -> None:
    target = pair.target
    pool = KVPool(target.model, num_slots=3, slot_capacity=32, scratch=16)
    slots = [pool.allocate(32) for _ in range(3)]
    tree = DraftTree(torch.tensor([5, 6, 7]), (-1, -1, 0))
    blocks = [
        BatchBlock.chain(slots[0], random_tokens(9, 0)),
        BatchBlock.tree(slots[1], 11, tree),
        BatchBlock.chain(slots[2], random_tokens(1, 1)),
    ]
    full = target.forward_batch(pool, blocks)
    for slot in slots:
        pool.rollback(slot, 0)
    last = target.forward_batch(pool, blocks, last_only=True)
    assert [pool.length(s) for s in slots] == [9, 4, 1]  # the whole blocks are cached all the same
    for logits, reference in zip(last, full, strict=True):
        assert logits.shape == (1, VOCAB)
        torch.testing.assert_close(logits, reference[-1:], rtol=0, atol=ATOL)


def test_greedy_requests_joining_and_leaving_equal_transformers(pair: TinyPair) -> None:
    """Plain greedy decoding, one token per request per step, requests joining at different steps."""
    target = pair.target
    pool = KVPool(target.model, num_slots=3, slot_capacity=96, scratch=32)
    prompts = [list(p) for p in (pair.prompts[0], pair.prompts[1], pair.eos_prompts[0], pair.prompts[2])]
    budgets = [12, 5, 9, 7]
    joins = [0, 0, 2, 4]  # step at which each request joins; the fourth waits for a free slot
    running: dict[int, tuple[int, list[int]]] = {}  # request -> (slot, committed text)
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(outputs) < len(prompts):
        for request, join in enumerate(joins):
            if request not in running and request not in outputs and join <= step and pool.free_slots:
                slot = pool.allocate(len(prompts[request]) + budgets[request])
                running[request] = (slot, list(prompts[request]))
        order = list(running.items())
        # a newcomer prefills its whole prompt; the others feed their last token (the cache holds the rest)
        blocks = [
            BatchBlock.chain(slot, torch.tensor(text if pool.length(slot) == 0 else text[-1:]))
            for _, (slot, text) in order
        ]
        for (request, (slot, text)), logits in zip(order, target.forward_batch(pool, blocks), strict=True):
            text.append(int(logits[-1].argmax()))
            new = len(text) - len(prompts[request])
            if new == budgets[request] or text[-1] in target.info.eos_token_ids:
                outputs[request] = text[len(prompts[request]) :]
                del running[request]
                pool.free(slot)
        step += 1
    assert pool.free_slots == 3
    for request, prompt in enumerate(prompts):
        want = hf_greedy_ids(target.model, prompt, budgets[request])
        assert outputs[request] == want, f"request {request}"


def test_slots_are_accounted_and_what_cannot_fit_is_refused(pair: TinyPair) -> None:
    target = pair.target
    pool = KVPool(target.model, num_slots=2, slot_capacity=8, scratch=4)
    with pytest.raises(PoolFull, match="does not fit a KV slot of 8"):
        pool.allocate(9)
    first, second = pool.allocate(8), pool.allocate(3)
    assert (first, second) == (0, 1) and pool.free_slots == 0
    with pytest.raises(PoolFull, match="all 2 KV slots are in use"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="scratch"):  # padding one block of 1 to another of 6
        target.forward_batch(
            pool, [BatchBlock.chain(first, random_tokens(6, 0)), BatchBlock.chain(second, random_tokens(1, 0))]
        )
    with pytest.raises(ValueError, match="distinct slots"):
        target.forward_batch(pool, [BatchBlock.chain(first, random_tokens(1, 0))] * 2)
    for seed in (0, 1):
        target.forward_batch(pool, [BatchBlock.chain(first, random_tokens(4, seed))])
    one = [BatchBlock.chain(second, random_tokens(1, 2)), BatchBlock.chain(first, random_tokens(1, 3))]
    with pytest.raises(PoolFull, match="slot 0 would hold 9 positions, more than its 8"):
        target.forward_batch(pool, one)
    assert (pool.length(first), pool.length(second)) == (8, 0)  # a refused step changes no slot
    pool.free(first)
    with pytest.raises(ValueError, match="not allocated"):
        pool.length(first)
    with pytest.raises(ValueError, match="roll slot 1 of length 0 back to 1"):
        pool.rollback(second, 1)
    assert pool.allocate(2) == first  # the lowest free slot again, empty
    assert pool.length(first) == 0
    pool.free(first)
    pool.free(second)
    assert pool.free_slots == 2


def test_kv_cache_and_pool_agree_on_compaction_rules(pair: TinyPair) -> None:
    """The pool refuses what KVCache.compact refuses: unordered or out-of-range positions."""
    pool = KVPool(pair.target.model, num_slots=1, slot_capacity=16, scratch=4)
    slot = pool.allocate(8)
    pair.target.forward_batch(pool, [BatchBlock.chain(slot, random_tokens(4, 0))])
    cache: KVCache = pair.target.new_cache()
    pair.target.forward(cache, random_tokens(4, 0))
    for keep in ([1, 0], [0, 4], [2, 2]):
        with pytest.raises(ValueError, match="strictly increasing"):
            pool.compact(slot, keep)
        with pytest.raises(ValueError, match="strictly increasing"):
            cache.compact(keep)


def test_packing_moves_sequences_down_into_freed_slots(pair: TinyPair) -> None:
    target = pair.target
    pool = KVPool(target.model, num_slots=6, slot_capacity=32, scratch=8)
    slots = [pool.allocate(32) for _ in range(6)]
    texts = [random_tokens(3 + i, 20 + i) for i in range(6)]
    target.forward_batch(pool, [BatchBlock.chain(slot, text) for slot, text in zip(slots, texts, strict=True)])
    for slot in (slots[1], slots[2], slots[4]):
        pool.free(slot)
    moves = pool.packing()
    assert moves == [(5, 1), (3, 2)]  # the highest allocated slot to the lowest free one, until 0..n-1 are used
    for source, dest in moves:
        pool.move(source, dest)
    assert pool.free_slots == 3 and pool.packing() == []
    for slot, text in ((0, texts[0]), (1, texts[5]), (2, texts[3])):
        assert_same_kv(pool, slot, target, text)
    with pytest.raises(ValueError, match="not free"):
        pool.move(0, 1)
