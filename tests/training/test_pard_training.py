"""PARD training (``specserve train pard``): the replicated segments show every mask token exactly what it sees when
serving, the conditional drop-out keeps a deeper mask only after the one before it, the mask token is one text never
holds, and a few steps on the tiny pair teach the draft to predict tokens further ahead."""

from __future__ import annotations

import torch
from conftest import TinyPair, build_model
from head_helpers import periodic, trained_target
from transformers import AutoTokenizer

from specserve import defaults
from specserve.core.model.causal_lm import CausalLM
from specserve.drafters.pard import PardDrafter
from specserve.training import loop
from specserve.training.heads import heldout_acceptance
from specserve.training.pard import choose_mask_token, pard_batch, pard_loss, teacher_forced

MASK = 0


def test_every_token_sees_what_it_sees_when_serving(tiny_pairs: dict[str, TinyPair]) -> None:
    """The logits of segment j's token of anchor t equal a plain forward of x_0 .. x_t then j masks (the serving
    block), at its last position; a real token's equal the causal forward's. Drop-out at 0.6, two windows."""
    draft = tiny_pairs["llama"].draft.model
    windows = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    built = pard_batch(windows, MASK, block_size=4, keep=0.6, seed=1)
    with torch.inference_mode():
        inputs = {"input_ids": built.input_ids, "position_ids": built.position_ids, "attention_mask": built.attention}
        logits = draft(**inputs).logits
        for b in range(2):
            for i in built.valid[b].nonzero().flatten().tolist():
                depth, position = int(built.depth[b, i]), int(built.source[b, i])
                anchor = position - depth
                ids = torch.tensor([[*windows[b, : anchor + 1].tolist(), *[MASK] * depth]])
                reference = draft(input_ids=ids).logits[0, -1]
                torch.testing.assert_close(logits[b, i], reference, atol=1e-5, rtol=1e-5)


def test_drop_out_is_conditional_and_stays_in_the_window() -> None:
    windows = torch.randint(3, 96, (3, 40), generator=torch.Generator().manual_seed(0))
    built = pard_batch(windows, MASK, block_size=5, keep=0.5, seed=7)
    again = pard_batch(windows, MASK, block_size=5, keep=0.5, seed=7)
    assert torch.equal(built.attention, again.attention)  # the seed decides the draws
    for b in range(3):
        kept = {
            (int(built.source[b, i]) - int(built.depth[b, i]), int(built.depth[b, i]))
            for i in built.valid[b].nonzero().flatten().tolist()
        }
        assert {(t, 0) for t in range(40)} <= kept
        assert all(j == 0 or (t, j - 1) in kept for t, j in kept)  # a deeper mask only after the one before it
        assert all(t + j < 40 for t, j in kept)
        deeper = [sum(1 for _, j in kept if j == d) for d in range(5)]
        assert deeper[0] == 40 and deeper[1] > deeper[2] > deeper[3] > 0  # about 40 · 0.5^j
    full = pard_batch(windows, MASK, block_size=3, keep=1.0, seed=0)
    assert int(full.valid.sum()) == 3 * (40 + 39 + 38)


def test_the_mask_token_is_one_no_text_holds() -> None:
    tokenizer = AutoTokenizer.from_pretrained(defaults.DEFAULT_TARGET)
    vocab = tokenizer.get_vocab()
    stream = torch.tensor(tokenizer("def f(x):\n    return 'ÿ'\n")["input_ids"])
    assert choose_mask_token(tokenizer, stream) == vocab["ÿ"]  # byte 0xFF: UTF-8 never holds it ('ÿ' is 0xC3 0xBF)
    assert choose_mask_token(tokenizer, torch.tensor([vocab["ÿ"]])) == vocab["þ"]  # 0xFE, when 0xFF were used


def test_a_few_steps_teach_the_draft_to_look_further_ahead() -> None:
    """On a stream whose future is predictable (a tiny target trained on a periodic sequence): 60 steps lower the
    loss and raise the draft's agreement with the target's greedy token at the mask positions (depths 2 and 3),
    where the untrained draft reads a mask as text; the real engine then accepts more per target pass."""
    target = trained_target()
    draft = build_model("llama", num_layers=1, seed=3)
    teacher = target.model.eval()
    loss_fn = pard_loss(teacher, MASK, 3, 0.8)
    probe = periodic(4 * 33, offset=5).reshape(4, 33)
    heldout, prompts = periodic(200, offset=11), [periodic(12, offset=o).tolist() for o in (3, 9, 17)]

    def measure() -> tuple[float, list[float], float]:
        with torch.no_grad():
            loss = float(loss_fn(draft, probe))
        agreement = teacher_forced(teacher, draft, MASK, 3, heldout, seq_len=32, windows=4)
        drafter = PardDrafter(CausalLM(draft), MASK, target)
        return loss, agreement, heldout_acceptance(target, drafter, prompts, 24, gamma=3)["mean_accepted_length"]

    loss_before, agreement_before, accepted_before = measure()
    cfg = loop.TrainConfig(steps=60, batch_size=8, seq_len=32, peak_lr=1e-2, warmup_steps=4, bf16_autocast=False)
    loop.train(draft, periodic(3000), loss_fn, cfg, desc="pard test")
    draft.eval()
    loss_after, agreement_after, accepted_after = measure()
    assert loss_after < 0.2 * loss_before, (loss_before, loss_after)
    assert all(after > before + 0.3 for before, after in zip(agreement_before[1:], agreement_after[1:], strict=True))
    assert accepted_after > accepted_before + 0.5, (accepted_before, accepted_after)
