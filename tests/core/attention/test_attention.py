"""Grouped-query attention over masked blocks (specserve.core.attention.sdpa) equals transformers' own sdpa path."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specserve.core.attention.sdpa import ATTENTION, grouped_sdpa_attention, native_attention
from specserve.core.model.causal_lm import CausalLM


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch: int, kv_heads: int, groups: int, q: int, kv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, q, 16, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, kv, 16, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, kv, 16, generator=generator, dtype=torch.float64)
    # per row: a prefix, a tree-like block pattern, padding queries that see one key (as forward_batch builds)
    allowed = torch.rand(batch, 1, q, kv, generator=generator) < 0.6
    allowed[..., 0] = True
    mask = torch.zeros(batch, 1, q, kv, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    return query, key, value, mask


@pytest.mark.parametrize(("groups", "q"), [(2, 2), (2, 5), (4, 3), (3, 7)])
def test_masked_blocks_equal_the_repeat_kv_path(groups: int, q: int) -> None:
    module = _Module(groups)
    query, key, value, mask = _inputs(3, 2, groups, q, 11)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)  # repeat_kv: q > 1 with a mask
    assert got.shape == want.shape == (3, q, 2 * groups, 16)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("groups", "q", "masked"), [(1, 4, True), (2, 1, True), (2, 4, False)])
def test_other_cases_are_transformers_own(groups: int, q: int, masked: bool) -> None:
    module = _Module(groups)
    query, key, value, mask = _inputs(2, 2, groups, q, 9, seed=1)
    given = mask if masked else None
    got, _ = grouped_sdpa_attention(module, query, key, value, given)
    want, _ = sdpa_attention_forward(module, query, key, value, given)
    assert torch.equal(got, want)


def test_a_wrapped_sdpa_model_uses_it_and_keeps_its_outputs() -> None:
    model = build_model("llama", seed=3).double()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding: a 4-D mask with several query tokens
    before = model(input_ids=ids, attention_mask=mask).logits
    lm = CausalLM(model)
    assert lm.model.config._attn_implementation == ATTENTION
    after = lm.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(after[1, 3:], before[1, 3:], rtol=0, atol=1e-10)


def test_native_attention_switches_back_for_the_block_only() -> None:
    lm = CausalLM(build_model("qwen2", seed=4).double())
    with native_attention(lm.model):
        assert lm.model.config._attn_implementation == "sdpa"
    assert lm.model.config._attn_implementation == ATTENTION
    with native_attention(None):  # nothing to switch
        pass


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_a_ragged_batch_attends_each_row_over_its_own_span(groups: int) -> None:
    """Rows of different block lengths over spans of one arena, with and without masks: each row's real queries
    equal transformers' attention over that row's keys alone; padding queries get zeros; other spans are never
    read (poisoning them changes nothing)."""
    from specserve.core.attention.sdpa import RaggedBatch, RaggedRow

    generator = torch.Generator().manual_seed(2)
    kv_heads, width, d = 2, 4, 16
    module = _Module(groups)
    query = torch.randn(3, kv_heads * groups, width, d, generator=generator, dtype=torch.float64)
    arena_k = torch.randn(1, kv_heads, 40, d, generator=generator, dtype=torch.float64)
    arena_v = torch.randn(1, kv_heads, 40, d, generator=generator, dtype=torch.float64)
    low = torch.finfo(torch.float64).min
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two children of the first token
    masks = [
        None,  # one query: sees its whole span
        torch.zeros(4, 9, dtype=torch.float64).masked_fill(~torch.ones(4, 9, dtype=torch.bool).tril(5), low),
        torch.cat(
            [torch.zeros(3, 6, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64).masked_fill(~tree, low)], 1
        ),
    ]
    rows = [RaggedRow(30, 37, 1, masks[0]), RaggedRow(0, 9, 4, masks[1]), RaggedRow(12, 21, 3, masks[2])]
    got = RaggedBatch(rows).attend(query, arena_k, arena_v, 0.25)
    assert got.shape == (3, width, kv_heads * groups, d)
    for b, row in enumerate(rows):
        keys, values = arena_k[:, :, row.start : row.stop], arena_v[:, :, row.start : row.stop]
        mask = None if row.mask is None else row.mask[None, None]
        want, _ = sdpa_attention_forward(module, query[b : b + 1, :, : row.queries], keys, values, mask, scaling=0.25)
        torch.testing.assert_close(got[b, : row.queries], want[0], rtol=0, atol=1e-12)
        assert torch.all(got[b, row.queries :] == 0)
    poisoned_k, poisoned_v = arena_k.clone(), arena_v.clone()
    for lo, hi in ((9, 12), (21, 30), (37, 40)):  # every column no row's span covers
        poisoned_k[:, :, lo:hi], poisoned_v[:, :, lo:hi] = float("nan"), float("nan")
    assert torch.equal(RaggedBatch(rows).attend(query, poisoned_k, poisoned_v, 0.25), got)
