"""``specserve bench-serve``: the HTTP load benchmarks, chosen by ``--workload``.

``independent`` (the default) is :mod:`specserve.benchmarks.serve_load`: independent requests by concurrency, with
speculation off and on. ``conversations``, ``system-prompt``, ``agent`` (or ``prefix``, all three) are
:mod:`specserve.benchmarks.prefix_load`: traffic that resends its history, with the prefix cache off and on. This
module only parses and dispatches.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve import defaults
from specserve.benchmarks import prefix_load, serve_load
from specserve.benchmarks.arguments import print_results, stdout_to_stderr
from specserve.benchmarks.tally import report_paths
from specserve.core.errors import UserError

PREFIX_ROUNDS, PREFIX_MAX_TOKENS = 2, 48  # the prefix workloads' defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_load.add_arguments(parser)
    parser.add_argument(
        "--workload",
        choices=("independent", *prefix_load.WORKLOADS, "prefix"),
        default="independent",
        help="independent requests by --concurrency (speculation off vs on), or traffic that resends its history "
        "with the prefix cache off vs on: chats of 4 turns, 32 requests sharing a 600-token system prompt, agent "
        f"loops (prefix: all three; rounds default to {PREFIX_ROUNDS}, max tokens to {PREFIX_MAX_TOKENS})",
    )
    parser.add_argument(
        "--eagle",
        default=str(defaults.MODELS_DIR / "eagle"),
        help="prefix workloads: the EAGLE head of the EAGLE deployment ('' = none)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="prefix workloads: the share of sessions to run")


def run_command(args: argparse.Namespace) -> int:
    if args.workload == "independent":
        return serve_load.run_command(args)
    if args.scale <= 0:
        raise UserError("--scale must be positive")
    cfg = prefix_load.PrefixLoadConfig(
        target=args.target,
        draft=args.draft,
        eagle=args.eagle,
        workloads=prefix_load.WORKLOADS if args.workload == "prefix" else (args.workload,),
        gamma=args.gamma,
        max_tokens=PREFIX_MAX_TOKENS if args.max_tokens is None else args.max_tokens,
        rounds=PREFIX_ROUNDS if args.rounds is None else args.rounds,
        scale=args.scale,
        port=args.port,
        threads_per_shard=args.threads_per_shard,
        out_dir=Path(args.out),
    )
    with stdout_to_stderr():
        report = prefix_load.run(cfg)
    print_results(args, report, prefix_load.markdown(report), report_paths(cfg.out_dir, "prefix_load"))
    return 0
