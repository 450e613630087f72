"""Draft cost per proposal on the shipped target: the small draft model vs the EAGLE head (and Medusa, layer-skip).

    python bench/draft_cost.py [--gamma 4] [--repeats 30]

Times ``propose(gamma)`` (greedy chain) and a dynamic tree proposal after a held-out prompt, median of
``--repeats``, one torch thread. Explains bench-drafters' tokens/s beside its acceptance numbers.
"""

from __future__ import annotations

import argparse
import statistics
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
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    prompt = SpeculativeEngine(target, build_drafter("none", target)).encode(heldout_prompts(1)[0])
    specs = {
        "draft model": str(defaults.DEFAULT_DRAFT),
        "eagle": f"eagle:{defaults.MODELS_DIR / 'eagle'}",
        "medusa": f"medusa:{defaults.MODELS_DIR / 'medusa'}",
        "layerskip + exit head": f"layerskip:{defaults.MODELS_DIR / 'exit-head'}",
    }
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=6, width=3, nodes=16, expand=3))
    for name, spec in specs.items():
        drafter = build_drafter(spec, target)
        engine = SpeculativeEngine(target, drafter)
        # one real request first, so feature drafters hold the prompt's features and caches are warm
        engine.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=2, gamma=1))
        chain, trees = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            drafter.propose(args.gamma)
            chain.append(time.perf_counter() - start)
            start = time.perf_counter()
            drafter.propose_tree(tree)  # type: ignore[attr-defined]
            trees.append(time.perf_counter() - start)
        print(
            f"{name:>22}: chain {args.gamma} {1e3 * statistics.median(chain):6.2f} ms, "
            f"dynamic tree 16 (d6 w3 e3) {1e3 * statistics.median(trees):6.2f} ms"
        )


if __name__ == "__main__":
    main()
