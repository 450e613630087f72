"""Capacity planning: co-located, per-replica and pooled drafting at 1 to 1,000 replicas, and the pool ratio to pick.

    python bench/capacity_plan.py measure [--threads 1] [--out bench/scenarios/cpu_measured.json]
    python bench/capacity_plan.py plan SCENARIO.json [--large-price P] [--cheap-price P] [--misaligned]
                                       [--out bench/results/capacity/NAME]

``measure`` writes a scenario (:func:`specserve.policies.capacity.load_scenario`'s JSON) from this machine: the shipped
pair's acceptance by draft position (16 held-out prompts × 128 tokens, greedy, the draft model at γ 8, one request at a
time), one draft-model forward by rows (1 to 64, one token each) and one target forward by width and rows
(:mod:`specserve.benchmarks.step_costs`, the ordinary batched forward), float32, ``--threads`` torch threads. Here
the "large" and the "cheap" device are the same CPU; the hop is the distributed runtime's measured wire time per cycle
(BENCHMARKS.md, "the distributed runtime": 1.6 ms co-located over gRPC on loopback), and the prices are inputs.

``plan`` reads a scenario and writes ``plan.json``, ``plan.md`` (the table, the recommendation, the scenario's notes
and the command) and ``plan.png`` (tokens per dollar and tokens/s by pool ratio, against co-located, per-replica and
plain decoding, at every replica count) under ``--out``. Decides nothing for a deployment: it says what the model and
the figures given imply.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specserve.policies.capacity import DEFAULT_RATIOS, DEFAULT_REPLICAS, Plan, load_scenario, plan, recommend

HOP_MS = 1.6  # the distributed runtime's wire time per cycle, co-located TP 1 (BENCHMARKS.md)


def measure(threads: int, out: Path) -> None:
    import torch

    from specserve import defaults
    from specserve.benchmarks.step_costs import step_costs
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.model.causal_lm import CausalLM
    from specserve.core.request import GenerationConfig
    from specserve.core.stats import RequestStats
    from specserve.drafters.registry import build_drafter_set
    from specserve.training.corpus import heldout_prompts

    torch.set_num_threads(threads)
    target = CausalLM.load(str(defaults.DEFAULT_TARGET), dtype="float32", device="cpu")
    draft = CausalLM.load(str(defaults.DEFAULT_DRAFT), dtype="float32", device="cpu")
    assert target.tokenizer is not None
    prompts = [list(target.tokenizer(t, add_special_tokens=False)["input_ids"])[-200:] for t in heldout_prompts(16)]
    stats = RequestStats()
    engine = SpeculativeEngine(target, build_drafter_set(str(defaults.DEFAULT_DRAFT), target))
    for prompt in prompts:
        result = engine.generate(prompt, None, GenerationConfig(max_new_tokens=128, gamma=8, ignore_eos=True))
        stats.merge(result.stats)
    alpha = [round(a, 4) for a in stats.acceptance_by_position if a is not None]
    print(f"acceptance by position: {alpha} (cycles reaching each: {stats.reached})", file=sys.stderr)
    drafting = step_costs(draft, [1, 2, 4, 8, 16, 32, 64], widths=(1,), prefix=128, modes=("ordinary",))
    verifying = step_costs(target, [1, 4, 16], widths=(1, 3, 5, 9), prefix=128, modes=("ordinary",))
    draft_ms = [[int(b), ms] for b, ms in drafting["ms"]["ordinary"]["1"].items()]
    verify_ms = [
        [int(k), int(b), ms] for k, by_rows in verifying["ms"]["ordinary"].items() for b, ms in by_rows.items()
    ]
    scenario = {
        "notes": (
            f"Measured on this machine ({threads} torch thread(s), float32, 2-core CPU): the shipped pair's acceptance "
            "by position (16 held-out prompts x 128 tokens, greedy, gamma 8), one draft-model forward by rows and one "
            "target forward by width and rows after 128 cached positions (bench/capacity_plan.py measure). The large "
            "and the cheap device are the same CPU here; the hop is the distributed runtime's measured wire time per "
            "cycle; the prices are illustrative inputs."
        ),
        "alpha": alpha,
        "alpha_cycles_reaching": list(stats.reached),
        "verify_ms": verify_ms,
        "draft_large_ms": draft_ms,
        "draft_cheap_ms": draft_ms,
        "hop_ms": HOP_MS,
        "batch": 16,
        "tp": 1,
        "large": {"name": "CPU (target)", "price_per_hour": 0.10},
        "cheap": {"name": "CPU (drafter)", "price_per_hour": 0.10},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scenario, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def markdown(name: str, data: dict[str, Any], plans: list[Plan], command: str, misaligned: bool) -> str:
    s = load_scenario(data)
    lines = [
        f"# Capacity plan: {name}",
        "",
        f"`{command}`",
        "",
        f"{s.large_name}: {s.tp} per replica at ${s.large_price:g}/h; {s.cheap_name} at ${s.cheap_price:g}/h; "
        f"{s.batch} requests per replica; hop {1000 * s.hop_seconds:g} ms per cycle; drafting rounds "
        f"{'misaligned (a second round charged)' if misaligned else 'aligned on each pool member'}.",
        "",
        f"Notes: {s.notes}",
        "",
        "| replicas | placement | ratio | γ | cycle ms | tokens/s | large | cheap | $/h | tokens per $ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        r = p.row()
        lines.append(
            f"| {r['replicas']} | {r['placement']} | {r['ratio'] or '-'} | {r['gamma']} | {r['cycle_ms']:.2f} | "
            f"{r['tokens_per_second']:,.0f} | {r['large_devices']} | {r['cheap_devices']} | "
            f"{r['dollars_per_hour']:,.2f} | {r['tokens_per_dollar']:,.0f} |"
        )
    lines += ["", "| replicas | recommended | best pool ratio | its tokens per $ against the recommendation |",
              "|---|---|---|---|"]  # fmt: skip
    for n in sorted({p.replicas for p in plans}):
        best = recommend(plans, n)
        pools = [p for p in plans if p.replicas == n and p.placement == "pool"]
        pool = max(pools, key=lambda p: (p.tokens_per_dollar, p.tokens_per_second))
        chosen = best.placement + (f" (ratio {best.ratio})" if best.ratio else "") + f", γ {best.gamma}"
        share = pool.tokens_per_dollar / best.tokens_per_dollar
        lines.append(f"| {n} | {chosen} | {pool.ratio} (γ {pool.gamma}) | {share:.2f} |")
    return "\n".join(lines) + "\n"


def draw(plans: list[Plan], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    counts = sorted({p.replicas for p in plans})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = (
        (axes[0], "tokens per $", lambda p: p.tokens_per_dollar),
        (axes[1], "tokens/s per replica", lambda p: p.tokens_per_second / p.replicas),
    )
    for ax, label, value in panels:
        for n in counts:
            pools = sorted((p for p in plans if p.replicas == n and p.placement == "pool"), key=lambda p: p.ratio or 0)
            if pools:
                ax.plot([p.ratio for p in pools], [value(p) for p in pools], marker="o", label=f"pool, N={n}")
        largest = counts[-1]
        for placement, style in (("colocated", "--"), ("replica", ":"), ("plain", "-.")):
            found = [p for p in plans if p.replicas == largest and p.placement == placement]
            if found:
                ax.axhline(value(found[0]), ls=style, color="black", lw=0.8, label=f"{placement}, N={largest}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas per pool member")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plan_command(args: argparse.Namespace) -> None:
    data = json.loads(args.scenario.read_text())
    if args.large_price is not None:
        data["large"]["price_per_hour"] = args.large_price
    if args.cheap_price is not None:
        data["cheap"]["price_per_hour"] = args.cheap_price
    scenario = load_scenario(data)
    plans = plan(scenario, DEFAULT_REPLICAS, DEFAULT_RATIOS, misaligned=args.misaligned)
    out: Path = args.out or Path("bench/results/capacity") / args.scenario.stem
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", *sys.argv])
    (out / "plan.json").write_text(json.dumps({"command": command, "scenario": data,
                                               "plans": [p.row() for p in plans]}, indent=1) + "\n")  # fmt: skip
    text = markdown(args.scenario.stem, data, plans, command, args.misaligned)
    (out / "plan.md").write_text(text)
    draw(plans, out / "plan.png")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measured = commands.add_parser("measure", help="write a scenario measured on this machine")
    measured.add_argument("--threads", type=int, default=1)
    measured.add_argument("--out", type=Path, default=Path("bench/scenarios/cpu_measured.json"))
    planned = commands.add_parser("plan", help="plan from a scenario file")
    planned.add_argument("scenario", type=Path)
    planned.add_argument("--large-price", type=float, default=None, help="dollars per large device-hour")
    planned.add_argument("--cheap-price", type=float, default=None, help="dollars per cheap device-hour")
    planned.add_argument("--misaligned", action="store_true", help="charge each pooled cycle a second drafting round")
    planned.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "measure":
        measure(args.threads, args.out)
    else:
        plan_command(args)


if __name__ == "__main__":
    main()
