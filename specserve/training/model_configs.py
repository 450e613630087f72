"""Architectures of the shipped default pair (Llama family, so tensor parallelism applies).

Target: 8 layers x 512, grouped-query attention (8 query heads, 2 KV heads), tied embeddings,
about 26.7M parameters with the 8k vocabulary. Draft: 1 layer x 256, about 2.8M parameters.
"""

from __future__ import annotations

from transformers import LlamaConfig

MAX_POSITIONS = 1024


def _llama(
    vocab_size: int, eos_token_id: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def target_config(vocab_size: int, eos_token_id: int) -> LlamaConfig:
    return _llama(vocab_size, eos_token_id, hidden=512, mlp=1408, layers=8, heads=8, kv_heads=2)


def draft_config(vocab_size: int, eos_token_id: int) -> LlamaConfig:
    return _llama(vocab_size, eos_token_id, hidden=256, mlp=704, layers=1, heads=4, kv_heads=2)
