"""In-process batched engine throughput: N requests at once vs one at a time, with and without speculation.

    python bench/batch_throughput.py [--threads 1] [--requests 1,4,16] [--max-new-tokens 64]

Runs N held-out prompts through :class:`~specserve.core.batch_engine.BatchedEngine` (all submitted
at once, ``num_slots = N``, greedy, EOS ignored) with no drafter and with the draft model at γ 3,
and the same N prompts one after another through :class:`~specserve.core.engine.SpeculativeEngine`.
Reports tokens/s (all requests' new tokens over the wall time, prefill included) and checks that
every batched output equals the one-at-a-time output. Prints a Markdown table and one JSON line.
A step of the batched-serving work (issue 15), not its final benchmark: no chunked prefill, no
batched drafting, no goodput-aware γ yet.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.none import NoDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", default="1,4,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=600, help="characters of each held-out prompt kept")
    parser.add_argument("--prefill-tokens", type=int, default=256, help="the batched engine's prefill budget per step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    draft = CausalLM.load(defaults.DEFAULT_DRAFT)
    counts = [int(n) for n in args.requests.split(",")]
    prompts = [p[: args.prompt_chars] for p in heldout_prompts(max(counts))]
    modes = {"plain": (0, lambda: NoDrafter()), "draft γ3": (3, lambda: DraftModelDrafter(draft, target))}
    rows = []
    for count in counts:
        for mode, (gamma, new_drafter) in modes.items():
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=gamma, ignore_eos=True)
            start = time.perf_counter()
            alone = [
                SpeculativeEngine(target, new_drafter()).generate(p, SamplingParams(), config) for p in prompts[:count]
            ]
            alone_seconds = time.perf_counter() - start
            engine = BatchedEngine(
                target,
                lambda name, make=new_drafter: make(),
                max_num_seqs=count,
                max_seq_len=512,
                prefill_tokens=args.prefill_tokens,
            )
            start = time.perf_counter()
            ids = [engine.submit(p, SamplingParams(), config) for p in prompts[:count]]
            results = {}
            while engine.has_work:
                for request_id, chunk in engine.step():
                    if chunk.result is not None:
                        results[request_id] = chunk.result
            batch_seconds = time.perf_counter() - start
            same = all(results[i].output_ids == a.output_ids for i, a in zip(ids, alone, strict=True))
            tokens = sum(len(a.output_ids) for a in alone)
            rows.append(
                {
                    "requests": count,
                    "mode": mode,
                    "one_at_a_time_tok_s": round(tokens / alone_seconds, 1),
                    "batched_tok_s": round(tokens / batch_seconds, 1),
                    "speedup": round(alone_seconds / batch_seconds, 2),
                    "outputs_equal": same,
                }
            )
    print(f"| requests | mode | one at a time tok/s | batched tok/s | × | outputs equal |  ({args.threads} thread(s), "
          f"prefill {args.prefill_tokens} tokens/step)")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} | {r['mode']} | {r['one_at_a_time_tok_s']} | {r['batched_tok_s']} | "
              f"{r['speedup']} | {r['outputs_equal']} |")  # fmt: skip
    print(
        json.dumps({"threads": args.threads, "max_new_tokens": args.max_new_tokens, "rows": rows}, ensure_ascii=False)
    )


if __name__ == "__main__":
    main()
