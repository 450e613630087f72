"""Dense, mixture-of-experts and hybrid targets under speculation: T_verify(k), the adaptive policy's γ, rollback.

Random-initialised float32 models at the shipped target's scale (hidden 512, 8 layers, 8 query and 2 KV heads of 64,
vocabulary 8,192), built in process:

* ``dense``: a Llama, MLP width 1,408 (the shipped target's shape);
* ``moe``: a Mixtral with 8 experts of width 704, each token routed to 2: the same active MLP parameters per token as
  ``dense``, 4x its MLP weights;
* ``hybrid-mamba``: a Granite-4 (GraniteMoeHybrid) with 3 Mamba-2 layers to each attention layer (M M M A M M M A),
  dense MLP 1,408;
* ``hybrid-deltanet``: a Qwen3-Next with 3 Gated DeltaNet layers to each attention layer (its MLP is a mixture:
  8 experts of 352, top 2, beside a shared one of 704: the same active width).

For each: T_verify(k), k = 1 .. 16, one forward after 256 cached tokens (median of ``--repeats``); then the same
prompts decoded greedily without a drafter and with n-gram lookup under the adaptive policy: tokens/s, the γ the policy
chose (mean and histogram), accepted tokens per cycle. For the hybrids, what exact rollback costs: the state
checkpoint's size, and the time of a rollback after a k = 5 verify block that kept m of its tokens (restore the
states, crop the attention KV, read the m kept tokens again), beside T_verify.

Plain ``torch.set_num_threads(--threads)`` (1 by default); writes ``--out`` (JSON) and prints a table. With
``--batched``, the same prompts are also decoded all at once through the batched engine, plain and adaptive n-gram.

    python bench/families.py --out bench/results/families.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from specserve.benchmarks.timing import median_forward_seconds
from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.kv.recurrent import RecurrentKVCache, StateCheckpoint
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter
from specserve.policies.schedules import schedules

SHAPE: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
HYBRID_PATTERN = ["linear", "linear", "linear", "full"] * 2

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("LlamaConfig", {"intermediate_size": 1408}),
    "moe": ("MixtralConfig", {"intermediate_size": 704, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "hybrid-mamba": (
        "GraniteMoeHybridConfig",
        {
            "layer_types": ["attention" if kind == "full" else "mamba" for kind in HYBRID_PATTERN],
            "shared_intermediate_size": 1408,
            "num_local_experts": 0,
            "mamba_n_heads": 16,
            "mamba_d_head": 64,
            "mamba_n_groups": 1,
            "mamba_d_state": 64,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
    ),
    "hybrid-deltanet": (
        "Qwen3NextConfig",
        {
            "layer_types": ["full_attention" if kind == "full" else "linear_attention" for kind in HYBRID_PATTERN],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 352,
            "shared_expert_intermediate_size": 704,
            "linear_num_key_heads": 8,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
        },
    ),
}


def build(name: str) -> CausalLM:
    config_class, options = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **options})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    return CausalLM(model)


def parameters(lm: CausalLM) -> int:
    return sum(p.numel() for p in lm.model.parameters())


def verify_curve(lm: CausalLM, max_k: int, repeats: int) -> dict[int, float]:
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 8192, (256,), generator=generator).tolist()
    curve = {}
    for k in range(1, max_k + 1):
        block = torch.randint(3, 8192, (k,), generator=generator).tolist()
        curve[k] = 1000 * median_forward_seconds(lm, prefix, block, repeats)
    return curve


def decode(lm: CausalLM, prompts: list[list[int]], new_tokens: int, speculate: bool) -> dict[str, Any]:
    """Greedy decoding of every prompt: plain, or n-gram lookup under the adaptive policy (one engine, so the policy's
    replica prior carries from prompt to prompt, as on a replica)."""
    drafter = NgramDrafter(max_ngram=3, min_ngram=1) if speculate else NoDrafter()
    engine = SpeculativeEngine(lm, drafter, schedules=schedules())
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, policy="adaptive" if speculate else "fixed")
    engine.generate(prompts[0][:8], SamplingParams(), GenerationConfig(max_new_tokens=4))  # warm up
    tokens, seconds, budgets, cycles, accepted = 0, 0.0, Counter[int](), 0, 0
    outputs = []
    for prompt in prompts:
        start = time.perf_counter()
        result = engine.generate(prompt, SamplingParams(), config)
        seconds += time.perf_counter() - start
        tokens += len(result.output_ids)
        outputs.append(result.output_ids)
        budgets.update(result.stats.budgets)
        cycles += result.stats.cycles
        accepted += result.stats.accepted_tokens
    chosen = list(budgets.elements())
    return {
        "tokens_per_s": tokens / seconds,
        "outputs": outputs,
        "mean_gamma": statistics.fmean(chosen) if chosen else 0.0,
        "gamma_histogram": dict(sorted(budgets.items())),
        "accepted_per_cycle": accepted / cycles if cycles else 0.0,
    }


def decode_batched(lm: CausalLM, prompts: list[list[int]], new_tokens: int, speculate: bool) -> dict[str, Any]:
    """Greedy decoding of every prompt at once through the batched engine (every prompt a slot): plain, or n-gram
    lookup under the adaptive policy. A hybrid's batched steps read each row's tokens past its recurrent checkpoint
    again (core/kv/pool_states.py)."""

    def new_drafter(name: str) -> NgramDrafter | NoDrafter:
        return NgramDrafter(max_ngram=3, min_ngram=1) if speculate else NoDrafter()

    engine = BatchedEngine(lm, new_drafter, schedules=schedules(), max_num_seqs=len(prompts), max_seq_len=512)
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, policy="adaptive" if speculate else "fixed")
    finish_batch(engine, [prompts[0][:8]], GenerationConfig(max_new_tokens=4))  # warm up
    start = time.perf_counter()
    outputs = finish_batch(engine, prompts, config)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(map(len, outputs)) / seconds, "outputs": outputs}


def finish_batch(engine: BatchedEngine, prompts: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    ids = [engine.submit(prompt, SamplingParams(), config) for prompt in prompts]
    results: dict[int, list[int]] = {}
    while engine.has_work:
        for request_id, chunk in engine.step():
            if isinstance(chunk, Exception):
                raise chunk
            if chunk.result is not None:
                results[request_id] = chunk.result.output_ids
    return [results[request_id] for request_id in ids]


def rollback_costs(lm: CausalLM, k: int, repeats: int) -> dict[str, Any]:
    """A hybrid's exact rollback after a verify block of ``k`` tokens that kept ``m`` of them, m = 0 .. k."""
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 8192, (256,), generator=generator).tolist()
    block = torch.tensor(torch.randint(3, 8192, (k,), generator=generator).tolist())
    cache = lm.new_cache()
    assert isinstance(cache, RecurrentKVCache)
    lm.forward(cache, torch.tensor(prefix), last_only=True)
    cache.rollback(len(prefix))
    ms: dict[int, float] = {}
    for kept in range(k + 1):
        times = []
        for _ in range(repeats):
            lm.forward(cache, block)
            start = time.perf_counter()
            cache.rollback(len(prefix) + kept)
            times.append(time.perf_counter() - start)
            cache.rollback(len(prefix))
        ms[kept] = 1000 * sorted(times)[len(times) // 2]
    checkpoint = StateCheckpoint.take(cache.inner, cache.length)
    take = []
    for _ in range(repeats):
        start = time.perf_counter()
        StateCheckpoint.take(cache.inner, cache.length)
        take.append(time.perf_counter() - start)
    return {
        "k": k,
        "rollback_ms_by_kept": ms,
        "checkpoint_bytes": checkpoint.nbytes,
        "checkpoint_ms": 1000 * sorted(take)[len(take) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batched", action="store_true", help="also decode the prompts at once, batched")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 8192, (48,), generator=generator).tolist() for _ in range(args.prompts)]
    results: dict[str, Any] = {"threads": args.threads, "families": {}}
    for name in args.families:
        lm = build(name)
        curve = verify_curve(lm, args.max_k, args.repeats)
        plain = decode(lm, prompts, args.new_tokens, speculate=False)
        spec = decode(lm, prompts, args.new_tokens, speculate=True)
        assert spec["outputs"] == plain["outputs"], f"{name}: speculative output differs from plain decoding"
        entry: dict[str, Any] = {
            "parameters": parameters(lm),
            "t_verify_ms": curve,
            "plain_tokens_per_s": plain["tokens_per_s"],
            "speculative_tokens_per_s": spec["tokens_per_s"],
            "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
            "mean_gamma": spec["mean_gamma"],
            "gamma_histogram": spec["gamma_histogram"],
            "accepted_per_cycle": spec["accepted_per_cycle"],
        }
        if args.batched:
            batch_plain = decode_batched(lm, prompts, args.new_tokens, speculate=False)
            batch_spec = decode_batched(lm, prompts, args.new_tokens, speculate=True)
            assert batch_plain["outputs"] == plain["outputs"] == batch_spec["outputs"], (
                f"{name}: batched outputs differ"
            )
            entry["batched_plain_tokens_per_s"] = batch_plain["tokens_per_s"]
            entry["batched_speculative_tokens_per_s"] = batch_spec["tokens_per_s"]
            print(
                f"{name:16s} batched ({len(prompts)} at once): plain {batch_plain['tokens_per_s']:6.1f} tok/s, "
                f"adaptive n-gram {batch_spec['tokens_per_s']:6.1f} tok/s",
                flush=True,
            )
        if lm.windows.recurrent:
            entry["rollback"] = rollback_costs(lm, 5, args.repeats)
        results["families"][name] = entry
        ratio = " ".join(f"{curve[k] / curve[1]:.2f}" for k in (2, 4, 8, 16) if k in curve)
        print(
            f"{name:16s} {entry['parameters'] / 1e6:6.1f}M  T(1) {curve[1]:6.2f} ms  T(k)/T(1) k=2,4,8,16: {ratio}  "
            f"plain {entry['plain_tokens_per_s']:6.1f} tok/s  adaptive n-gram {entry['speculative_tokens_per_s']:6.1f} "
            f"tok/s ({entry['speedup']:.2f}x)  mean gamma {entry['mean_gamma']:.2f}  "
            f"accepted/cycle {entry['accepted_per_cycle']:.2f}",
            flush=True,
        )
        if "rollback" in entry:
            rollback = entry["rollback"]
            kept = " ".join(f"m={m}: {ms:.2f}" for m, ms in rollback["rollback_ms_by_kept"].items())
            print(
                f"{'':16s} rollback after k=5 (ms) {kept}; checkpoint {rollback['checkpoint_bytes'] / 2**10:.0f} KiB "
                f"in {rollback['checkpoint_ms']:.3f} ms",
                flush=True,
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
