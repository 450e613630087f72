"""What a batched step spends outside its forward — staging every verdict, the copy to the host, committing — and
whether seeded sampled outputs are the same as another checkout's.

    python bench/batch_verdicts.py time [--threads 1]
    python bench/batch_verdicts.py outputs OUT.json      # run in two checkouts, then compare the two files

``time``: the shipped pair, float32, 1 and 16 requests (held-out prompts, 64 new tokens, EOS ignored), plain (γ 0)
and the draft model at γ 3, greedy; every step's ``verify_batch`` time minus its target forward's
(``LocalPool.forward_batch``), median over the steps after the first two. ``outputs``: 4 prompts × 4 seeded sampled
configurations (a γ 3 chain, a dynamic tree with top-p, n-gram with a repetition penalty, a chain with logprobs)
through the batched engine and the single-request engine; writes every output's tokens and rounded logprobs as JSON.
To measure another checkout, put it first on the path: ``PYTHONPATH=/path/to/checkout python bench/batch_verdicts.py
...``. Decides nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import specserve.core.batch_engine as batch_engine_module
import specserve.core.batch_step as batch_step_module
from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.policies.schedules import schedules


def load() -> tuple[CausalLM, CausalLM, list[list[int]]]:
    target = CausalLM.load(str(defaults.DEFAULT_TARGET), dtype="float32", device="cpu")
    draft = CausalLM.load(str(defaults.DEFAULT_DRAFT), dtype="float32", device="cpu")
    assert target.tokenizer is not None
    prompts = [list(target.tokenizer(t, add_special_tokens=False)["input_ids"])[-200:] for t in heldout_prompts(8)]
    return target, draft, prompts


def time_verdicts() -> None:
    target, draft, prompts = load()
    outside: list[float] = []  # per verify step: its time outside its target forward
    inside: list[float] = []  # and its forward's
    forward: list[float] = []
    step, pool_forward = batch_engine_module.verify_batch, batch_step_module.LocalPool.forward_batch

    def timed_step(*args: Any) -> Any:
        forward.clear()
        start = time.perf_counter()
        try:
            return step(*args)
        finally:
            outside.append(time.perf_counter() - start - sum(forward))  # the step's own forward only
            inside.append(sum(forward))

    def timed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return pool_forward(self, *args, **kwargs)
        finally:
            forward.append(time.perf_counter() - start)

    batch_engine_module.verify_batch = timed_step  # type: ignore[assignment]
    batch_step_module.LocalPool.forward_batch = timed_forward  # type: ignore[method-assign]
    print("| requests | γ | steps | ms per step outside the forward (median) | forward ms (median) |")
    print("|---|---|---|---|---|")
    for concurrency, gamma in ((1, 0), (1, 3), (16, 0), (16, 3)):
        drafters = request_drafters(draft, target, max_num_seqs=concurrency, max_seq_len=400)
        engine = BatchedEngine(target, drafters, schedules=schedules(), max_num_seqs=concurrency, max_seq_len=400,
                               prefill_tokens=4000)  # fmt: skip
        for i in range(concurrency):
            engine.submit(prompts[i % len(prompts)], None, GenerationConfig(max_new_tokens=64, gamma=gamma,
                                                                            ignore_eos=True))  # fmt: skip
        outside.clear()
        inside.clear()
        while engine.has_work:
            engine.step()
        print(f"| {concurrency} | {gamma} | {len(outside) - 2} | {1000 * statistics.median(outside[2:]):.3f} | "
              f"{1000 * statistics.median(inside[2:]):.2f} |")  # fmt: skip


def seeded_outputs(out: str) -> None:
    target, draft, prompts = load()
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=8))
    cases = [
        (SamplingParams(temperature=1.0, seed=1), GenerationConfig(max_new_tokens=32, gamma=3, ignore_eos=True)),
        (SamplingParams(temperature=0.8, top_p=0.9, seed=2), GenerationConfig(max_new_tokens=32, tree=tree,
                                                                              ignore_eos=True)),
        (SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.2),
         GenerationConfig(max_new_tokens=32, gamma=4, drafter="ngram", ignore_eos=True)),
        (SamplingParams(temperature=1.0, seed=4, logprobs=2), GenerationConfig(max_new_tokens=32, gamma=2,
                                                                               ignore_eos=True)),
    ]  # fmt: skip
    drafters = request_drafters(draft, target, max_num_seqs=16, max_seq_len=300)
    engine = BatchedEngine(target, drafters, schedules=schedules(), max_num_seqs=16, max_seq_len=300)
    names = {}
    for p, prompt in enumerate(prompts[:4]):
        for c, (params, config) in enumerate(cases):
            names[engine.submit(prompt, params, config)] = f"{p}-{c}"
    results: dict[str, Any] = {}
    while engine.has_work:
        for request, chunk in engine.step():
            if not isinstance(chunk, Exception) and chunk.result is not None:
                r = chunk.result
                results[f"batched {names[request]}"] = [r.output_ids, [round(lp.logprob, 6) for lp in r.logprobs or []]]
    alone = SpeculativeEngine(target, build_drafter_set(draft, target), schedules=schedules())
    for p, prompt in enumerate(prompts[:4]):
        for c, (params, config) in enumerate(cases):
            r = alone.generate(prompt, params, config)
            results[f"alone {p}-{c}"] = [r.output_ids, [round(lp.logprob, 6) for lp in r.logprobs or []]]
    with open(out, "w") as file:
        json.dump(results, file)
    print(f"{len(results)} outputs written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("what", choices=["time", "outputs"])
    parser.add_argument("out", nargs="?", default="seeded_outputs.json")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "time":
        time_verdicts()
    else:
        seeded_outputs(args.out)


if __name__ == "__main__":
    main()
