"""In-process engine speed of one checkout: does a change to the loop's machinery cost tokens per second?

    python bench/engine_overhead.py [--prompts 6] [--max-new-tokens 96] [--rounds 3] [--label NAME]

Runs the shipped pair through ``SpeculativeEngine`` (greedy; plain decoding, the draft model at
γ 3, n-gram at γ 8, and a dynamic draft tree), one torch thread, the cells in alternating order
over ``--rounds``; prints one JSON line of tokens/s per cell and the greedy outputs' hash (equal
hashes across checkouts = identical tokens). Uses only APIs every checkout since the shipped pair
has, so two checkouts compare like for like:

    PYTHONPATH=/path/to/old/checkout python bench/engine_overhead.py --label before
    PYTHONPATH=. python bench/engine_overhead.py --label after
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=8))
    plain = SpeculativeEngine(target, build_drafter("none", target))
    draft = SpeculativeEngine(target, build_drafter(str(defaults.DEFAULT_DRAFT), target))
    ngram = SpeculativeEngine(target, build_drafter("ngram", target))
    cells = {  # name -> (engine, gamma, tree)
        "plain": (plain, 0, None),
        "draft γ3": (draft, 3, None),
        "ngram γ8": (ngram, 8, None),
        "draft tree": (draft, 3, tree),
    }
    prompts = heldout_prompts(args.prompts)
    tokens = dict.fromkeys(cells, 0)
    seconds = dict.fromkeys(cells, 0.0)
    digest = hashlib.sha256()
    names = list(cells)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            engine, gamma, shape = cells[name]
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=gamma, tree=shape, ignore_eos=True)
            for prompt in prompts:
                start = time.perf_counter()
                result = engine.generate(prompt, SamplingParams(), config)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(result.output_ids)
                if round_ == 0:
                    digest.update(json.dumps([name, result.output_ids]).encode())
    rates = {name: round(tokens[name] / seconds[name], 1) for name in names}
    report = {"label": args.label, "threads": 1, "tokens_per_second": rates, "outputs": digest.hexdigest()[:16]}
    print(json.dumps(report, ensure_ascii=False))


if __name__ == "__main__":
    main()
