"""`specserve bench-trees`: draft chains against static and dynamic draft trees at equal verified nodes.

One question: at the same number k of draft nodes the target verifies per cycle, how do a chain
(gamma = k), a static tree (k nodes) and a dynamic EAGLE-2 tree (k nodes kept) compare in mean
accepted length and tokens/s, greedy and sampled? All run in one process on the same prompts
and ``max_new_tokens``, with the same draft model, exact at every temperature:

* ``chain k`` — the draft model's k-token chain (sampled with q at temperature > 0);
* ``static k (depth d)`` — a Medusa-style calibrated topology: the k index paths of at most
  ``STATIC_DEPTHS`` levels with the highest product of rank probabilities
  (:meth:`~specserve.core.tree.draft_tree.TreeTopology.best_first`), where
  ``rank_probs[r]`` is how often the target's greedy token is the draft's rank-r candidate on
  calibration prompts that are not benchmark prompts (:func:`calibrate_rank_probs`);
* ``dynamic k (d w e)`` — expand the ``e`` most confident nodes per level into ``w`` children
  each, down to depth ``d``, keep the best ``k`` nodes (:class:`~specserve.core.tree.draft_tree.TreeBudget`;
  sampled trees spend the ``k`` while growing instead);
* ``plain`` — no drafting, the baseline of every speedup.

A CPU's verify cost grows with k (BENCHMARKS.md), so k is a real cost here. Machine speed drifts
on a shared host, so each configuration runs once per round, rounds alternate the order, and the
totals pool all rounds. The baseline of the target is the best chain *of the same run*.

Results: ``trees.json``, ``trees.md`` (the table for BENCHMARKS.md) and ``trees.png`` (tokens/s
against k per shape and temperature) under ``--out`` (default ``runs/bench-trees/``). stdout carries
the table and a ``results:`` line, or with ``--json`` the report alone
(:mod:`specserve.benchmarks.arguments`). ``--quick`` is a smoke run of about a minute (:data:`QUICK`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
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
from specserve.benchmarks.prompts import heldout_prompts, load_prompts
from specserve.benchmarks.tables import table_cell
from specserve.benchmarks.tally import Tally, alternating, report_paths, save_report
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.registry import build_drafter_set

# Dynamic (depth, width, expand) per k: one confident path with alternatives on its nodes (expand 1: each level
# is a one-row draft forward, like a chain), and EAGLE-2's shape (expand = width).
DYNAMIC_SHAPES: dict[int, tuple[tuple[int, int, int], ...]] = {
    4: ((3, 2, 1), (4, 2, 2)),
    8: ((4, 2, 1), (5, 3, 3)),
    16: ((6, 3, 1), (7, 3, 3)),
    32: ((8, 4, 1), (8, 4, 4)),
}
# Depth caps of the calibrated static trees: uncapped, a well-calibrated drafter's best tree is nearly a chain;
# capped, the nodes go to second and third candidates near the root.
STATIC_DEPTHS = (16, 4)
CALIBRATION_RANKS = 8
TARGET_SPEEDUP = 1.2
QUICK_CALIBRATION_PROMPTS = 2
QUICK = Quick(
    {"num_prompts": 2, "max_new_tokens": 32, "ks": "4", "temperatures": "0", "rounds": 1},
    f"2 prompts × 32 new tokens, greedy, one round, k = 4 only ({QUICK_CALIBRATION_PROMPTS} calibration prompts)",
)


@dataclass(frozen=True)
class TreeBenchConfig:
    target: str
    draft: str
    dtype: str = "float32"
    device: str = "cpu"
    prompts_file: str | None = None
    num_prompts: int = 8
    max_new_tokens: int = 128
    ks: tuple[int, ...] = (4, 8, 16, 32)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    rounds: int = 2
    calibration_prompts: int = 8
    out_dir: Path = RUNS_DIR / "bench-trees"
    seed: int = 0


@dataclass
class Row(Tally):
    name: str
    shape: str  # plain | chain | static | dynamic
    k: int  # draft nodes verified per cycle (0 for plain)
    temperature: float
    config: GenerationConfig


def calibrate_rank_probs(
    target: CausalLM, draft: CausalLM, prompt_ids: list[list[int]], new_tokens: int = 64, ranks: int = CALIBRATION_RANKS
) -> list[float]:
    """How often the target's greedy next token is the draft's rank-r candidate (r < ``ranks``), teacher-forced
    on the target's own greedy continuations of ``prompt_ids``."""
    engine = SpeculativeEngine(target, build_drafter_set("none", target))
    hits = torch.zeros(ranks, dtype=torch.float64)
    total = 0
    for ids in prompt_ids:
        out = engine.generate(ids, SamplingParams(), GenerationConfig(max_new_tokens=new_tokens, gamma=0))
        sequence = torch.tensor(ids + out.output_ids, dtype=torch.long)
        logits = draft.forward(draft.new_cache(), sequence[:-1])[len(ids) - 1 :]  # predicts each output token
        actual = sequence[len(ids) :]
        rank = (logits > logits.gather(1, actual[:, None])).sum(-1)  # candidates the draft ranks above it
        hits += torch.bincount(rank.clamp(max=ranks), minlength=ranks + 1)[:ranks].double()
        total += int(actual.numel())
    return [max(float(h) / max(total, 1), 1e-6) for h in hits]


def configurations(cfg: TreeBenchConfig, rank_probs: list[float]) -> list[tuple[str, str, int, GenerationConfig]]:
    """(name, shape, k, generation config) for plain and every shape at every k."""
    n = cfg.max_new_tokens
    out = [("plain", "plain", 0, GenerationConfig(max_new_tokens=n, gamma=0))]
    for k in cfg.ks:
        out.append((f"chain {k}", "chain", k, GenerationConfig(max_new_tokens=n, gamma=k)))
        topologies = {TreeTopology.best_first(k, rank_probs, max_depth=d) for d in STATIC_DEPTHS}
        for topology in sorted(topologies, key=lambda t: -max(map(len, t.paths))):
            spec = TreeSpec("static", topology=topology)
            out.append((f"static {k} (depth {max(map(len, topology.paths))})", "static", k, _tree(n, spec)))
        for depth, width, expand in DYNAMIC_SHAPES.get(k, ((min(k, 4), 2, 1),)):
            spec = TreeSpec("dynamic", budget=TreeBudget(depth, width, k, expand))
            out.append((f"dynamic {k} (d{depth} w{width} e{expand})", "dynamic", k, _tree(n, spec)))
    return out


def _tree(max_new_tokens: int, spec: TreeSpec) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, tree=spec)


def run(cfg: TreeBenchConfig) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    target = CausalLM.load(cfg.target, dtype=cfg.dtype, device=cfg.device)
    drafters = build_drafter_set(cfg.draft, target, dtype=cfg.dtype, device=cfg.device)
    draft_model = getattr(drafters.configured, "model", None)
    if not isinstance(draft_model, CausalLM):
        raise ValueError(f"bench-trees needs a draft model directory, got {cfg.draft!r}")
    engine = SpeculativeEngine(target, drafters)
    if cfg.prompts_file:
        texts = load_prompts(cfg.prompts_file)
        prompts, calibration = texts[: cfg.num_prompts], texts[cfg.num_prompts :][: cfg.calibration_prompts]
    else:
        texts = heldout_prompts(cfg.num_prompts + cfg.calibration_prompts)
        prompts, calibration = texts[: cfg.num_prompts], texts[cfg.num_prompts :]
    prompt_ids = [engine.encode(p) for p in prompts]
    rank_probs = calibrate_rank_probs(target, draft_model, [engine.encode(p) for p in calibration or prompts])
    rows = [
        Row(name, shape, k, temperature, config)
        for temperature in cfg.temperatures
        for name, shape, k, config in configurations(cfg, rank_probs)
    ]
    for row in rows:  # warm-up: one short request per configuration
        warm = GenerationConfig(max_new_tokens=8, gamma=row.config.gamma, tree=row.config.tree)
        engine.generate(prompt_ids[0], SamplingParams(temperature=row.temperature, seed=cfg.seed), warm)
    for row in tqdm(list(alternating(cfg.rounds, rows)), desc="bench-trees", unit="cell", file=sys.stderr):
        row.run_requests(engine, prompt_ids, row.temperature, row.config, cfg.seed)
    summary = summarise(rows)
    report: dict[str, Any] = {
        "config": {**{k: v for k, v in cfg.__dict__.items() if k != "out_dir"}, "out_dir": str(cfg.out_dir)},
        "machine": {"torch_threads": torch.get_num_threads()},
        "rank_probs": rank_probs,
        "rows": summary,
        "headline": headline(summary),
    }
    save_report(cfg.out_dir, "trees", report, markdown(report), lambda path: plot(summary, path))
    return report


def summarise(rows: list[Row]) -> list[dict[str, Any]]:
    plain = {row.temperature: row.tokens_per_second for row in rows if row.shape == "plain"}
    out = []
    for row in rows:
        shapes = row.stats.tree_shapes
        out.append(
            {
                "name": row.name,
                "shape": row.shape,
                "k": row.k,
                "temperature": row.temperature,
                "tree": row.config.tree.describe() if row.config.tree is not None else None,
                "new_tokens": row.new_tokens,
                "seconds": row.seconds,
                "tokens_per_second": row.tokens_per_second,
                "speedup_vs_plain": row.tokens_per_second / plain[row.temperature]
                if plain.get(row.temperature)
                else None,
                "mean_accepted": row.stats.mean_accepted,
                "cycles": row.stats.cycles,
                "mean_nodes": sum(n for n, _ in shapes) / len(shapes) if shapes else None,
                "draft_ms_per_cycle": 1000 * row.stats.draft_seconds / row.stats.cycles if row.stats.cycles else None,
                "verify_ms_per_cycle": 1000 * row.stats.verify_seconds / row.stats.cycles if row.stats.cycles else None,
            }
        )
    return out


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per temperature: the best chain, the best static and dynamic tree, and dynamic / best chain."""
    out: dict[str, Any] = {}
    for temperature in sorted({r["temperature"] for r in rows}):
        at = [r for r in rows if r["temperature"] == temperature]
        best = {
            shape: max((r for r in at if r["shape"] == shape), key=lambda r: r["tokens_per_second"])
            for shape in ("chain", "static", "dynamic")
            if any(r["shape"] == shape for r in at)
        }
        entry = {shape: {"name": r["name"], "tokens_per_second": r["tokens_per_second"]} for shape, r in best.items()}
        if "chain" in best and "dynamic" in best:
            ratio = best["dynamic"]["tokens_per_second"] / best["chain"]["tokens_per_second"]
            entry["dynamic_over_best_chain"] = ratio
            entry["target_met"] = ratio >= TARGET_SPEEDUP
        out[f"T={temperature:g}"] = entry
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| T | configuration | k | tokens/s | × plain | mean accepted | nodes/cycle | draft ms | verify ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['temperature']:g} | {r['name']} | {r['k']} | {r['tokens_per_second']:.1f} | "
            f"{table_cell(r['speedup_vs_plain'])} | {r['mean_accepted']:.2f} | {table_cell(r['mean_nodes'], 1)} | "
            f"{table_cell(r['draft_ms_per_cycle'], 1)} | {table_cell(r['verify_ms_per_cycle'], 1)} |"
        )
    lines.append("")
    for temperature, entry in report["headline"].items():
        parts = [f"best {shape}: {v['name']} {v['tokens_per_second']:.1f} tok/s" for shape, v in entry.items()
                 if isinstance(v, dict)]  # fmt: skip
        ratio = entry.get("dynamic_over_best_chain")
        if ratio is not None:
            parts.append(f"best dynamic / best chain = {ratio:.2f}× (target {TARGET_SPEEDUP}×)")
        lines.append(f"- **{temperature}**: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        at = [r for r in rows if r["temperature"] == temperature]
        for shape, marker in (("chain", "o"), ("static", "s"), ("dynamic", "^")):
            ks = sorted({r["k"] for r in at if r["shape"] == shape})
            best = [max(r["tokens_per_second"] for r in at if r["shape"] == shape and r["k"] == k) for k in ks]
            ax.plot(ks, best, marker=marker, label=shape if shape == "chain" else f"{shape} (best shape)")
        plain = [r["tokens_per_second"] for r in at if r["shape"] == "plain"]
        if plain:
            ax.axhline(plain[0], color="grey", linestyle="--", label="plain")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft nodes verified per cycle (k)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"temperature {temperature:g}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `specserve bench-trees`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_and_prompt_arguments(parser, num_prompts=8)
    parser.add_argument("--ks", default="4,8,16,32", help="comma-separated draft nodes verified per cycle")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every configuration, order alternating")
    add_output_arguments(parser, "bench-trees", "trees.json/.md/.png")
    QUICK.add_argument(parser)


def config_from_args(args: argparse.Namespace) -> TreeBenchConfig:
    """The configuration the flags describe (``--quick`` applied); raises :class:`UserError` for a bad value."""
    QUICK.apply(args)
    check_max_new_tokens(args)
    ks = number_list(args.ks, int, "--ks")
    if not ks or any(not 1 <= k <= MAX_GAMMA for k in ks):  # a chain of k nodes is gamma k
        raise UserError(f"--ks must be between 1 and {MAX_GAMMA}, got {args.ks}")
    if args.rounds < 1 or args.num_prompts < 1:
        raise UserError("--rounds and --num-prompts must be >= 1")
    return TreeBenchConfig(
        **model_and_prompt_options(args),
        ks=tuple(ks),
        temperatures=tuple(number_list(args.temperatures, float, "--temperatures")),
        rounds=args.rounds,
        calibration_prompts=QUICK_CALIBRATION_PROMPTS if args.quick else TreeBenchConfig.calibration_prompts,
        out_dir=Path(args.out),
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), report_paths(cfg.out_dir, "trees"))
    return 0
