"""`specserve bench`: speculative decoding against plain decoding and transformers, in one process.

One question: how much faster is exact speculative decoding than plain decoding on these models,
and how close does it come to what its measured acceptance and costs predict? Methods, each
over the same prompts and the same ``max_new_tokens``, greedy and sampled:

* ``specserve/plain`` — our engine with the ``none`` drafter (the baseline for speedups);
* ``specserve/draft`` at every gamma, ``specserve/ngram`` at a few gammas;
* ``hf/generate`` — transformers' plain ``generate``;
* ``hf/assisted`` — transformers' assisted generation with the same draft model (its default
  heuristic schedule and constant gammas);
* ``hf/prompt_lookup`` — transformers' prompt lookup decoding.

For our speculative runs two predictions sit beside the measured speedup:

* ``predicted_formula`` — (1 - a^(g+1)) / ((1 - a)(c g + 1)) with a the pooled acceptance rate and
  c = draft time per token / plain decode time per token (assumes a flat verify cost);
* ``predicted_measured`` — E[tokens per cycle] from the measured per-position acceptance (weighted
  by how often each draft length occurred: n-gram lookup often drafts fewer than gamma), divided
  by the measured draft + verify time per cycle, over plain decode tokens/s.
  ``measured_over_predicted`` = decode speedup / ``predicted_measured`` then shows what the loop
  itself costs beyond drafting and verifying.

``speedup`` is end to end (prefill included, comparable with transformers' ``generate``);
``decode_speedup`` is the decode loop alone (prefill excluded), which is what the predictions model.

Results: ``speculative.json``, ``speculative.md`` (the table for BENCHMARKS.md) and
``speculative.png`` (speedup against gamma, one line per method) under ``--out`` (default
``runs/bench/``; ``make bench`` writes ``bench/results/``). stdout carries the table and a
``results:`` line, or with ``--json`` the report alone (:mod:`specserve.benchmarks.arguments`).
``--quick`` is a smoke run of about a minute (:data:`QUICK`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.benchmarks.arguments import (
    RUNS_DIR,
    Quick,
    add_model_and_prompt_arguments,
    add_output_arguments,
    check_max_new_tokens,
    model_and_prompt_options,
    number_list,
    print_results,
    stdout_to_stderr,
)
from specserve.benchmarks.baselines import hf_generate
from specserve.benchmarks.prompts import heldout_prompts, load_prompts
from specserve.benchmarks.tables import table_cell
from specserve.benchmarks.tally import report_paths, save_report
from specserve.benchmarks.timing import median_forward_seconds
from specserve.core.draft.drafter import Drafter
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.draft.spec_strings import is_model_free
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats
from specserve.drafters import DraftModelDrafter, NgramDrafter, NoDrafter

NGRAM_GAMMAS = (2, 4, 8)
HF_ASSISTED_GAMMAS = (2, 4, 6)  # greedy only, beside transformers' heuristic schedule
HF_LOOKUP_TOKENS = (4, 10)
QUICK = Quick(
    {"num_prompts": 4, "max_new_tokens": 32, "temperatures": "0", "gammas": "2,4"},
    "4 prompts × 32 new tokens, greedy; plain, the draft model at γ 2 and 4, n-gram γ 4, "
    "transformers' generate and prompt lookup (4 tokens)",
)


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str
    dtype: str = "float32"
    device: str = "cpu"
    prompts_file: str | None = None
    num_prompts: int = 20
    max_new_tokens: int = 128
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    out_dir: Path = RUNS_DIR / "bench"
    ngram_gammas: tuple[int, ...] = NGRAM_GAMMAS
    hf_assisted: bool = True  # transformers' assisted generation: its heuristic schedule, and HF_ASSISTED_GAMMAS
    hf_lookup_tokens: tuple[int, ...] = HF_LOOKUP_TOKENS
    max_ngram: int = 3
    min_ngram: int = 1
    seed: int = 0


@dataclass
class MethodResult:
    method: str
    temperature: float
    gamma: int | None
    new_tokens: int = 0
    seconds: float = 0.0
    stats: RequestStats | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """End to end: prefill included."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """The decode loop alone (our engine only): prefill excluded."""
        if self.stats is None:
            return None
        decode = self.stats.total_seconds - self.stats.prefill_seconds
        return self.stats.new_tokens / decode if decode > 0 else None


# ---------------------------------------------------------------------------------------------
# Runners


def run_engine(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[list[int]],
    temperature: float,
    gamma: int,
    cfg: BenchConfig,
    method: str,
) -> MethodResult:
    engine = SpeculativeEngine(target, drafter)
    generation = GenerationConfig(max_new_tokens=cfg.max_new_tokens, gamma=gamma)
    warmup = GenerationConfig(max_new_tokens=8, gamma=gamma)
    engine.generate(prompt_ids[0], SamplingParams(temperature=temperature, seed=cfg.seed), warmup)
    result = MethodResult(method, temperature, gamma if drafter.name != "none" else None, stats=RequestStats())
    assert result.stats is not None
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(temperature=temperature, seed=cfg.seed + i)
        start = time.perf_counter()
        out = engine.generate(ids, params, generation)
        result.seconds += time.perf_counter() - start
        result.new_tokens += len(out.output_ids)
        result.stats.merge(out.stats)
    return result


def run_hf(
    target: CausalLM,
    prompt_ids: list[list[int]],
    temperature: float,
    cfg: BenchConfig,
    method: str,
    gamma: int | None,
    **generate_kwargs: Any,
) -> MethodResult:
    def call(ids: list[int], max_new: int, seed: int) -> int:
        return len(hf_generate(target, ids, max_new, temperature, seed, **generate_kwargs))

    call(prompt_ids[0], 8, cfg.seed)
    result = MethodResult(method, temperature, gamma)
    for i, ids in enumerate(prompt_ids):
        start = time.perf_counter()
        result.new_tokens += call(ids, cfg.max_new_tokens, cfg.seed + i)
        result.seconds += time.perf_counter() - start
    return result


def run_hf_assisted(
    target: CausalLM,
    draft: CausalLM,
    prompt_ids: list[list[int]],
    temperature: float,
    cfg: BenchConfig,
    gamma: int | None,
) -> MethodResult:
    configure_assistant(draft, gamma)
    name = "hf/assisted" if gamma is not None else "hf/assisted(heuristic)"
    return run_hf(target, prompt_ids, temperature, cfg, name, gamma, assistant_model=draft.model)


def configure_assistant(draft: CausalLM, gamma: int | None) -> None:
    """transformers reads the assisted schedule from the assistant's generation config."""
    gen = draft.model.generation_config
    if gamma is None:  # transformers' defaults: heuristic schedule starting at 20, confidence stop 0.4
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = 20, "heuristic"
        gen.assistant_confidence_threshold = 0.4
    else:
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = gamma, "constant"
        gen.assistant_confidence_threshold = 0.0


# ---------------------------------------------------------------------------------------------
# Predictions


def decode_step_seconds(target: CausalLM, prompt_ids: list[int], repeats: int = 21) -> float:
    """Median time of one single-token decode step of ``target`` after ``prompt_ids[:-1]``."""
    return median_forward_seconds(target, prompt_ids[:-1], prompt_ids[-1:], repeats)


def expected_tokens_per_cycle(alpha_by_position: list[float], draft_lengths: Counter[int]) -> float:
    """E[committed tokens per cycle] = sum over drafted length g of P(g) * (1 + a_0 + a_0 a_1 + ... + a_0..a_{g-1}).

    Drafters that sometimes propose fewer than gamma tokens (n-gram lookup without a match, the
    end of a generation) are weighted by how often each length occurred.
    """
    cycles = sum(draft_lengths.values())
    if not cycles:
        return 1.0
    prefix = [1.0]  # prefix[g] = tokens expected from a cycle that drafted g tokens
    survive = 1.0
    for alpha_i in alpha_by_position:
        survive *= alpha_i
        prefix.append(prefix[-1] + survive)
    return sum(count * prefix[min(g, len(prefix) - 1)] for g, count in draft_lengths.items()) / cycles


def predictions(result: MethodResult, plain_decode_tps: float, plain_step_seconds: float) -> dict[str, float | None]:
    """Speedups the performance model predicts for the decode loop, beside the measured one."""
    stats, gamma, decode_tps = result.stats, result.gamma, result.decode_tokens_per_second
    if stats is None or not gamma or not stats.cycles or not plain_decode_tps or not decode_tps:
        return {}
    by_position = [a / r if r else 0.0 for a, r in zip(stats.accepted, stats.reached, strict=True)][:gamma]
    expected = expected_tokens_per_cycle(by_position, stats.draft_length_histogram)
    cycle_seconds = (stats.draft_seconds + stats.verify_seconds) / stats.cycles
    predicted_measured = expected / cycle_seconds / plain_decode_tps
    pooled = sum(stats.accepted) / max(1, sum(stats.reached))
    c = (stats.draft_seconds / max(1, stats.drafted_tokens)) / plain_step_seconds
    if pooled >= 1.0:
        formula = (gamma + 1) / (c * gamma + 1)
    else:
        formula = (1 - pooled ** (gamma + 1)) / ((1 - pooled) * (c * gamma + 1))
    measured = decode_tps / plain_decode_tps
    return {
        "decode_speedup": measured,
        "alpha_pooled": pooled,
        "c": c,
        "expected_tokens_per_cycle": expected,
        "cycle_seconds": cycle_seconds,
        "predicted_formula": formula,
        "predicted_measured": predicted_measured,
        "measured_over_predicted": measured / predicted_measured if predicted_measured else None,
    }


# ---------------------------------------------------------------------------------------------
# Driver


@dataclass(frozen=True)
class Method:
    """One configuration of the plan: a method at a temperature and gamma (HF prompt lookup: its tokens)."""

    name: str
    temperature: float
    gamma: int | None = None


def methods(cfg: BenchConfig, has_draft: bool) -> list[Method]:
    """Every configuration the benchmark runs, in order; ``has_draft``: a draft model is loaded."""
    plan: list[Method] = []
    for temp in cfg.temperatures:
        plan.append(Method("specserve/plain", temp))
        plan += [Method("specserve/draft", temp, g) for g in cfg.gammas] if has_draft else []
        plan += [Method("specserve/ngram", temp, g) for g in cfg.ngram_gammas]
        plan.append(Method("hf/generate", temp))
        if has_draft and cfg.hf_assisted:
            plan += [Method("hf/assisted", temp, g) for g in (None, *(HF_ASSISTED_GAMMAS if temp == 0 else ()))]
        plan += [Method("hf/prompt_lookup", temp, n) for n in cfg.hf_lookup_tokens]
    return plan


def run_method(
    method: Method, target: CausalLM, draft: CausalLM | None, prompt_ids: list[list[int]], cfg: BenchConfig
) -> MethodResult:
    """``method`` over every prompt, with a fresh drafter (our methods) or transformers' ``generate`` (``hf/``)."""
    temp, gamma = method.temperature, method.gamma or 0
    if method.name == "specserve/plain":
        return run_engine(target, NoDrafter(target.device), prompt_ids, temp, 0, cfg, method.name)
    if method.name == "specserve/draft":
        assert draft is not None
        return run_engine(target, DraftModelDrafter(draft, target), prompt_ids, temp, gamma, cfg, method.name)
    if method.name == "specserve/ngram":
        ngram = NgramDrafter(cfg.max_ngram, cfg.min_ngram, target.device)
        return run_engine(target, ngram, prompt_ids, temp, gamma, cfg, method.name)
    if method.name == "hf/generate":
        return run_hf(target, prompt_ids, temp, cfg, method.name, None)
    if method.name == "hf/assisted":
        assert draft is not None
        return run_hf_assisted(target, draft, prompt_ids, temp, cfg, method.gamma)
    if method.name == "hf/prompt_lookup":
        return run_hf(target, prompt_ids, temp, cfg, method.name, gamma, prompt_lookup_num_tokens=gamma)
    raise ValueError(f"unknown method {method.name!r}")


def run(cfg: BenchConfig) -> dict[str, Any]:
    texts = load_prompts(cfg.prompts_file) if cfg.prompts_file else heldout_prompts(cfg.num_prompts)
    target = CausalLM.load(cfg.target, dtype=cfg.dtype, device=cfg.device)
    draft = None if is_model_free(cfg.draft) else CausalLM.load(cfg.draft, dtype=cfg.dtype, device=cfg.device)
    if draft is not None:
        DraftModelDrafter(draft, target)  # vocabulary check up front
    assert target.tokenizer is not None
    prompt_ids = [list(target.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts[: cfg.num_prompts]]
    limit = target.info.max_positions - cfg.max_new_tokens
    prompt_ids = [ids[-limit:] for ids in prompt_ids if ids]

    results: list[MethodResult] = []
    for method in tqdm(methods(cfg, draft is not None), desc="bench", unit="config", file=sys.stderr):
        tqdm.write(f"  {method.name} T={method.temperature:g} gamma={method.gamma}", file=sys.stderr)
        results.append(run_method(method, target, draft, prompt_ids, cfg))

    plain_step = decode_step_seconds(target, prompt_ids[0])
    rows = summarise(results, plain_step)
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads()},
        "num_prompts": len(prompt_ids),
        "mean_prompt_tokens": sum(map(len, prompt_ids)) / len(prompt_ids),
        "plain_decode_step_seconds": plain_step,
        "rows": rows,
        "summary": headline(rows, cfg),
    }
    save_report(cfg.out_dir, "speculative", report, markdown(report), lambda path: plot(rows, path))
    return report


def summarise(results: list[MethodResult], plain_step: float) -> list[dict[str, Any]]:
    plain = {r.temperature: r for r in results if r.method == "specserve/plain"}
    rows = []
    for r in results:
        base_result = plain.get(r.temperature)
        base = base_result.tokens_per_second if base_result else 0.0
        base_decode = (base_result.decode_tokens_per_second or 0.0) if base_result else 0.0
        row: dict[str, Any] = {
            "method": r.method,
            "temperature": r.temperature,
            "gamma": r.gamma,
            "new_tokens": r.new_tokens,
            "seconds": r.seconds,
            "tokens_per_second": r.tokens_per_second,
            "speedup": r.tokens_per_second / base if base else None,
        }
        if r.stats is not None:
            row["mean_accepted"] = r.stats.mean_accepted
            row["acceptance_by_position"] = r.stats.acceptance_by_position
            row["accepted_length_histogram"] = dict(sorted(r.stats.accepted_length_histogram.items()))
            row["draft_length_histogram"] = dict(sorted(r.stats.draft_length_histogram.items()))
            row["draft_seconds"] = r.stats.draft_seconds
            row["verify_seconds"] = r.stats.verify_seconds
            row["prefill_seconds"] = r.stats.prefill_seconds
            row["decode_tokens_per_second"] = r.decode_tokens_per_second
            row.update(predictions(r, base_decode, plain_step))
        rows.append(row)
    return rows


def headline(rows: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for temp in cfg.temperatures:
        at = [r for r in rows if r["temperature"] == temp]
        ours = [r for r in at if r["method"] in ("specserve/draft", "specserve/ngram")]
        hf_spec = [r for r in at if r["method"].startswith(("hf/assisted", "hf/prompt_lookup"))]
        plain = next((r for r in at if r["method"] == "specserve/plain"), None)
        hf_plain = next((r for r in at if r["method"] == "hf/generate"), None)
        best = max(ours, key=lambda r: r["tokens_per_second"], default=None)
        best_hf = max(hf_spec, key=lambda r: r["tokens_per_second"], default=None)
        key = f"T={temp:g}"
        out[key] = {
            "best": None if best is None else f"{best['method']} gamma={best['gamma']}",
            "best_speedup_over_plain": None if best is None else best["speedup"],
            "best_over_best_hf_speculative": (
                best["tokens_per_second"] / best_hf["tokens_per_second"] if best and best_hf else None
            ),
            "best_hf_speculative": None if best_hf is None else f"{best_hf['method']} gamma={best_hf['gamma']}",
            "plain_over_hf_generate": (
                plain["tokens_per_second"] / hf_plain["tokens_per_second"] if plain and hf_plain else None
            ),
            "best_measured_over_predicted": None if best is None else best.get("measured_over_predicted"),
        }
        drafts = [r for r in at if r["method"] == "specserve/draft"]
        if drafts:
            out[key]["best_draft_gamma"] = max(drafts, key=lambda r: r["tokens_per_second"])["gamma"]
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| T | method | γ | tok/s | speedup | decode speedup | mean acc. len | α by position | pred. (formula) "
        "| pred. (measured) | decode/pred. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        alphas = r.get("acceptance_by_position")
        alpha_text = " ".join("–" if a is None else f"{a:.2f}" for a in alphas) if alphas else "–"
        lines.append(
            f"| {r['temperature']:g} | {r['method']} | {table_cell(r['gamma'])} | {r['tokens_per_second']:.1f} | "
            f"{table_cell(r['speedup'])} | {table_cell(r.get('decode_speedup'))} | "
            f"{table_cell(r.get('mean_accepted'))} | {alpha_text} | "
            f"{table_cell(r.get('predicted_formula'))} | {table_cell(r.get('predicted_measured'))} | "
            f"{table_cell(r.get('measured_over_predicted'))} |"
        )
    lines.append("")
    lines.append("Summary: `" + json.dumps(report["summary"]) + "`")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        at = [r for r in rows if r["temperature"] == temp and r["speedup"] is not None]
        for method in ("specserve/draft", "specserve/ngram", "hf/assisted", "hf/prompt_lookup"):
            pts = sorted((r["gamma"], r["speedup"]) for r in at if r["method"] == method and r["gamma"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            if method.startswith("specserve") and pts:
                pred = sorted(
                    (r["gamma"], r["predicted_measured"])
                    for r in at
                    if r["method"] == method and r.get("predicted_measured")
                )
                ax.plot([p[0] for p in pred], [p[1] for p in pred], ls=":", alpha=0.6, label=f"{method} (predicted)")
        for r in at:
            if r["gamma"] is None and r["method"] != "specserve/plain":
                ax.axhline(r["speedup"], ls="--", lw=1, color="gray")
                ax.annotate(r["method"], (0.5, r["speedup"]), fontsize=7, color="gray")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"temperature {temp:g}")
        ax.set_xlabel("γ (draft tokens per cycle; HF prompt lookup: tokens)")
        ax.set_ylabel("speedup over specserve plain decoding")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `specserve bench`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_and_prompt_arguments(parser, num_prompts=20)
    parser.add_argument("--gammas", default="1,2,3,4,5,6,7,8", help="comma-separated gammas for the draft model")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    add_output_arguments(parser, "bench", "speculative.json/.md/.png")
    QUICK.add_argument(parser)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The configuration the flags describe (``--quick`` applied); raises :class:`UserError` for a bad value."""
    QUICK.apply(args)
    check_max_new_tokens(args)
    gammas = number_list(args.gammas, int, "--gammas")
    temperatures = number_list(args.temperatures, float, "--temperatures")
    if not gammas or any(not 1 <= g <= MAX_GAMMA for g in gammas):
        raise UserError(f"--gammas must be between 1 and {MAX_GAMMA}, got {args.gammas}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise UserError(f"--temperatures must be numbers >= 0, got {args.temperatures!r}")
    if args.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    return BenchConfig(
        **model_and_prompt_options(args),
        gammas=tuple(gammas),
        temperatures=tuple(temperatures),
        out_dir=Path(args.out),
        max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        ngram_gammas=NGRAM_GAMMAS[1:2] if args.quick else NGRAM_GAMMAS,  # not flags: --quick always shrinks them
        hf_assisted=not args.quick,
        hf_lookup_tokens=HF_LOOKUP_TOKENS[:1] if args.quick else HF_LOOKUP_TOKENS,
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), report_paths(cfg.out_dir, "speculative"))
    return 0
