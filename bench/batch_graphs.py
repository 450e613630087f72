"""What a captured batched step costs against the ordinary one, on this machine: T(rows, width) of both.

    python bench/batch_graphs.py [--threads 1] [--rows 1,16,32] [--widths 1,4] [--prefix 64,256] [--repeats 7]
                                 [--out bench/results/batch_graphs/run.json]

The shipped target, float32. Per cached prefix: every row holds ``prefix`` positions, and one step appends a block of
``width`` tokens to each of ``rows`` rows (:mod:`specserve.benchmarks.step_costs`): the ordinary batched forward (row
by row on a CPU) against the captured step of :mod:`specserve.core.static.batch_graphs` run eagerly (no CUDA graphs on a
CPU: each layer gathers every row's span padded to the span bucket and attends in one SDPA call). What a graph saves
(launches) a CPU cannot show; this measures what the fixed shapes cost here. Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specserve import defaults
from specserve.benchmarks.step_costs import step_costs
from specserve.core.model.causal_lm import CausalLM


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=integers, default=[1, 16, 32])
    parser.add_argument("--widths", type=integers, default=[1, 4])
    parser.add_argument("--prefix", type=integers, default=[64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch_graphs/run.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = CausalLM.load(str(defaults.DEFAULT_TARGET), dtype="float32", device="cpu")
    report = {"command": " ".join(["python", *sys.argv]), "threads": args.threads, "by_prefix": {}}
    print(f"threads {args.threads}; ms per step, median of {args.repeats}\n")
    print("| prefix | width | rows | ordinary ms | captured (eager) ms | captured / ordinary |")
    print("|---|---|---|---|---|---|")
    for prefix in args.prefix:
        costs = step_costs(target, args.rows, args.widths, prefix=prefix, repeats=args.repeats)
        report["by_prefix"][str(prefix)] = costs
        for width in map(str, args.widths):
            for rows in map(str, args.rows):
                ordinary, captured = costs["ms"]["ordinary"][width][rows], costs["ms"]["captured"][width][rows]
                print(f"| {prefix} | {width} | {rows} | {ordinary:.2f} | {captured:.2f} | {captured / ordinary:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
