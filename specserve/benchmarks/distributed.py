"""`specserve bench-distributed`: the in-process engine against the distributed runtime, greedy.

Same prompts and models as ``specserve bench`` (held-out standard-library files, the shipped
pair). Methods, each over every prompt with the same ``max_new_tokens`` and γ:

* ``in-process`` — :class:`~specserve.core.engine.SpeculativeEngine` in this process;
* ``colocated/tpN`` — a replica of N shard actors with the drafter actor in its placement group,
  drafts over gRPC, no overlap;
* ``separate+overlap/tpN`` — the drafter on the "cheap" resource, drafting the next tree while
  the target verifies.

Per method: tokens/s end to end and for the decode loop alone, the mean accepted length, and
the per-cycle time split measured inside the runtime: drafting on the critical path, the
target's verify (of which all-reduce), the gRPC wire (send-to-verdict time the target did not
spend), and the rest ("other": Ray streaming to the coordinator, Python bookkeeping), which is
the cycle time minus the others. Outputs are checked token for token against the in-process
engine, so a speed number never hides a wrong answer.

Results: ``distributed.json``, ``distributed.md`` and ``distributed.png`` (the per-cycle time
split as stacked bars) under ``--out`` (default ``runs/bench-distributed/``). stdout carries the table
and a ``results:`` line, or with ``--json`` the report alone (:mod:`specserve.benchmarks.arguments`);
each method's row is printed to stderr as it finishes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.benchmarks.arguments import (
    RUNS_DIR,
    add_max_new_tokens_argument,
    add_output_arguments,
    check_max_new_tokens,
    number_list,
    options,
    print_results,
    stdout_to_stderr,
)
from specserve.benchmarks.prompts import heldout_prompts
from specserve.benchmarks.tally import report_paths, save_report
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.engine import GenerationFrontend, SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats
from specserve.drafters import build_drafter


@dataclass(frozen=True)
class DistributedBenchConfig:
    target: str
    draft: str
    num_prompts: int = 20
    max_new_tokens: int = 128
    gamma: int = 4
    tp_degrees: tuple[int, ...] = (1, 2)
    threads: int = 2  # torch threads of the in-process engine and of a TP-1 shard
    out_dir: Path = RUNS_DIR / "bench-distributed"
    prompts: tuple[str, ...] | None = None  # default: the held-out standard-library prompts of `specserve bench`


@dataclass(frozen=True)
class Method:
    name: str
    tp: int = 0  # 0 = in process
    placement: str = "colocated"
    overlap: bool = False


def methods(cfg: DistributedBenchConfig) -> list[Method]:
    out = [Method("in-process")]
    for tp in cfg.tp_degrees:
        out.append(Method(f"colocated/tp{tp}", tp, "colocated", False))
        out.append(Method(f"separate+overlap/tp{tp}", tp, "separate", True))
    return out


def generate_all(
    runner: GenerationFrontend, prompts: list[list[int]], cfg: DistributedBenchConfig, label: str
) -> dict[str, Any]:
    config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, gamma=cfg.gamma)
    runner.generate(prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=16, gamma=cfg.gamma))  # warm-up
    stats = RequestStats()
    outputs: list[list[int]] = []
    seconds = 0.0
    for ids in tqdm(prompts, desc=label, leave=False, file=sys.stderr):
        start = time.perf_counter()
        result: GenerationResult = runner.generate(ids, SamplingParams(), config)
        seconds += time.perf_counter() - start
        stats.merge(result.stats)
        outputs.append(result.output_ids)
    return {"stats": stats, "seconds": seconds, "outputs": outputs}


def summarise_run(method: Method, run: dict[str, Any], reference: list[list[int]] | None) -> dict[str, Any]:
    stats: RequestStats = run["stats"]
    decode = stats.total_seconds - stats.prefill_seconds
    cycles = max(stats.cycles, 1)
    per_cycle = {
        "cycle_ms": 1e3 * decode / cycles,
        "draft_ms": 1e3 * stats.draft_seconds / cycles,
        "verify_ms": 1e3 * stats.verify_seconds / cycles,
        "allreduce_ms": 1e3 * stats.allreduce_seconds / cycles,
        "wire_ms": 1e3 * stats.wire_seconds / cycles,
    }
    per_cycle["other_ms"] = per_cycle["cycle_ms"] - per_cycle["draft_ms"] - per_cycle["verify_ms"]
    per_cycle["other_ms"] -= per_cycle["wire_ms"]
    return {
        "method": method.name,
        "tp": method.tp,
        "overlap": method.overlap,
        "tokens": stats.new_tokens,
        "tokens_per_second": stats.new_tokens / run["seconds"],
        "decode_tokens_per_second": stats.new_tokens / decode if decode > 0 else None,
        "mean_accepted": stats.mean_accepted,
        "cycles": stats.cycles,
        "overlap_hit_rate": stats.overlap_hits / cycles if method.overlap else None,
        "all_accepted_rate": stats.accepted_length_histogram[stats.draft_length_histogram.most_common(1)[0][0] + 1]
        / cycles,
        "identical_to_in_process": None if reference is None else run["outputs"] == reference,
        **per_cycle,
    }


def run(cfg: DistributedBenchConfig) -> dict[str, Any]:
    from specserve.actors import Coordinator
    from specserve.cluster.connect import connect_ray

    torch.set_num_threads(cfg.threads)
    target = CausalLM.load(cfg.target)
    engine = SpeculativeEngine(target, build_drafter(cfg.draft, target))
    texts = list(cfg.prompts) if cfg.prompts is not None else heldout_prompts(cfg.num_prompts)
    prompts = [engine.encode(p) for p in texts]
    # The in-process reference runs before Ray starts: Ray's start-up work would otherwise share its CPU.
    in_process = generate_all(engine, prompts, cfg, "in-process")
    reference: list[list[int]] = in_process["outputs"]
    rows = [summarise_run(Method("in-process"), in_process, None)]
    with connect_ray(tp_degree=max(cfg.tp_degrees)) as where:
        for method in methods(cfg)[1:]:
            config = ReplicaConfig(
                target=cfg.target,
                draft=cfg.draft,
                tp_degree=method.tp,
                drafter_placement=method.placement,
                overlap=method.overlap,
                # With overlap the drafter computes while the target verifies: it takes one core of its own.
                threads_per_shard=cfg.threads if method.tp == 1 and not method.overlap else 1,
                threads_per_drafter=1,
            )
            coordinator = Coordinator.spawn(config)
            try:
                rows.append(summarise_run(method, generate_all(coordinator, prompts, cfg, method.name), reference))
            finally:
                coordinator.shutdown()
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["vs_in_process"] = row["tokens_per_second"] / base
    report = {"config": {k: str(v) for k, v in cfg.__dict__.items()}, "ray": where, "rows": rows}
    save_report(cfg.out_dir, "distributed", report, markdown(rows), lambda path: plot(rows, path))
    return report


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | tok/s | × in-process | decode tok/s | mean acc. len | overlap hits | cycle ms | draft ms | "
        "verify ms | (all-reduce ms) | wire ms | other ms | same tokens |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        hit = "–" if r["overlap_hit_rate"] is None else f"{r['overlap_hit_rate']:.2f}"
        same = "ref." if r["identical_to_in_process"] is None else ("yes" if r["identical_to_in_process"] else "NO")
        lines.append(
            f"| {r['method']} | {r['tokens_per_second']:.1f} | {r['vs_in_process']:.2f} | "
            f"{r['decode_tokens_per_second']:.1f} | {r['mean_accepted']:.2f} | {hit} | {r['cycle_ms']:.1f} | "
            f"{r['draft_ms']:.1f} | {r['verify_ms']:.1f} | {r['allreduce_ms']:.1f} | {r['wire_ms']:.2f} | "
            f"{r['other_ms']:.1f} | {same} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per-cycle time split per method (stacked bars), tokens/s on top of each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [
        ("draft_ms", "draft"),
        ("compute_ms", "verify (compute)"),
        ("allreduce_ms", "verify (all-reduce)"),
        ("wire_ms", "gRPC wire"),
        ("other_ms", "other (Ray, Python)"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["method"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in parts:
        values = [(r["verify_ms"] - r["allreduce_ms"]) if key == "compute_ms" else max(0.0, r[key]) for r in rows]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(rows):
        ax.annotate(f"{r['tokens_per_second']:.0f} tok/s", (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per cycle (greedy, same cycles in every method)")
    ax.set_title("in-process engine vs distributed runtime: where a cycle's time goes")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `specserve bench-distributed`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ReplicaConfig.add_arguments(parser, ["target", "draft"])
    parser.add_argument("--num-prompts", type=int, default=20)
    add_max_new_tokens_argument(parser)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--tp", default="1,2", help="comma-separated TP degrees")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in process and per TP-1 shard")
    add_output_arguments(parser, "bench-distributed", "distributed.json/.md/.png")


def config_from_args(args: argparse.Namespace) -> DistributedBenchConfig:
    """The configuration the flags describe; raises :class:`UserError` for a bad value."""
    check_max_new_tokens(args)
    return DistributedBenchConfig(
        **options(args, "target", "draft", "num_prompts", "max_new_tokens", "gamma", "threads"),
        tp_degrees=tuple(number_list(args.tp, int, "--tp")),
        out_dir=Path(args.out),
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report["rows"]), report_paths(cfg.out_dir, "distributed"))
    return 0
