"""Verify buckets on the CPU (issue 20): T_verify per bucket, and the bucketed engine's speed against today's.

Two measurements of the shipped pair (``bench/buckets.py``), on a fixed number of torch threads (1 by default):

* **T_verify(k)** — median ms of one target forward of k tokens after a held-out prompt's first ``--context``
  tokens, on three caches, interleaved so that the three share the machine's drift (every repeat visits every k,
  in alternating directions, and the caches in rotating order at each k):

  - ``dynamic`` — today's growing cache (:class:`~specserve.core.model.causal_lm.KVCache`), the block at its own width;
  - ``static`` — the static-shape cache (:mod:`specserve.core.static.slots`) with no buckets: its own width too;
  - ``bucketed`` — the static cache with the default buckets (``--buckets``; by default
    :data:`~specserve.core.model.buckets.CPU_BUCKETS`): the block padded to its bucket, so its cost is its bucket's.

  Then :func:`~specserve.core.model.buckets.choose_buckets` on the ``static`` costs (widths not measured count as
  unavailable: the buckets are chosen among the measured widths), set against the default buckets: at every k
  where the two pad to different widths, what each width costs.
* **Engine tokens/s** — for each drafter (the draft model, n-gram) and each γ, greedy, ``ignore_eos``: the growing-
  cache engine (``dynamic``, ``static=None``) against the static engine with the default buckets (``bucketed``)
  and, at the γ whose blocks (1 .. γ + 1 tokens) the chosen buckets pad differently, with the chosen ones
  (``chosen``). Every configuration runs once per round over the same prompts, rounds alternate the order
  (:func:`~specserve.benchmarks.tally.alternating`), totals pool the rounds. Every engine's output ids must equal
  the dynamic engine's; a difference is reported with the target's logit margin where the two part (float32 sums
  in another order at another width can flip a near-tie), and in the final JSON line.

Results: ``buckets.json``, ``buckets.md`` (the tables, with the command and thread count) and ``buckets.png``
(T_verify(k) per cache, speedups per γ) under ``--out``; progress goes to stderr, the tables to stdout, then one
JSON line. ``--quick`` is a smoke run (a few k, one prompt × 8 tokens, γ 1 and 4). CPU only; trains nothing and
changes no default: what the numbers say about :data:`~specserve.core.model.buckets.CPU_BUCKETS` is for a person to
decide.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specserve import defaults
from specserve.benchmarks.arguments import Quick
from specserve.benchmarks.device_check import exactness
from specserve.benchmarks.prompts import heldout_prompts
from specserve.benchmarks.tables import table_cell
from specserve.benchmarks.tally import Tally, alternating, report_paths, save_report
from specserve.benchmarks.timing import synchronize
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.kv.cache import KVCache
from specserve.core.model.buckets import NO_BUCKETS, VerifyBuckets, choose_buckets, default_buckets
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import StaticKVCache, StaticTarget
from specserve.drafters import build_drafter_set

STEM = "buckets"
CACHES = ("dynamic", "static", "bucketed")  # the T_verify(k) variants, in the order they are tabled
DRAFTERS = ("draft", "ngram")  # "draft": the draft model of --draft
QUICK = Quick(
    {"ks": "1-4,8", "repeats": 3, "num_prompts": 1, "max_new_tokens": 8, "gammas": "1,4"},
    "T_verify at k 1-4 and 8, then each engine on one prompt x 8 tokens at gamma 1 and 4",
)


@dataclass(frozen=True)
class BucketBenchConfig:
    target: str = str(defaults.DEFAULT_TARGET)
    draft: str = str(defaults.DEFAULT_DRAFT)
    dtype: str = "float32"
    threads: int = 1
    context_tokens: int = 200  # cached tokens before every timed verify block
    ks: tuple[int, ...] = (*range(1, 33), 40, 48, 56, 64)
    repeats: int = 9
    tolerance: float = 0.05  # choose_buckets' tolerance
    buckets: VerifyBuckets = field(default_factory=lambda: default_buckets("cpu"))
    drafters: tuple[str, ...] = DRAFTERS
    gammas: tuple[int, ...] = tuple(range(1, 9))
    num_prompts: int = 2
    max_new_tokens: int = 64
    rounds: int = 2
    out_dir: Path = Path("bench/results/buckets")
    command: str = "python bench/buckets.py"


# ---------------------------------------------------------------------------------------------
# T_verify(k)


def verify_caches(target: CausalLM, buckets: VerifyBuckets) -> dict[str, KVCache | StaticKVCache]:
    """An empty cache per :data:`CACHES` variant (the static ones eager: no graphs on a CPU)."""
    return {
        "dynamic": target.new_cache(),
        "static": StaticTarget(target, StaticOptions(buckets=NO_BUCKETS, cuda_graphs=False)).new_cache(),
        "bucketed": StaticTarget(target, StaticOptions(buckets=buckets, cuda_graphs=False)).new_cache(),
    }


def timed_forward(target: CausalLM, cache: KVCache | StaticKVCache, block: torch.Tensor) -> float:
    """Seconds of one forward of ``block`` (``[k]``) on ``cache``, which is rolled back to its length before."""
    length = cache.length
    synchronize(target.device)
    start = time.perf_counter()
    target.forward(cache, block)
    synchronize(target.device)
    seconds = time.perf_counter() - start
    cache.rollback(length)
    return seconds


def verify_costs(
    target: CausalLM, prefix: Sequence[int], ks: Sequence[int], repeats: int, buckets: VerifyBuckets
) -> dict[str, dict[int, list[float]]]:
    """Seconds of every timed forward, per variant and k: ``repeats`` visits after one untimed warm-up visit. A visit
    runs every k (ascending on even visits, descending on odd ones) and at each k every variant, in an order that
    rotates with the visit and k, so that no variant always runs first or after the same neighbour."""
    caches = verify_caches(target, buckets)
    prefix_ids = torch.tensor(list(prefix), dtype=torch.long)
    for cache in caches.values():
        target.forward(cache, prefix_ids, last_only=True)
    generator = torch.Generator().manual_seed(1)
    vocab = target.info.vocab_size
    blocks = {k: torch.randint(0, vocab, (k,), generator=generator) for k in ks}
    samples: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in CACHES}
    for visit in range(repeats + 1):
        order = list(ks) if visit % 2 == 0 else list(ks)[::-1]
        for i, k in enumerate(order):
            shift = (visit + i) % len(CACHES)
            for name in CACHES[shift:] + CACHES[:shift]:
                seconds = timed_forward(target, caches[name], blocks[k])
                if visit > 0:
                    samples[name][k].append(seconds)
        print(f"  T_verify visit {visit}/{repeats} done", file=sys.stderr, flush=True)
    return samples


def choose_among_measured(costs: Mapping[int, float], tolerance: float) -> VerifyBuckets:
    """:func:`choose_buckets` over widths 1 .. the widest measured, an unmeasured width counting as unavailable
    (infinitely dear: never a bucket, and no reason to pad past it)."""
    return choose_buckets({k: costs.get(k, math.inf) for k in range(1, max(costs) + 1)}, tolerance)


def padding_differences(
    costs: Mapping[int, float], default: VerifyBuckets, chosen: VerifyBuckets
) -> list[dict[str, Any]]:
    """Each measured k that the two bucket sets run at different widths: both widths and what each costs on the
    unpadded static cache (``None`` where that width was not measured)."""
    rows = []
    for k in sorted(costs):
        default_width, chosen_width = default.width(k), chosen.width(k)
        if default_width == chosen_width:
            continue
        default_ms, chosen_ms = costs.get(default_width), costs.get(chosen_width)
        rows.append(
            {
                "k": k,
                "default_width": default_width,
                "default_ms": default_ms,
                "chosen_width": chosen_width,
                "chosen_ms": chosen_ms,
                "default_over_chosen": default_ms / chosen_ms if default_ms and chosen_ms else None,
            }
        )
    return rows


def verify_section(cfg: BucketBenchConfig, target: CausalLM, prefix: list[int]) -> dict[str, Any]:
    samples = verify_costs(target, prefix, cfg.ks, cfg.repeats, cfg.buckets)
    ms = {name: {k: 1000 * statistics.median(times) for k, times in by_k.items()} for name, by_k in samples.items()}
    fastest = {name: {k: 1000 * min(times) for k, times in by_k.items()} for name, by_k in samples.items()}
    chosen = choose_among_measured(ms["static"], cfg.tolerance)
    # the default buckets clipped to the measured range, for a like-for-like comparison with the chosen ones
    default_in_range = VerifyBuckets(tuple(w for w in cfg.buckets.widths if w <= max(cfg.ks)))
    return {
        "context_tokens": len(prefix),
        "repeats": cfg.repeats,
        "ks": list(cfg.ks),
        "median_ms": ms,
        "min_ms": fastest,
        "predicted_bucketed_ms": {k: ms["static"].get(cfg.buckets.width(k)) for k in cfg.ks},
        "default_buckets": list(cfg.buckets.widths),
        "chosen_buckets": list(chosen.widths),
        "chosen_equals_default": chosen == default_in_range,
        "tolerance": cfg.tolerance,
        "padding_differences": padding_differences(ms["static"], cfg.buckets, chosen),
    }


# ---------------------------------------------------------------------------------------------
# Engines


def engine_options(cfg: BucketBenchConfig, chosen: VerifyBuckets) -> dict[str, StaticOptions | None]:
    """The engines by name: ``None`` is today's growing cache; ``chosen`` only where some γ's blocks pad otherwise
    than under the default buckets (:func:`pads_differently`)."""
    options: dict[str, StaticOptions | None] = {
        "dynamic": None,
        "bucketed": StaticOptions(buckets=cfg.buckets, cuda_graphs=False),
    }
    if any(pads_differently(cfg.buckets, chosen, gamma) for gamma in cfg.gammas):
        options["chosen"] = StaticOptions(buckets=chosen, cuda_graphs=False)
    return options


def pads_differently(a: VerifyBuckets, b: VerifyBuckets, gamma: int) -> bool:
    """Whether some block of 1 .. γ + 1 tokens (a verify chain, a draft model's catch-up) runs at different widths."""
    return any(a.width(k) != b.width(k) for k in range(1, gamma + 2))


@dataclass(frozen=True)
class Cell:
    drafter: str
    gamma: int
    engine: str


def engine_cells(cfg: BucketBenchConfig, engines: Sequence[str], chosen: VerifyBuckets) -> list[Cell]:
    """Every (drafter, γ, engine) to time; ``chosen`` only at the γ where it pads otherwise than the default."""
    return [
        Cell(drafter, gamma, engine)
        for drafter in cfg.drafters
        for gamma in cfg.gammas
        for engine in engines
        if engine != "chosen" or pads_differently(cfg.buckets, chosen, gamma)
    ]


def engine_section(
    cfg: BucketBenchConfig, target: CausalLM, prompts: list[list[int]], chosen: VerifyBuckets
) -> dict[str, Any]:
    options = engine_options(cfg, chosen)
    engines = {
        (drafter, name): SpeculativeEngine(
            target,
            build_drafter_set(cfg.draft if drafter == "draft" else drafter, target, dtype=cfg.dtype),
            static=static,
        )
        for drafter in cfg.drafters
        for name, static in options.items()
    }
    for engine in engines.values():  # kernels load, the caches' slots are allocated, before anything is timed
        engine.generate(prompts[0], None, GenerationConfig(max_new_tokens=4, gamma=max(cfg.gammas), ignore_eos=True))
    cells = engine_cells(cfg, list(options), chosen)
    tallies = {cell: Tally() for cell in cells}
    outputs: dict[Cell, list[list[int]]] = {}
    unrepeatable: list[str] = []
    for run, cell in enumerate(alternating(cfg.rounds, cells)):
        config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, gamma=cell.gamma, ignore_eos=True)
        results = tallies[cell].run_requests(engines[cell.drafter, cell.engine], prompts, 0.0, config)
        ids = [r.output_ids for r in results]
        if outputs.setdefault(cell, ids) != ids:
            unrepeatable.append(f"{cell.drafter} γ{cell.gamma} {cell.engine}")
        tally = tallies[cell]
        print(f"  [{run + 1}/{cfg.rounds * len(cells)}] {cell.drafter:6s} γ{cell.gamma} {cell.engine:9s} "
              f"{tally.tokens_per_second:6.1f} tok/s (pooled)", file=sys.stderr, flush=True)  # fmt: skip
    rows = []
    for cell in cells:
        tally, stats = tallies[cell], tallies[cell].stats
        reference = outputs[Cell(cell.drafter, cell.gamma, "dynamic")]
        decode = stats.total_seconds - stats.prefill_seconds
        rows.append(
            {
                **asdict(cell),
                "new_tokens": tally.new_tokens,
                "seconds": tally.seconds,
                "tokens_per_second": tally.tokens_per_second,
                "decode_tokens_per_second": stats.new_tokens / decode if decode > 0 else None,
                "mean_accepted": stats.mean_accepted,
                "cycles": stats.cycles,
                "verify_ms_per_cycle": 1000 * stats.verify_seconds / stats.cycles if stats.cycles else None,
                "draft_ms_per_cycle": 1000 * stats.draft_seconds / stats.cycles if stats.cycles else None,
                "same_as_dynamic": exactness(target, prompts, outputs[cell], reference),
            }
        )
    return {"engines": list(options), "rows": rows, "speedups": speedups(rows), "unrepeatable": unrepeatable}


def outputs_equal(row: Mapping[str, Any]) -> bool:
    """Whether every output of an engine row equals the dynamic engine's at the same drafter and γ."""
    return bool(row["same_as_dynamic"]["exact"] == row["same_as_dynamic"]["outputs"])


def speedups(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each static engine's tokens/s (end to end, and decode only) over the dynamic engine's at the same cell."""
    by_cell = {(r["drafter"], r["gamma"], r["engine"]): r for r in rows}
    out = []
    for r in rows:
        base = by_cell[r["drafter"], r["gamma"], "dynamic"]
        if r["engine"] == "dynamic":
            continue
        decode = r["decode_tokens_per_second"], base["decode_tokens_per_second"]
        out.append(
            {
                "drafter": r["drafter"],
                "gamma": r["gamma"],
                "engine": r["engine"],
                "speedup": r["tokens_per_second"] / base["tokens_per_second"],
                "decode_speedup": decode[0] / decode[1] if decode[0] and decode[1] else None,
                "outputs_equal": outputs_equal(r),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# Report


def markdown(report: Mapping[str, Any]) -> str:
    cfg, env, verify, engine = report["config"], report["environment"], report["verify"], report["engine"]
    default, chosen = VerifyBuckets(tuple(verify["default_buckets"])), VerifyBuckets(tuple(verify["chosen_buckets"]))
    head = (
        f"`{cfg['command']}` — {cfg['dtype']}, {env['threads']} torch thread(s), {env['cpu_count']} cores, "
        f"load average {env['load_start']:.2f} at start / {env['load_end']:.2f} at end\n"
    )
    lines = [
        head,
        f"### T_verify(k): median ms of one target forward of k tokens after {verify['context_tokens']} cached "
        f"tokens ({verify['repeats']} repeats, the caches interleaved)",
        "",
        "| k | dynamic | static | bucketed (default) | bucket | static at bucket | chosen bucket |",
        "|---|---|---|---|---|---|---|",
    ]
    ms = verify["median_ms"]
    for k in verify["ks"]:
        lines.append(
            f"| {k} | {table_cell(ms['dynamic'][k])} | {table_cell(ms['static'][k])} | "
            f"{table_cell(ms['bucketed'][k])} | {default.width(k)} | {table_cell(verify['predicted_bucketed_ms'][k])} "
            f"| {chosen.width(k)} |"
        )
    lines += [
        "",
        f"choose_buckets(static, tolerance={verify['tolerance']}) = **{chosen.describe()}**; "
        f"default CPU_BUCKETS = {default.describe()}"
        + (" (the same over the measured widths)" if verify["chosen_equals_default"] else ""),
        "",
    ]
    differences = verify["padding_differences"]
    if differences:
        lines += [
            "Where the two pad differently (ms of the static cache at each width):",
            "",
            "| k | default width | ms | chosen width | ms | default / chosen |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {d['k']} | {d['default_width']} | {table_cell(d['default_ms'])} | {d['chosen_width']} | "
            f"{table_cell(d['chosen_ms'])} | {table_cell(d['default_over_chosen'])} |"
            for d in differences
        ]
        lines.append("")
    lines += [
        f"### Engine: tokens/s, greedy, {cfg['num_prompts']} held-out prompt(s) × {cfg['max_new_tokens']} new "
        f"tokens, {cfg['rounds']} rounds in alternating order",
        "",
        "| drafter | γ | engine | tok/s | decode tok/s | speedup | decode speedup | verify ms/cycle | "
        "draft ms/cycle | accepted/cycle | outputs = dynamic |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {(s["drafter"], s["gamma"], s["engine"]): s for s in engine["speedups"]}
    for r in engine["rows"]:
        s = ratios.get((r["drafter"], r["gamma"], r["engine"]))
        same = r["same_as_dynamic"]
        equal = "yes" if outputs_equal(r) else f"**NO** ({same['outputs'] - same['exact']}/{same['outputs']} differ)"
        lines.append(
            f"| {r['drafter']} | {r['gamma']} | {r['engine']} | {table_cell(r['tokens_per_second'], 1)} | "
            f"{table_cell(r['decode_tokens_per_second'], 1)} | {table_cell(s and s['speedup'])} | "
            f"{table_cell(s and s['decode_speedup'])} | {table_cell(r['verify_ms_per_cycle'])} | "
            f"{table_cell(r['draft_ms_per_cycle'])} | {table_cell(r['mean_accepted'])} | {equal} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verify, engine = report["verify"], report["engine"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    for name in CACHES:
        by_k = verify["median_ms"][name]
        left.plot(verify["ks"], [by_k[k] for k in verify["ks"]], marker=".", label=name)
    for width in verify["chosen_buckets"]:
        left.axvline(width, color="grey", lw=0.5, ls=":")
    left.set_xlabel("k (tokens in one forward); dotted: the chosen buckets")
    left.set_ylabel("median ms")
    threads = report["environment"]["threads"]
    left.set_title(f"T_verify(k) after {verify['context_tokens']} cached tokens, {threads} thread(s)")
    left.legend()
    for drafter in report["config"]["drafters"]:
        for name in engine["engines"][1:]:
            points = [s for s in engine["speedups"] if s["drafter"] == drafter and s["engine"] == name]
            if points:
                right.plot([s["gamma"] for s in points], [s["speedup"] for s in points], marker="o",
                           label=f"{drafter}: {name} / dynamic")  # fmt: skip
    right.axhline(1.0, color="black", lw=0.8)
    right.set_xlabel("γ")
    right.set_ylabel("tokens/s over the growing-cache engine")
    right.set_title("engine speedup per γ (greedy)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def environment(threads: int) -> dict[str, Any]:
    return {
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_start": os.getloadavg()[0],
    }


def summary_line(report: Mapping[str, Any], json_path: Path) -> dict[str, Any]:
    """The last line of stdout: the files, both bucket sets, speedups per drafter and γ, whether outputs matched."""
    engine = report["engine"]
    return {
        STEM: str(json_path),
        "threads": report["environment"]["threads"],
        "default_buckets": report["verify"]["default_buckets"],
        "chosen_buckets": report["verify"]["chosen_buckets"],
        "speedup": {f"{s['drafter']}/{s['engine']}/γ{s['gamma']}": round(s["speedup"], 3) for s in engine["speedups"]},
        "outputs_match": report["outputs_match"],
        "elapsed_seconds": report["elapsed_seconds"],
    }


# ---------------------------------------------------------------------------------------------
# Command line


def parse_ks(text: str, flag: str) -> tuple[int, ...]:
    """``"1-32,48,64"``: widths and inclusive ranges, sorted, each counted once."""
    ks: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            low, _, high = part.partition("-")
            ks.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise UserError(f"{flag} takes widths and ranges like 1-32,48,64, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise UserError(f"{flag} needs widths >= 1, got {text!r}")
    return tuple(sorted(ks))


def config_from_args(argv: Sequence[str]) -> BucketBenchConfig:
    parser = argparse.ArgumentParser(prog="bench/buckets.py", description=__doc__.splitlines()[0] if __doc__ else None)
    full = BucketBenchConfig()
    parser.add_argument("--target", default=full.target)
    parser.add_argument("--draft", default=full.draft)
    parser.add_argument("--dtype", default=full.dtype)
    parser.add_argument("--threads", type=int, default=full.threads, help="torch threads (default %(default)s)")
    parser.add_argument("--context", type=int, default=full.context_tokens, help="cached tokens before each block")
    parser.add_argument("--ks", default="1-32,40,48,56,64", help="widths to time (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=full.repeats, help="timed visits of every k and cache")
    parser.add_argument("--tolerance", type=float, default=full.tolerance, help="choose_buckets' tolerance")
    parser.add_argument("--buckets", default=full.buckets.describe(), help="the default buckets to test")
    parser.add_argument("--drafters", default=",".join(full.drafters), help="draft (the --draft model), ngram")
    parser.add_argument("--gammas", default="1-8")
    parser.add_argument("--num-prompts", type=int, default=full.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=full.max_new_tokens)
    parser.add_argument("--rounds", type=int, default=full.rounds)
    parser.add_argument("--out", type=Path, default=full.out_dir, help="where buckets.json/.md/.png go")
    QUICK.add_argument(parser)
    args = parser.parse_args(list(argv))
    QUICK.apply(args)
    drafters = tuple(d.strip() for d in args.drafters.split(",") if d.strip())
    if not drafters or set(drafters) - set(DRAFTERS):
        raise UserError(f"--drafters takes some of {', '.join(DRAFTERS)}, got {args.drafters!r}")
    gammas = parse_ks(args.gammas, "--gammas")
    if max(gammas) > MAX_GAMMA:
        raise UserError(f"--gammas go up to {MAX_GAMMA}, got {args.gammas!r}")
    if min(args.threads, args.repeats, args.num_prompts, args.max_new_tokens, args.rounds, args.context) < 1:
        raise UserError("--threads, --repeats, --num-prompts, --max-new-tokens, --rounds and --context must be >= 1")
    return BucketBenchConfig(
        target=args.target, draft=args.draft, dtype=args.dtype, threads=args.threads, context_tokens=args.context,
        ks=parse_ks(args.ks, "--ks"), repeats=args.repeats, tolerance=args.tolerance,
        buckets=VerifyBuckets.parse(args.buckets), drafters=drafters, gammas=gammas, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, rounds=args.rounds, out_dir=args.out,
        command=" ".join(["python bench/buckets.py", *argv]),
    )  # fmt: skip


def prompt_ids(target: CausalLM, count: int, limit: int) -> list[list[int]]:
    """The first ``count`` held-out prompts as token ids, each cut to its last ``limit`` tokens."""
    if target.tokenizer is None:
        raise UserError("the target has no tokenizer: the benchmark's prompts are text")
    return [list(target.tokenizer(t, add_special_tokens=False)["input_ids"])[-limit:] for t in heldout_prompts(count)]


def run(cfg: BucketBenchConfig) -> dict[str, Any]:
    start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    report: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "environment": environment(torch.get_num_threads()),
    }
    report["config"]["buckets"] = list(cfg.buckets.widths)
    target = CausalLM.load(cfg.target, dtype=cfg.dtype)
    positions = target.info.max_positions
    context = min(cfg.context_tokens, positions - max(cfg.ks))
    prefix = prompt_ids(target, 1, positions)[0][:context]
    print(f"T_verify(k) at {len(prefix)} cached tokens, {len(cfg.ks)} widths x {len(CACHES)} caches x "
          f"{cfg.repeats} repeats, {torch.get_num_threads()} thread(s)", file=sys.stderr, flush=True)  # fmt: skip
    report["verify"] = verify_section(cfg, target, prefix)
    chosen = VerifyBuckets(tuple(report["verify"]["chosen_buckets"]))
    print(f"chosen buckets {chosen.describe()} (default {cfg.buckets.describe()})", file=sys.stderr, flush=True)
    prompts = prompt_ids(target, cfg.num_prompts, positions - cfg.max_new_tokens)
    report["engine"] = engine_section(cfg, target, prompts, chosen)
    report["outputs_match"] = all(outputs_equal(r) for r in report["engine"]["rows"])
    report["environment"]["load_end"] = os.getloadavg()[0]
    report["elapsed_seconds"] = round(time.perf_counter() - start, 1)
    save_report(cfg.out_dir, STEM, report, markdown(report), lambda path: plot(report, path))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = config_from_args(sys.argv[1:] if argv is None else argv)
        report = run(cfg)
    except UserError as exc:
        print(f"bench/buckets.py: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    if not report["outputs_match"]:
        print("WARNING: some static engine's output ids differ from the growing-cache engine's (see the table)")
    if report["engine"]["unrepeatable"]:
        print(f"WARNING: outputs changed between rounds: {', '.join(report['engine']['unrepeatable'])}")
    print(json.dumps(summary_line(report, report_paths(cfg.out_dir, STEM)[0])))
    return 0
