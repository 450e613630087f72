"""Never slower than plain decoding? Every shipped drafter under plain decoding, fixed γ and the adaptive policy.

    python bench/never_slower.py [--drafters draft,eagle,medusa,layerskip,ngram,suffix] [--workloads code-t0,code-t1.5]
                                 [--policies none,fixed:1,fixed:2,fixed:3,fixed:4,adaptive] [--num-prompts 4]
                                 [--max-new-tokens 96] [--rounds 2] [--out DIR] [--from-reports]
                                 [--batch-from DIR]

One request at a time in this process, 1 torch thread, the shipped pair in float32: for each drafter,
``specserve experiment`` (:mod:`specserve.benchmarks.experiment`) over the workloads (``code-t0``: held-out code,
greedy; ``code-t1.5``: the same prompts at T = 1.5, high entropy, where drafting cannot pay) and the policies, every
cell on each prompt back to back, the order alternating from prompt to prompt. ``adaptive`` is the policy as served:
under its drafter's measured ceiling (:mod:`specserve.policies.ceiling`). Per drafter × workload: tokens/s of plain
decoding, of fixed γ 3 (the former default), of the best fixed γ in hindsight and of the adaptive policy; adaptive
over plain and over the best fixed γ (the issue's targets: ≥ 0.97 both), its mean γ and its share of plain cycles
(its own choice or its ceiling's).
Writes ``never_slower.json`` and ``never_slower.md`` under ``--out`` and each drafter's experiment report beside them;
``--from-reports`` runs nothing and rebuilds the table from the drafters' reports already there (after some drafters
were re-measured on their own). ``--batch-from DIR`` also tabulates the batched runs of ``bench/never_slower_grid.sh``
(``specserve bench-batch`` reports named ``DRAFTER-WORKLOAD.json``: plain, fixed γ and adaptive at 8 and 16 requests)
into ``never_slower_batch.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from specserve import defaults
from specserve.benchmarks.experiment import ExperimentConfig, run
from specserve.benchmarks.tables import table_cell, write_report

DRAFTERS = {  # name -> the --draft spec of the shipped drafter
    "draft": str(defaults.DEFAULT_DRAFT),
    "eagle": f"eagle:{defaults.MODELS_DIR / 'eagle'}",
    "medusa": f"medusa:{defaults.MODELS_DIR / 'medusa'}",
    "layerskip": f"layerskip:{defaults.MODELS_DIR / 'exit-head'}",
    "ngram": "ngram",
    "suffix": "suffix",
}
TARGET_RATIO = 0.97


def summary_rows(drafter: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload of one drafter's experiment report."""
    rows = []
    for workload, entry in report["workloads"].items():
        cells = {r["policy"]: r for r in report["rows"] if r["workload"] == workload}
        plain = cells.get("none", {}).get("tokens_per_second")
        adaptive = cells.get("adaptive", {})
        best = entry.get("best_fixed") or {}
        rate = adaptive.get("tokens_per_second")
        rows.append(
            {
                "drafter": drafter,
                "workload": workload,
                "plain": plain,
                "fixed_3": cells.get("fixed:3", {}).get("tokens_per_second"),
                "best_fixed": best.get("policy"),
                "best_fixed_tokens_per_second": best.get("tokens_per_second"),
                "adaptive": rate,
                "adaptive_over_plain": rate / plain if rate and plain else None,
                "adaptive_over_best_fixed": rate / best["tokens_per_second"] if rate and best else None,
                "adaptive_mean_gamma": adaptive.get("mean_gamma"),
                "adaptive_plain_share": adaptive.get("plain_share"),
                "adaptive_fallbacks": adaptive.get("fallbacks"),
                "greedy_outputs_identical": entry.get("greedy_outputs_identical"),
            }
        )
    return rows


def batch_rows(drafter: str, workload: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (temperature, concurrency) of one drafter's ``specserve bench-batch`` report: plain, each fixed γ
    and the adaptive policy, batched in process."""
    rows = []
    levels = sorted({(r["temperature"], r["concurrency"]) for r in report["rows"]})
    for temperature, concurrency in levels:
        level = (temperature, concurrency)
        at = {r["mode"]: r for r in report["rows"] if (r["temperature"], r["concurrency"]) == level}
        plain = at.get("batched-plain", {}).get("throughput_tok_s")
        fixed = {m: r["throughput_tok_s"] for m, r in at.items() if m.startswith("batched-gamma-")}
        best = max(fixed, key=fixed.__getitem__) if fixed else None
        adaptive = at.get("batched-adaptive", {})
        rate = adaptive.get("throughput_tok_s")
        histogram = adaptive.get("gamma_histogram") or {}
        budgets = sum(histogram.values())
        rows.append(
            {
                "drafter": drafter,
                "workload": f"{workload}-t{temperature:g}",
                "concurrency": concurrency,
                "plain": plain,
                "fixed": {m.removeprefix("batched-gamma-"): v for m, v in fixed.items()},
                "best_fixed": best.removeprefix("batched-") if best else None,
                "best_fixed_tokens_per_second": fixed[best] if best else None,
                "adaptive": rate,
                "adaptive_over_plain": rate / plain if rate and plain else None,
                "adaptive_over_best_fixed": rate / fixed[best] if rate and best else None,
                "adaptive_mean_gamma": adaptive.get("mean_gamma"),
                "adaptive_plain_share": histogram.get("0", 0) / budgets if budgets else None,
                "exact": report.get("exact"),
            }
        )
    return rows


def batch_markdown(rows: list[dict[str, Any]]) -> list[str]:
    gammas = sorted({g for r in rows for g in r["fixed"]}, key=int)
    lines = [
        "| drafter | workload | requests | plain tok/s | "
        + " | ".join(f"γ {g}" for g in gammas)
        + " | adaptive | adaptive / plain | adaptive / best fixed | mean γ | plain rows | exact |",
        "|---|---|---|---|" + "---|" * len(gammas) + "---|---|---|---|---|---|",
    ]
    for r in rows:
        fixed = " | ".join(table_cell(r["fixed"].get(g), 1) for g in gammas)
        lines.append(
            f"| {r['drafter']} | {r['workload']} | {r['concurrency']} | {table_cell(r['plain'], 1)} | {fixed} | "
            f"{table_cell(r['adaptive'], 1)} | {table_cell(r['adaptive_over_plain'])} | "
            f"{table_cell(r['adaptive_over_best_fixed'])} | {table_cell(r['adaptive_mean_gamma'])} | "
            f"{table_cell(r['adaptive_plain_share'])} | {'yes' if r['exact'] else 'NO'} |"
        )
    return [*lines, "", _misses(rows, lambda r: f"{r['drafter']}/{r['workload']}/{r['concurrency']}")]


def _misses(rows: list[dict[str, Any]], label: Any) -> str:
    misses = [
        label(r)
        for r in rows
        if any(r[k] is not None and r[k] < TARGET_RATIO for k in ("adaptive_over_plain", "adaptive_over_best_fixed"))
    ]
    return f"Cells below {TARGET_RATIO}× plain or the best fixed γ: {', '.join(misses) or 'none'}."


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| drafter | workload | plain tok/s | fixed γ 3 | best fixed | adaptive | adaptive / plain | adaptive / best "
        "fixed | mean γ | plain cycles | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = f"{table_cell(r['best_fixed_tokens_per_second'], 1)} ({r['best_fixed']})"
        lines.append(
            f"| {r['drafter']} | {r['workload']} | {table_cell(r['plain'], 1)} | {table_cell(r['fixed_3'], 1)} | "
            f"{best} | {table_cell(r['adaptive'], 1)} | {table_cell(r['adaptive_over_plain'])} | "
            f"{table_cell(r['adaptive_over_best_fixed'])} | {table_cell(r['adaptive_mean_gamma'])} | "
            f"{table_cell(r['adaptive_plain_share'])} | {table_cell(r['adaptive_fallbacks'])} |"
        )
    return [*lines, "", _misses(rows, lambda r: f"{r['drafter']}/{r['workload']}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma-separated of {', '.join(DRAFTERS)}")
    parser.add_argument("--workloads", default="code-t0,code-t1.5")
    parser.add_argument("--policies", default="none,fixed:1,fixed:2,fixed:3,fixed:4,adaptive")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/never-slower"))
    parser.add_argument("--from-reports", action="store_true", help="rebuild the table from the reports under --out")
    parser.add_argument(
        "--batch-from",
        type=Path,
        help="also tabulate the bench-batch reports DRAFTER-WORKLOAD.json in this directory "
        "(bench/never_slower_grid.sh) into never_slower_batch.{json,md} under --out",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    unknown = sorted(set(args.drafters.split(",")) - set(DRAFTERS))
    if unknown:
        parser.error(f"unknown drafters {unknown}; choose from {', '.join(DRAFTERS)}")
    rows: list[dict[str, Any]] = []
    for name in args.drafters.split(","):
        if args.from_reports:
            report = args.out / name / "experiment.json"
            if not report.is_file():
                parser.error(f"{report} is missing: run without --from-reports first")
            rows.extend(summary_rows(name, json.loads(report.read_text())))
            continue
        print(f"==> {name}", file=sys.stderr)
        cfg = ExperimentConfig(
            target=str(defaults.DEFAULT_TARGET),
            draft=DRAFTERS[name],
            workloads=tuple(args.workloads.split(",")),
            policies=args.policies,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            rounds=args.rounds,
            out_dir=args.out / name,
        )
        rows.extend(summary_rows(name, run(cfg)))
    command = " ".join(["python", "bench/never_slower.py", *sys.argv[1:]])
    write_report(args.out, "never_slower", command, rows, markdown(rows))
    if args.batch_from is not None:
        batched: list[dict[str, Any]] = []
        for name in args.drafters.split(","):
            for path in sorted(args.batch_from.glob(f"{name}-*.json")):
                workload = path.stem.removeprefix(f"{name}-")
                batched.extend(batch_rows(name, workload, json.loads(path.read_text())))
        write_report(args.out, "never_slower_batch", command, batched, batch_markdown(batched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
