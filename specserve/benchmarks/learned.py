"""`specserve bench-drafters`: every kind of drafter against plain decoding, greedy and at temperature 1.

One target, the same prompts and ``max_new_tokens`` for every cell, in one process. The prompts are a
workload (``--workload``, :mod:`specserve.benchmarks.prompts`):

* ``code`` (default) — the openings of held-out standard-library files (or ``--prompts FILE``);
* ``repetitive`` — editing requests: a held-out file's excerpt and "the same code, with NAME renamed",
  so the output repeats the input;
* ``multiturn`` — conversations: a request's prompt holds the earlier turns' prompts and outputs and
  asks for the code again. The outputs in the prompts are the target's greedy ones (made once, before
  timing, by plain decoding; the same prompts for every cell and temperature), and the requests run
  in order through one engine, so a drafter that remembers earlier requests (suffix) sees them.

The cells:

* ``plain`` — no drafting, the baseline of every speedup;
* ``draft chain`` / ``draft tree`` — the small draft model (chain γ, and a dynamic tree);
* ``eagle chain`` / ``eagle tree`` — the trained EAGLE head (chain, and EAGLE-2 dynamic trees);
* ``medusa tree`` — the trained Medusa heads' static tree (best-first over their calibrated ranks);
* ``pard chain`` / ``pard tree`` — the PARD draft model (``--pard``, ``specserve train pard``): a whole block in one
  forward (chain γ, and a tree of the block's per-position top tokens);
* ``layerskip`` — the target's first L layers, plain and with the trained exit head;
* ``ngram`` — prompt lookup (chains of γ and 16, and a tree of several earlier matches);
* ``suffix`` — suffix decoding (chains of γ and 16: its draft length follows the match, so 16 is only a cap;
  and a tree), a fresh global store for every pass of a cell, so that
  it holds the outputs of that pass's earlier requests only (not other rounds' or cells');
* ``rest`` — REST retrieval from a token datastore (chain and tree), with ``--datastore FILE`` or, by
  default, ``runs/datastore/stdlib.rest`` (``make datastore``) when it exists;
* ``lookahead`` — Lookahead decoding: the target's own Jacobi window (W x (N - 1) extra positions per forward)
  fills an n-gram pool; chain, and trees of up to G pooled n-grams (the defaults 4,3,4, and 5,4,5);
* ``hf assisted`` — transformers' own assisted generation with the same draft model (constant γ);
* ``hf prompt lookup`` — transformers' ``generate(prompt_lookup_num_tokens=γ)``.

Every cell of ours is exact (greedy equals plain greedy; sampled follows the target's law), so only
speed differs. Machine speed drifts on a shared host: each cell runs once per round, rounds
alternate the order, and the totals pool all rounds. Reported per cell: tokens/s end to end,
speedup over plain at the same temperature, mean accepted length (tokens per target pass) and
acceptance by depth. Cells whose drafter directory or datastore is missing are skipped with a note
(stderr, and ``skipped`` in the report). Prompts longer than the target's context minus
``max_new_tokens`` keep their last tokens.

Results: ``drafters.json``, ``drafters.md`` (the table for BENCHMARKS.md, and the headline) and
``drafters.png`` under ``--out`` (default ``runs/bench-drafters/``); the other workloads write
``drafters-repetitive.*`` and ``drafters-multiturn.*`` beside them. stdout carries the table and a
``results:`` line, or with ``--json`` the report alone (:mod:`specserve.benchmarks.arguments`).
``--quick`` is a smoke run of about a minute (:data:`QUICK`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
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
from specserve.benchmarks.prompts import (
    MULTITURN_TURNS,
    heldout_files,
    heldout_prompts,
    load_prompts,
    multiturn_prompts,
    repetitive_prompts,
)
from specserve.benchmarks.speculative import BenchConfig, run_hf, run_hf_assisted
from specserve.benchmarks.tables import table_cell
from specserve.benchmarks.tally import Tally, alternating, report_paths, save_report
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.draft.drafter import Drafter
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.draft.spec_strings import LOOKAHEAD_PREFIX, REST_PREFIX
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter

TARGET_SPEEDUP = 2.0  # EAGLE's target over plain greedy decoding (issue 7)
WORKLOADS = ("code", "repetitive", "multiturn")
DEFAULT_DATASTORE = RUNS_DIR / "datastore" / "stdlib.rest"  # what `make datastore` writes
HF_ASSISTED, HF_PROMPT_LOOKUP = "hf", "hf-prompt-lookup"  # transformers' cells (not drafter specs)
FRESH_PER_PASS = ("suffix",)  # drafters that learn from the requests they serve: a new one for every pass
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
    pard: str
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
    workload: str = "code"  # one of WORKLOADS
    datastore: str = str(DEFAULT_DATASTORE)  # the rest cells' datastore; skipped when it is not a file

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise UserError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")

    @property
    def stem(self) -> str:
        """The report files' name: ``drafters`` for the code workload, ``drafters-<workload>`` for the others."""
        return "drafters" if self.workload == "code" else f"drafters-{self.workload}"


@dataclass
class Cell(Tally):
    name: str
    drafter: str  # the --draft spec ("none" for plain; HF_ASSISTED and HF_PROMPT_LOOKUP for transformers' cells)
    temperature: float
    config: GenerationConfig


def cells(cfg: DrafterBenchConfig) -> list[Cell]:
    """Every (drafter, shape) cell at every temperature; drafters whose directory or datastore is missing are left
    out (:func:`skipped` says which)."""
    kept = [(name, spec, config) for name, spec, config, missing in _plan(cfg) if missing is None]
    return [Cell(name, spec, t, config) for t in cfg.temperatures for name, spec, config in kept]


def skipped(cfg: DrafterBenchConfig) -> list[str]:
    """A note for every cell :func:`cells` leaves out: its name and what is missing."""
    return [f"{name}: {missing}" for name, _, _, missing in _plan(cfg) if missing is not None]


def _plan(cfg: DrafterBenchConfig) -> list[tuple[str, str, GenerationConfig, str | None]]:
    """Every cell's name, drafter spec, config, and what is missing for it (None: nothing)."""
    n, gamma = cfg.max_new_tokens, cfg.gamma

    def tree(depth: int, width: int, nodes: int, expand: int | None = None) -> GenerationConfig:
        spec = TreeSpec("dynamic", budget=TreeBudget(depth, width, nodes, expand))
        return GenerationConfig(max_new_tokens=n, tree=spec)

    chain = GenerationConfig(max_new_tokens=n, gamma=gamma)
    long_chain = GenerationConfig(max_new_tokens=n, gamma=16)
    short = GenerationConfig(max_new_tokens=n, gamma=3)  # layer-skip drafts cost a good part of a target pass
    model_free_tree = tree(8, 3, 16)  # deep: a long match drafts far
    eagle, medusa, rest = f"eagle:{cfg.eagle}", f"medusa:{cfg.medusa}", REST_PREFIX + cfg.datastore
    plan: list[tuple[str, str, GenerationConfig, str | None]] = [  # name, --draft spec, config, directory it needs
        ("plain", "none", GenerationConfig(max_new_tokens=n, gamma=0), None),
        (f"draft chain {gamma}", cfg.draft, chain, cfg.draft),
        ("draft tree 8 (d4 w2 e1)", cfg.draft, tree(4, 2, 8, 1), cfg.draft),
        (f"eagle chain {gamma}", eagle, chain, cfg.eagle),
        ("eagle tree 8 (d5 w2 e1)", eagle, tree(5, 2, 8, 1), cfg.eagle),
        ("eagle tree 16 (d6 w3 e3)", eagle, tree(6, 3, 16, 3), cfg.eagle),
        ("medusa tree 8", medusa, tree(4, 4, 8), cfg.medusa),
        (f"pard chain {gamma}", f"pard:{cfg.pard}", chain, cfg.pard),
        ("pard tree 8 (d4 w2)", f"pard:{cfg.pard}", tree(4, 2, 8), cfg.pard),
        (f"layerskip:{cfg.layerskip_layers} chain 3", f"layerskip:{cfg.layerskip_layers}", short, None),
        ("layerskip + exit head chain 3", f"layerskip:{cfg.exit_head}", short, cfg.exit_head),
        (f"ngram chain {gamma}", "ngram", chain, None),
        ("ngram tree 16 (d8 w3)", "ngram", model_free_tree, None),
        ("ngram chain 16", "ngram", long_chain, None),
        (f"suffix chain {gamma}", "suffix", chain, None),
        ("suffix chain 16", "suffix", long_chain, None),  # its drafts adapt to the match: a long γ is a cap
        ("suffix tree 16 (d8 w3)", "suffix", model_free_tree, None),
        (f"rest chain {gamma}", rest, chain, None),
        ("rest tree 16 (d8 w3)", rest, model_free_tree, None),
        (f"lookahead chain {gamma}", "lookahead", chain, None),
        ("lookahead tree 8 (d2 w4)", "lookahead", tree(2, 4, 8), None),
        ("lookahead:5,4,5 tree 12 (d3 w5)", "lookahead:5,4,5", tree(3, 5, 12), None),
        (f"hf assisted {gamma}", HF_ASSISTED, chain, cfg.draft),
        (f"hf prompt lookup {gamma}", HF_PROMPT_LOOKUP, chain, None),
    ]
    return [(name, spec, config, _missing(spec, needs, cfg.datastore)) for name, spec, config, needs in plan]


def _missing(spec: str, directory: str | None, datastore: str) -> str | None:
    """What a cell lacks: the datastore of a ``rest:`` spec, or the model directory it needs; None when nothing."""
    if spec.startswith(REST_PREFIX):
        return (
            None if Path(datastore).is_file() else f"no datastore {datastore} (`make datastore`, or --datastore FILE)"
        )
    return None if directory is None or _exists(directory) else f"no model directory {directory}"


def _exists(directory: str) -> bool:
    return Path(directory, "config.json").is_file()


def workload_texts(cfg: DrafterBenchConfig, respond: Callable[[str], str]) -> list[str]:
    """The workload's prompts, at most ``cfg.num_prompts``, from ``--prompts`` or the held-out files; ``respond``
    gives a multi-turn prompt's output (for the next turn's prompt)."""
    given = load_prompts(cfg.prompts_file) if cfg.prompts_file else None
    if cfg.workload == "repetitive":
        return repetitive_prompts(given or heldout_files(cfg.num_prompts))[: cfg.num_prompts]
    if cfg.workload == "multiturn":
        conversations = math.ceil(cfg.num_prompts / MULTITURN_TURNS)
        return multiturn_prompts((given or heldout_prompts(conversations))[:conversations], cfg.num_prompts, respond)
    return (given or heldout_prompts(cfg.num_prompts))[: cfg.num_prompts]


def run(cfg: DrafterBenchConfig) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    target = CausalLM.load(cfg.target, dtype=cfg.dtype)
    engine = SpeculativeEngine(target, build_drafter("none", target))
    limit = target.info.max_positions - cfg.max_new_tokens
    if limit < 1:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the target's context")

    def respond(text: str) -> str:  # a multi-turn prompt's output: plain greedy decoding, untimed
        greedy = GenerationConfig(max_new_tokens=cfg.max_new_tokens, gamma=0)
        out = engine.generate(engine.encode(text)[-limit:], SamplingParams(temperature=0.0), greedy)
        return engine.decode(out.output_ids)

    prompt_ids = [ids[-limit:] for ids in map(engine.encode, workload_texts(cfg, respond)) if ids]
    if not prompt_ids:
        raise UserError("every prompt is empty once tokenised")
    table = cells(cfg)
    notes = skipped(cfg)
    for note in notes:
        tqdm.write(f"  skipped {note}", file=sys.stderr)
    drafters: dict[str, Drafter] = {}
    for cell in table:
        if cell.drafter not in drafters and cell.drafter not in (HF_ASSISTED, HF_PROMPT_LOOKUP):
            drafters[cell.drafter] = build_drafter(cell.drafter, target, dtype=cfg.dtype)
    assisted = any(cell.drafter == HF_ASSISTED for cell in table)
    draft_model = CausalLM.load(cfg.draft, dtype=cfg.dtype) if assisted else None
    engines = {spec: SpeculativeEngine(target, drafter) for spec, drafter in drafters.items()}
    for cell in table:  # warm-up: one short request per cell
        if cell.drafter in engines:
            warm = GenerationConfig(max_new_tokens=8, gamma=cell.config.gamma, tree=cell.config.tree)
            engines[cell.drafter].generate(prompt_ids[0], SamplingParams(temperature=cell.temperature), warm)
    hf_cfg = BenchConfig(target=cfg.target, draft=cfg.draft, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    for cell in tqdm(list(alternating(cfg.rounds, table)), desc="bench-drafters", unit="cell", file=sys.stderr):
        if cell.drafter in (HF_ASSISTED, HF_PROMPT_LOOKUP):
            if cell.drafter == HF_ASSISTED:
                assert draft_model is not None
                result = run_hf_assisted(target, draft_model, prompt_ids, cell.temperature, hf_cfg, cfg.gamma)
            else:
                lookup = {"prompt_lookup_num_tokens": cfg.gamma}
                result = run_hf(target, prompt_ids, cell.temperature, hf_cfg, "hf/prompt_lookup", cfg.gamma, **lookup)
            cell.seconds += result.seconds
            cell.new_tokens += result.new_tokens
        else:
            cell_engine = engines[cell.drafter]
            if cell.drafter in FRESH_PER_PASS:  # an empty global store: this pass's earlier requests only
                cell_engine = SpeculativeEngine(target, build_drafter(cell.drafter, target, dtype=cfg.dtype))
            cell.run_requests(cell_engine, prompt_ids, cell.temperature, cell.config, cfg.seed)
    rows = summarise(table)
    report: dict[str, Any] = {
        "config": {**{k: v for k, v in cfg.__dict__.items() if k != "out_dir"}, "out_dir": str(cfg.out_dir)},
        "machine": {"torch_threads": torch.get_num_threads()},
        "workload": {
            "name": cfg.workload,
            "prompts": len(prompt_ids),
            "mean_prompt_tokens": sum(map(len, prompt_ids)) / len(prompt_ids),
        },
        "skipped": notes,
        "rows": rows,
        "headline": headline(rows),
        "model_free": model_free_headline(rows),
    }
    save_report(cfg.out_dir, cfg.stem, report, markdown(report), lambda path: plot(rows, path))
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
                "drafter_counters": dict(cell.stats.drafter_counters),
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


def model_free_headline(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per temperature (as text), the best suffix, rest and hf prompt lookup cell's tokens/s over the best
    n-gram cell's, and the best Lookahead cell's over plain decoding (issue 18's targets); None where a side did not
    run."""
    out: dict[str, dict[str, float | None]] = {}
    for temperature in sorted({r["temperature"] for r in rows}):
        at = [r for r in rows if r["temperature"] == temperature]

        def best(accept: Callable[[str], bool], chosen: list[dict[str, Any]] = at) -> float | None:
            speeds = [r["tokens_per_second"] for r in chosen if accept(r["drafter"])]
            return max(speeds) if speeds else None

        ngram, plain = best(lambda spec: spec == "ngram"), best(lambda spec: spec == "none")
        sides = {
            "suffix_over_ngram": best(lambda spec: spec == "suffix"),
            "rest_over_ngram": best(lambda spec: spec.startswith(REST_PREFIX)),
            "hf_prompt_lookup_over_ngram": best(lambda spec: spec == HF_PROMPT_LOOKUP),
        }
        ratios = {key: side / ngram if side and ngram else None for key, side in sides.items()}
        lookahead = best(lambda spec: spec == "lookahead" or spec.startswith(LOOKAHEAD_PREFIX))
        ratios["lookahead_over_plain"] = lookahead / plain if lookahead and plain else None
        out[f"{temperature:g}"] = ratios
    return out


def counters_summary(counters: dict[str, int]) -> str:
    """A model-free drafter's counters in words: how often it matched and how long (suffix, REST), or how often its
    pool had n-grams for the root (Lookahead); ``-`` for a drafter that counts nothing."""
    proposals = counters.get("proposals", 0)
    if not proposals:
        return "-"
    if "pool_hits" in counters:
        return f"pool hits {counters['pool_hits'] / proposals:.0%}, {counters.get('window_ngrams', 0)} window n-grams"
    matched = counters.get("matched", 0)
    mean = f", mean match {counters.get('match_tokens', 0) / matched:.1f} tokens" if matched else ""
    shared = f", {counters['global_matches'] / matched:.0%} global" if matched and "global_matches" in counters else ""
    return f"matched {matched / proposals:.0%}{mean}{shared}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| drafter | T | tokens/s | speedup | mean accepted length | acceptance by depth | draft / verify ms "
        "| drafter's counters |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        depth = r["acceptance_by_depth"]
        by_depth = ", ".join("-" if a is None else f"{a:.2f}" for a in depth) if depth else "-"
        speedup = "–" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        lines.append(
            f"| {r['name']} | {r['temperature']:g} | {r['tokens_per_second']:.1f} | {speedup} "
            f"| {table_cell(r['mean_accepted_length'])} | {by_depth} "
            f"| {table_cell(r.get('draft_ms_per_cycle'), 1)} / {table_cell(r.get('verify_ms_per_cycle'), 1)} "
            f"| {counters_summary(r.get('drafter_counters') or {})} |"
        )
    top = report["headline"]
    if top:
        lines += [
            "",
            f"- **greedy**: best EAGLE {top['eagle_best_greedy']} at {table_cell(top['eagle_greedy_speedup'])}× plain "
            f"(target {top['target_speedup']}×); longest mean accepted length: {top['longest_mean_accepted_greedy']}",
        ]
    workload = report.get("workload")
    if workload:
        lines += [
            "",
            f"- **workload**: {workload['name']}, {workload['prompts']} prompts, "
            f"mean {workload['mean_prompt_tokens']:.0f} prompt tokens",
        ]
    for temperature, ratios in report.get("model_free", {}).items():
        shown = ", ".join(
            f"{key.replace('_', ' ')} " + ("–" if value is None else f"{table_cell(value)}×")
            for key, value in ratios.items()
        )
        lines.append(f"- **T = {temperature}** tokens/s, best of each: {shown}")
    lines += [f"- skipped {note}" for note in report.get("skipped", [])]
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
    parser.add_argument("--pard", default=str(defaults.MODELS_DIR / "pard"), help="PARD draft model directory")
    add_prompt_arguments(parser, num_prompts=6)
    add_max_new_tokens_argument(parser)
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every cell, order alternating")
    parser.add_argument("--gamma", type=int, default=4, help="γ of the chains")
    parser.add_argument(
        "--workload",
        default="code",
        metavar="{" + ",".join(WORKLOADS) + "}",
        help="the prompts: held-out code openings (code), editing requests whose output repeats the input "
        "(repetitive), or conversations whose later requests repeat earlier outputs (multiturn)",
    )
    parser.add_argument(
        "--datastore",
        help=f"the REST cells' token datastore (default: {DEFAULT_DATASTORE} when it exists, else the rest cells "
        "are skipped; `make datastore` builds it)",
    )
    add_output_arguments(parser, "bench-drafters", "drafters.json/.md/.png")
    QUICK.add_argument(parser)


def config_from_args(args: argparse.Namespace) -> DrafterBenchConfig:
    """The configuration the flags describe (``--quick`` applied); raises :class:`UserError` for a bad value."""
    QUICK.apply(args)
    if args.rounds < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.gamma <= MAX_GAMMA:
        raise UserError(f"--rounds, --num-prompts and --max-new-tokens must be >= 1, --gamma in 1..{MAX_GAMMA}")
    if args.datastore is not None and not Path(args.datastore).is_file():
        raise UserError(
            f"--datastore {args.datastore} is not a file; build one with `specserve datastore build "
            f"--tokenizer TARGET_DIR --out {args.datastore}` (or `make datastore`)"
        )
    return DrafterBenchConfig(
        **options(args, "target", "draft", "eagle", "medusa", "exit_head", "pard", "num_prompts", "max_new_tokens"),
        **options(args, "rounds", "gamma", "workload"),
        datastore=args.datastore or str(DEFAULT_DATASTORE),
        prompts_file=args.prompts,
        temperatures=tuple(number_list(args.temperatures, float, "--temperatures")),
        out_dir=Path(args.out),
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), report_paths(cfg.out_dir, cfg.stem))
    return 0
