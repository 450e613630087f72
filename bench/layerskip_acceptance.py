"""Mean accepted length of layer-skip self-speculation on the shipped target, by exit layer (acceptance only).

    python bench/layerskip_acceptance.py [--layers 2,4,6] [--prompts 4] [--max-new-tokens 64] [--gamma 3]

Greedy, in process, the first held-out prompts; prints one line per exit layer. Timing is not
reported: this measures how often the target's first L layers draft what the whole target emits.
"""

from __future__ import annotations

import argparse

import torch

from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.model import CausalLM
from specserve.core.sampling import SamplingParams
from specserve.drafters.layerskip import LayerSkipDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,6")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    prompts = heldout_prompts(args.prompts)
    for layers in (int(x) for x in args.layers.split(",")):
        engine = SpeculativeEngine(target, LayerSkipDrafter(target, layers))
        cycles = accepted = 0
        for prompt in prompts:
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma)
            stats = engine.generate(prompt, SamplingParams(), config).stats
            cycles, accepted = cycles + stats.cycles, accepted + stats.accepted_tokens
        mean = (accepted + cycles) / cycles
        print(f"layerskip:{layers} gamma {args.gamma} greedy: mean accepted {mean:.2f} over {cycles} cycles")


if __name__ == "__main__":
    main()
