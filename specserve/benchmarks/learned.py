"""`specserve bench-drafters`: every kind of drafter against plain decoding, greedy and at temperature 1.

One target, the same held-out prompts and ``max_new_tokens`` for every cell, in one process:

* ``plain`` — no drafting, the baseline of every speedup;
* ``draft chain`` / ``draft tree`` — the small draft model (chain γ, and a dynamic tree);
* ``eagle chain`` / ``eagle tree`` — the trained EAGLE head (chain, and EAGLE-2 dynamic trees);
* ``medusa tree`` — the trained Medusa heads' static tree (best-first over their calibrated ranks);
* ``layerskip`` — the target's first L layers, plain and with the trained exit head;
* ``ngram`` — prompt lookup;
* ``hf assisted`` — transformers' own assisted generation with the same draft model (constant γ).

Every cell of ours is exact (greedy equals plain greedy; sampled follows the target's law), so only
speed differs. Machine speed drifts on a shared host: each cell runs once per round, rounds
alternate the order, and the totals pool all rounds. Reported per cell: tokens/s end to end,
speedup over plain at the same temperature, mean accepted length (tokens per target pass) and
acceptance by depth. Cells whose drafter directory is missing are skipped with a note.

Results: ``drafters.json``, ``drafters.md`` (the table for BENCHMARKS.md, and the headline) and
``drafters.png`` under ``--out`` (default ``runs/bench-drafters/``). stdout carries the table and a
``results:`` line, or with ``--json`` the report alone (:mod:`specserve.benchmarks.arguments`).
``--quick`` is a smoke run of about a minute (:data:`QUICK`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve import defaults
from specserve.benchmarks.arguments import (
    RUNS_DIR,
    Quick,
    add_max_new_tokens_argument,
    add_output_arguments,
    add_prompt_arguments,
    number_list,
    options,
    print_results,
    stdout_to_stderr,
)
from specserve.benchmarks.prompts import heldout_prompts, load_prompts
from specserve.benchmarks.speculative import BenchConfig, run_hf_assisted
from specserve.benchmarks.tables import table_cell
from specserve.benchmarks.tally import Tally, alternating, report_paths, save_report
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.draft import Drafter
from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model import CausalLM
from specserve.core.sampling import SamplingParams
from specserve.core.schedule import MAX_GAMMA
from specserve.core.tree import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter

TARGET_SPEEDUP = 2.0  # EAGLE's target over plain greedy decoding (issue 7)
QUICK = Quick(
    {"num_prompts": 2, "max_new_tokens": 32, "temperatures": "0", "rounds": 1},
    "every drafter once, greedy, on 2 prompts × 32 new tokens",
)


@dataclass(frozen=True)
class DrafterBenchConfig:
    target: str
    draft: str
    eagle: str
    medusa: str
    exit_head: str
    dtype: str = "float32"
    prompts_file: str | None = None
    num_prompts: int = 6
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    rounds: int = 2
    gamma: int = 4
    layerskip_layers: int = 4
    out_dir: Path = RUNS_DIR / "bench-drafters"
    seed: int = 0


@dataclass
class Cell(Tally):
    name: str
    drafter: str  # the --draft spec ("none" for plain, "hf" for transformers' assisted generation)
    temperature: float
    config: GenerationConfig


def cells(cfg: DrafterBenchConfig) -> list[Cell]:
    """Every (drafter, shape) cell at every temperature; drafters whose directory is missing are left out."""
    n, gamma = cfg.max_new_tokens, cfg.gamma

    def tree(depth: int, width: int, nodes: int, expand: int | None = None) -> GenerationConfig:
        spec = TreeSpec("dynamic", budget=TreeBudget(depth, width, nodes, expand))
        return GenerationConfig(max_new_tokens=n, tree=spec)

    chain = GenerationConfig(max_new_tokens=n, gamma=gamma)
    short = GenerationConfig(max_new_tokens=n, gamma=3)  # layer-skip drafts cost a good part of a target pass
    eagle, medusa = f"eagle:{cfg.eagle}", f"medusa:{cfg.medusa}"
    plan: list[tuple[str, str, GenerationConfig, str | None]] = [  # name, --draft spec, config, directory it needs
        ("plain", "none", GenerationConfig(max_new_tokens=n, gamma=0), None),
        (f"draft chain {gamma}", cfg.draft, chain, cfg.draft),
        ("draft tree 8 (d4 w2 e1)", cfg.draft, tree(4, 2, 8, 1), cfg.draft),
        (f"eagle chain {gamma}", eagle, chain, cfg.eagle),
        ("eagle tree 8 (d5 w2 e1)", eagle, tree(5, 2, 8, 1), cfg.eagle),
        ("eagle tree 16 (d6 w3 e3)", eagle, tree(6, 3, 16, 3), cfg.eagle),
        ("medusa tree 8", medusa, tree(4, 4, 8), cfg.medusa),
        (f"layerskip:{cfg.layerskip_layers} chain 3", f"layerskip:{cfg.layerskip_layers}", short, None),
        ("layerskip + exit head chain 3", f"layerskip:{cfg.exit_head}", short, cfg.exit_head),
        (f"ngram chain {gamma}", "ngram", chain, None),
        (f"hf assisted {gamma}", "hf", chain, cfg.draft),
    ]
    kept = [(name, spec, config) for name, spec, config, needs in plan if needs is None or _exists(needs)]
    return [Cell(name, spec, t, config) for t in cfg.temperatures for name, spec, config in kept]


def _exists(directory: str) -> bool:
    return Path(directory, "config.json").is_file()


def run(cfg: DrafterBenchConfig) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    target = CausalLM.load(cfg.target, dtype=cfg.dtype)
    texts = load_prompts(cfg.prompts_file) if cfg.prompts_file else heldout_prompts(cfg.num_prompts)
    engine = SpeculativeEngine(target, build_drafter("none", target))
    prompt_ids = [engine.encode(p) for p in texts[: cfg.num_prompts]]
    table = cells(cfg)
    drafters: dict[str, Drafter] = {}
    for cell in table:
        if cell.drafter not in drafters and cell.drafter != "hf":
            drafters[cell.drafter] = build_drafter(cell.drafter, target, dtype=cfg.dtype)
    draft_model = CausalLM.load(cfg.draft, dtype=cfg.dtype)
    engines = {spec: SpeculativeEngine(target, drafter) for spec, drafter in drafters.items()}
    for cell in table:  # warm-up: one short request per cell
        if cell.drafter != "hf":
            warm = GenerationConfig(max_new_tokens=8, gamma=cell.config.gamma, tree=cell.config.tree)
            engines[cell.drafter].generate(prompt_ids[0], SamplingParams(temperature=cell.temperature), warm)
    hf_cfg = BenchConfig(target=cfg.target, draft=cfg.draft, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    for cell in tqdm(list(alternating(cfg.rounds, table)), desc="bench-drafters", unit="cell", file=sys.stderr):
        if cell.drafter == "hf":
            result = run_hf_assisted(target, draft_model, prompt_ids, cell.temperature, hf_cfg, cfg.gamma)
            cell.seconds += result.seconds
            cell.new_tokens += result.new_tokens
        else:
            cell.run_requests(engines[cell.drafter], prompt_ids, cell.temperature, cell.config, cfg.seed)
    rows = summarise(table)
    report: dict[str, Any] = {
        "config": {**{k: v for k, v in cfg.__dict__.items() if k != "out_dir"}, "out_dir": str(cfg.out_dir)},
        "machine": {"torch_threads": torch.get_num_threads()},
        "rows": rows,
        "headline": headline(rows),
    }
    save_report(cfg.out_dir, "drafters", report, markdown(report), lambda path: plot(rows, path))
    return report


def summarise(table: list[Cell]) -> list[dict[str, Any]]:
    plain = {cell.temperature: cell.tokens_per_second for cell in table if cell.drafter == "none"}
    rows = []
    for cell in table:
        has_stats = cell.stats.cycles > 0 and cell.drafter != "none"
        rows.append(
            {
                "name": cell.name,
                "drafter": cell.drafter,
                "temperature": cell.temperature,
                "tree": cell.config.tree.describe() if cell.config.tree is not None else None,
                "gamma": cell.config.gamma if cell.config.tree is None else None,
                "new_tokens": cell.new_tokens,
                "seconds": cell.seconds,
                "tokens_per_second": cell.tokens_per_second,
                "speedup": cell.tokens_per_second / plain[cell.temperature] if plain.get(cell.temperature) else None,
                "mean_accepted_length": cell.stats.mean_accepted if has_stats else None,
                "draft_ms_per_cycle": 1e3 * cell.stats.draft_seconds / cell.stats.cycles if has_stats else None,
                "verify_ms_per_cycle": 1e3 * cell.stats.verify_seconds / cell.stats.cycles if has_stats else None,
                "acceptance_by_depth": cell.stats.acceptance_by_position[:8] if has_stats else None,
            }
        )
    return rows


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """EAGLE's best greedy speedup and whether it has the highest mean accepted length (the issue's target)."""
    greedy = [r for r in rows if r["temperature"] == 0.0 and r["mean_accepted_length"] is not None]
    eagle = [r for r in greedy if r["drafter"].startswith("eagle:")]
    if not eagle:
        return {}
    best = max(eagle, key=lambda r: r["tokens_per_second"])
    longest = max(greedy, key=lambda r: r["mean_accepted_length"])
    return {
        "eagle_best_greedy": best["name"],
        "eagle_greedy_speedup": best["speedup"],
        "target_speedup": TARGET_SPEEDUP,
        "speedup_met": best["speedup"] is not None and best["speedup"] >= TARGET_SPEEDUP,
        "longest_mean_accepted_greedy": longest["name"],
        "eagle_longest": longest["drafter"].startswith("eagle:"),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| drafter | T | tokens/s | speedup | mean accepted length | acceptance by depth | draft / verify ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        depth = r["acceptance_by_depth"]
        by_depth = ", ".join("-" if a is None else f"{a:.2f}" for a in depth) if depth else "-"
        speedup = "–" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        lines.append(
            f"| {r['name']} | {r['temperature']:g} | {r['tokens_per_second']:.1f} | {speedup} "
            f"| {table_cell(r['mean_accepted_length'])} | {by_depth} "
            f"| {table_cell(r.get('draft_ms_per_cycle'), 1)} / {table_cell(r.get('verify_ms_per_cycle'), 1)} |"
        )
    top = report["headline"]
    if top:
        lines += [
            "",
            f"- **greedy**: best EAGLE {top['eagle_best_greedy']} at {table_cell(top['eagle_greedy_speedup'])}× plain "
            f"(target {top['target_speedup']}×); longest mean accepted length: {top['longest_mean_accepted_greedy']}",
        ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        chosen = [r for r in rows if r["temperature"] == temperature]
        ax.barh([r["name"] for r in chosen], [r["tokens_per_second"] for r in chosen], color="tab:blue")
        for y, r in enumerate(chosen):
            if r["mean_accepted_length"] is not None:
                ax.text(r["tokens_per_second"], y, f" {r['mean_accepted_length']:.2f} tok/pass", va="center")
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (bars) — mean accepted length (labels)")
        ax.set_title(f"drafters, temperature {temperature:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `specserve bench-drafters`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ReplicaConfig.add_arguments(parser, ["target"])
    parser.add_argument("--draft", default=str(defaults.DEFAULT_DRAFT), help="the small draft model directory")
    parser.add_argument("--eagle", default=str(defaults.MODELS_DIR / "eagle"), help="trained EAGLE head directory")
    parser.add_argument("--medusa", default=str(defaults.MODELS_DIR / "medusa"), help="trained Medusa heads directory")
    parser.add_argument("--exit-head", default=str(defaults.MODELS_DIR / "exit-head"), help="trained exit head dir")
    add_prompt_arguments(parser, num_prompts=6)
    add_max_new_tokens_argument(parser)
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every cell, order alternating")
    parser.add_argument("--gamma", type=int, default=4, help="γ of the chains")
    add_output_arguments(parser, "bench-drafters", "drafters.json/.md/.png")
    QUICK.add_argument(parser)


def config_from_args(args: argparse.Namespace) -> DrafterBenchConfig:
    """The configuration the flags describe (``--quick`` applied); raises :class:`UserError` for a bad value."""
    QUICK.apply(args)
    if args.rounds < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.gamma <= MAX_GAMMA:
        raise UserError(f"--rounds, --num-prompts and --max-new-tokens must be >= 1, --gamma in 1..{MAX_GAMMA}")
    return DrafterBenchConfig(
        **options(args, "target", "draft", "eagle", "medusa", "exit_head", "num_prompts", "max_new_tokens"),
        **options(args, "rounds", "gamma"),
        prompts_file=args.prompts,
        temperatures=tuple(number_list(args.temperatures, float, "--temperatures")),
        out_dir=Path(args.out),
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), report_paths(cfg.out_dir, "drafters"))
    return 0
