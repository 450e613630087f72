"""Preliminary (issue 5 in progress): chain vs static vs dynamic draft trees, in process, greedy, shipped pair.

`python bench/trees_quick.py [num_prompts]` prints tokens/s and mean accepted length per configuration
over the first held-out prompts (128 new tokens each). The issue's benchmark (equal verified nodes
k = 4/8/16/32, greedy and temperature 1, results in BENCHMARKS.md) replaces it when trees are done.
"""

import sys
import time

import torch

from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.model import CausalLM
from specserve.core.sampling import SamplingParams
from specserve.core.tree import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.registry import build_drafter_set

STATIC = TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]])
CONFIGS = {
    "plain": GenerationConfig(max_new_tokens=128, gamma=0),
    "chain g3": GenerationConfig(max_new_tokens=128, gamma=3),
    "chain g4": GenerationConfig(max_new_tokens=128, gamma=4),
    "static 6": GenerationConfig(max_new_tokens=128, tree=TreeSpec("static", topology=STATIC)),
    "dynamic d4 w2 n6": GenerationConfig(max_new_tokens=128, tree=TreeSpec("dynamic", budget=TreeBudget(4, 2, 6))),
    "dynamic d5 w2 n8": GenerationConfig(max_new_tokens=128, tree=TreeSpec("dynamic", budget=TreeBudget(5, 2, 8))),
    "dynamic d6 w3 n16": GenerationConfig(max_new_tokens=128, tree=TreeSpec("dynamic", budget=TreeBudget(6, 3, 16))),
}


def main(num_prompts: int) -> None:
    torch.set_num_threads(2)
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    engine = SpeculativeEngine(target, build_drafter_set(str(defaults.DEFAULT_DRAFT), target))
    prompts = [engine.encode(p) for p in heldout_prompts(num_prompts)]
    engine.generate(prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=8, gamma=3))  # warm-up
    for name, config in CONFIGS.items():
        tokens, seconds, cycles, accepted = 0, 0.0, 0, 0
        for ids in prompts:
            start = time.perf_counter()
            out = engine.generate(ids, SamplingParams(), config)
            seconds += time.perf_counter() - start
            tokens += len(out.output_ids)
            cycles += out.stats.cycles
            accepted += out.stats.accepted_tokens
        print(f"{name:20s} {tokens / seconds:7.1f} tok/s  mean acc. len {(accepted + cycles) / cycles:.2f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
