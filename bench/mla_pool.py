"""A batched step of a multi-head latent attention target over the KV pool: the whole arena expanded, or its rows.

transformers' DeepSeek-V3 attention caches the compressed latent and expands (``kv_b_proj``) every position its cache
returns. The pool used to return its whole arena to every layer; a latent pool now returns the step's rows' spans only
(``KVPool.gathers``). This times one batched verify step both ways: a random DeepSeek-V3 at the shipped target's width
(hidden 512, 8 layers, 8 heads; latent 128, rotary 32, keys 96 and values 64 per head; a dense MLP: experts from the
4th layer are left out, they do not touch the cache), ``--rows`` sequences of ``--cached`` tokens each in a pool of
``--capacity`` positions, a verify block of ``--block`` tokens per row; median of ``--repeats``, 1 thread.

    python bench/mla_pool.py [--capacity 16384] [--rows 8] [--cached 256] [--block 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock, CausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--cached", type=int, default=256)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = DeepseekV3Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        first_k_dense_replace=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    target = CausalLM(AutoModelForCausalLM.from_config(config).float().eval())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (args.cached,), generator=generator) for _ in range(args.rows)]
    blocks = [torch.randint(3, 8192, (args.block,), generator=generator) for _ in range(args.rows)]
    results = {}
    for gathers in (False, True):
        pool = KVPool(target.model, capacity=args.capacity)
        pool.gathers = gathers
        seqs = [pool.allocate(args.capacity // args.rows) for _ in range(args.rows)]
        for seq, prompt in zip(seqs, prompts, strict=True):
            target.forward_batch(pool, [BatchBlock.chain(seq, prompt)], last_only=True)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            target.forward_batch(pool, [BatchBlock.chain(s, b) for s, b in zip(seqs, blocks, strict=True)])
            times.append(time.perf_counter() - start)
            for seq in seqs:
                pool.rollback(seq, args.cached)
        results["gathered" if gathers else "whole arena"] = 1000 * sorted(times)[len(times) // 2]
    for name, ms in results.items():
        print(f"{name:12s} {ms:8.1f} ms per step")
    print(json.dumps({**vars(args), "ms": results}))


if __name__ == "__main__":
    main()
