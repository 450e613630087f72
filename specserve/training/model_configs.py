"""Architectures of the shipped default pair (Llama family, so tensor parallelism applies).

Target: 8 layers x 512, grouped-query attention (8 query heads, 2 KV heads), tied embeddings,
about 26.7M parameters with the 8k vocabulary. Draft: 1 layer x 256, about 2.8M parameters.
"""

from __future__ import annotations

from transformers import LlamaConfig

MAX_POSITIONS = 1024


def target_config(vocab_size: int, eos_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def draft_config(vocab_size: int, eos_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
