"""How does one target forward's cost grow with the number of tokens k it scores?

The performance model's T_verify(k). Prints a table and, last, one JSON line:
{"model": ..., "cache_tokens": ..., "ms_by_k": {k: median ms}}.

    python bench/verify_cost.py [--model models/target] [--max-k 16] [--cache-tokens 400] [--repeats 21]
"""

from __future__ import annotations

import argparse
import json

import torch

from specserve import defaults
from specserve.benchmarks.timing import median_forward_seconds
from specserve.core.model.causal_lm import CausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(defaults.DEFAULT_TARGET))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--cache-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()

    model = CausalLM.load(args.model, dtype=args.dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = model.info.vocab_size
    prefix = torch.randint(0, vocab, (args.cache_tokens,), generator=gen).tolist()
    ms_by_k: dict[int, float] = {}
    for k in range(1, args.max_k + 1):
        block = torch.randint(0, vocab, (k,), generator=gen).tolist()
        ms_by_k[k] = round(1000 * median_forward_seconds(model, prefix, block, args.repeats), 2)
        print(f"k={k:3d}  {ms_by_k[k]:7.2f} ms  ({ms_by_k[k] / ms_by_k[1]:.2f}x k=1)")
    print(json.dumps({"model": args.model, "cache_tokens": args.cache_tokens, "ms_by_k": ms_by_k}))


if __name__ == "__main__":
    main()
