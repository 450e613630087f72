"""The shared training loop: the loss falls, and a resumed run ends where an uninterrupted run does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.training import loop


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def stream() -> torch.Tensor:
    return torch.arange(2000) % 37  # a periodic stream: next-token loss can fall far


def config(steps: int) -> loop.TrainConfig:
    return loop.TrainConfig(steps=steps, batch_size=4, seq_len=16, warmup_steps=2, peak_lr=1e-2, bf16_autocast=False)


def test_loss_falls() -> None:
    model = tiny_model()
    before = loop.heldout_loss(model, stream(), seq_len=16, max_windows=8)
    loop.train(model, stream(), loop.next_token_loss, config(40), desc="test")
    assert loop.heldout_loss(model, stream(), seq_len=16, max_windows=8) < 0.5 * before


def test_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = tiny_model()
    loop.train(straight, stream(), loop.next_token_loss, config(12), desc="straight")

    resumed = tiny_model()
    # the first run checkpoints at step 6 and "dies" there: a config whose steps end at 6 is another config,
    # so stop it by running 6 steps of the 12-step config through a checkpoint-every-6 run interrupted by a raise
    calls = 0

    def dying_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > 6:
            raise KeyboardInterrupt
        return loop.next_token_loss(model, batch)

    with pytest.raises(KeyboardInterrupt):
        loop.train(resumed, stream(), dying_loss, config(12), desc="dies", checkpoint_dir=tmp_path, checkpoint_every=6)
    fresh = tiny_model(seed=99)  # a new process would start from other weights: the checkpoint must restore them
    summary = loop.train(fresh, stream(), loop.next_token_loss, config(12), desc="resumes", checkpoint_dir=tmp_path)
    assert summary["resumed_from_step"] == 6
    for (name, a), b in zip(straight.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_resume_refuses_another_config(tmp_path: Path) -> None:
    loop.train(tiny_model(), stream(), loop.next_token_loss, config(2), desc="a", checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="another training config"):
        loop.train(tiny_model(), stream(), loop.next_token_loss, config(3), desc="b", checkpoint_dir=tmp_path)
