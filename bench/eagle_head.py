"""EAGLE drafting speed on the shipped pair: greedy tokens/s for a chain (γ 4) and a dynamic tree (depth 6, width 3,
16 nodes), best of 3 rounds over 4 code prompts × 64 new tokens, one torch thread.

Run from the checkout whose code is to be measured (the current directory's ``specserve`` is imported first), e.g.
this commit against another one checked out with ``git worktree add /tmp/old REV``:

    OMP_NUM_THREADS=1 .venv/bin/python bench/eagle_head.py
    (cd /tmp/old && OMP_NUM_THREADS=1 /path/to/.venv/bin/python /path/to/bench/eagle_head.py)

Prints one line per configuration. Needs models/target and models/eagle.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))

from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter

TEXTS = [
    "def parse_args(argv):",
    "import os\nimport sys\n\n",
    "class Node:\n    def __init__(self",
    "for i in range(10):",
]
TREE = TreeSpec("dynamic", budget=TreeBudget(depth=6, width=3, nodes=16))
CONFIGS = {"chain, γ 4": GenerationConfig(64, gamma=4), "dynamic tree 6/3/16": GenerationConfig(64, tree=TREE)}


def main() -> None:
    torch.set_num_threads(1)
    target = CausalLM.load("models/target")
    engine = SpeculativeEngine(target, EagleDrafter.load("models/eagle", target))
    prompts = [target.tokenizer(text)["input_ids"] for text in TEXTS]
    for name, config in CONFIGS.items():
        engine.generate(prompts[0], SamplingParams(), config)  # warm-up
        best, tokens = float("inf"), 0
        for _ in range(3):
            start, tokens = time.perf_counter(), 0
            for prompt in prompts:
                tokens += len(engine.generate(prompt, SamplingParams(), config).output_ids)
            best = min(best, time.perf_counter() - start)
        print(f"{Path.cwd().name} {name}: {tokens / best:.1f} tok/s ({tokens} tokens, best of 3)", flush=True)


if __name__ == "__main__":
    main()
