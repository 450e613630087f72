"""Batched draft-model drafting vs one drafter per request: the draft side of a batched step.

    python bench/batch_drafting.py [--requests 16] [--gamma 3] [--steps 40] [--threads 1] [--temperature 0]

``--requests`` held-out prompts (the shipped draft model, float32, CPU, ``--threads`` torch threads) are
drafted for ``--steps`` steps two ways with the same calls: ``BatchedDraftModel.propose_chains`` (one
forward per drafted position over all requests, KV in one pool) and one ``DraftModelDrafter.propose`` per
request (a one-row forward per request and position, KV per request). Between steps both are told the same
verdict (the one-by-one draft's first ``(step + i) % (gamma + 1)`` tokens and one more), so each step's
catch-up feeds one or two tokens, as in steady decoding; half way, request 0 starts again (a newcomer whose
whole prompt is caught up beside the others' steady steps). Prints per-step medians of both, the first step
(its catch-ups feed every prompt) and the newcomer's step apart, and how many chains came out equal, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.model import CausalLM
from specserve.core.sampling import SamplingParams
from specserve.drafters.batched_model import BatchedDraftModel
from specserve.drafters.model import DraftModelDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    draft = CausalLM.load(defaults.DEFAULT_DRAFT)
    assert draft.tokenizer is not None
    prompts = [draft.tokenizer.encode(text)[:256] for text in heldout_prompts(args.requests)]
    params = SamplingParams(temperature=args.temperature, seed=1)
    steps = args.steps + 2  # the first step (whole-prompt catch-ups) and the newcomer's are reported apart
    join = steps // 2
    capacity = max(len(p) for p in prompts) + steps * (args.gamma + 1) + args.gamma

    batcher = BatchedDraftModel(draft, None, max_num_seqs=args.requests, max_seq_len=capacity)
    pooled = [batcher.new_drafter() for _ in prompts]
    alone = [DraftModelDrafter(draft) for _ in prompts]
    for i, prompt in enumerate(prompts):
        pooled[i].start(prompt, params, torch.Generator().manual_seed(i))
        alone[i].start(prompt, params, torch.Generator().manual_seed(i))
    budgets = [args.gamma] * len(prompts)
    batched_seconds, alone_seconds, equal = [], [], 0
    for step in range(steps):
        if step == join:
            for drafter in (pooled[0], alone[0]):
                drafter.start(prompts[0], params, torch.Generator().manual_seed(0))
        start = time.perf_counter()
        got = batcher.propose_chains(pooled, budgets)
        batched_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        want = [drafter.propose(budget) for drafter, budget in zip(alone, budgets, strict=True)]
        alone_seconds.append(time.perf_counter() - start)
        equal += sum(g.tokens.tolist() == w.tokens.tolist() for g, w in zip(got, want, strict=True))
        for i, draft_chain in enumerate(want):
            accepted = (step + i) % (args.gamma + 1)
            committed = [*draft_chain.tokens[:accepted].tolist(), int(draft_chain.tokens[0])]
            pooled[i].accept(committed)
            alone[i].accept(committed)
    for drafter in pooled:
        drafter.release()

    steady = [step for step in range(1, steps) if step != join]
    batched_ms = 1e3 * statistics.median(batched_seconds[step] for step in steady)
    alone_ms = 1e3 * statistics.median(alone_seconds[step] for step in steady)
    print(f"{args.requests} requests, gamma {args.gamma}, {args.threads} thread(s), T={args.temperature}, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")  # fmt: skip
    print(f"  first step (whole prompts): batched {1e3 * batched_seconds[0]:.1f} ms, one by one "
          f"{1e3 * alone_seconds[0]:.1f} ms")  # fmt: skip
    print(f"  a newcomer's step: batched {1e3 * batched_seconds[join]:.1f} ms, one by one "
          f"{1e3 * alone_seconds[join]:.1f} ms")  # fmt: skip
    print(f"  per step (median of {args.steps}): batched {batched_ms:.2f} ms, one by one {alone_ms:.2f} ms, "
          f"{alone_ms / batched_ms:.2f}x; equal chains {equal}/{steps * len(prompts)}")  # fmt: skip
    result = {
        "requests": args.requests,
        "gamma": args.gamma,
        "threads": args.threads,
        "temperature": args.temperature,
        "steps": args.steps,
        "batched_ms_per_step": round(batched_ms, 3),
        "one_by_one_ms_per_step": round(alone_ms, 3),
        "speedup": round(alone_ms / batched_ms, 2),
        "first_step_batched_ms": round(1e3 * batched_seconds[0], 2),
        "first_step_one_by_one_ms": round(1e3 * alone_seconds[0], 2),
        "newcomer_step_batched_ms": round(1e3 * batched_seconds[join], 2),
        "newcomer_step_one_by_one_ms": round(1e3 * alone_seconds[join], 2),
        "equal_chains": equal,
        "chains": steps * len(prompts),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
