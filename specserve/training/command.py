"""``specserve train``: the default model pair, a drafter head (EAGLE, Medusa, exit head) for a frozen target, or a
PARD draft model adapted from a draft model.

Arguments and the entry point only: :mod:`specserve.training.pipeline` trains the pair,
:mod:`~specserve.training.eagle`, :mod:`~specserve.training.medusa` and
:mod:`~specserve.training.exit_head` the heads, :mod:`~specserve.training.pard` the PARD draft (each imported when
chosen). Options left out keep
each recipe's own defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specserve import defaults
from specserve.core.draft.spec_strings import EAGLE_PREFIX, LAYERSKIP_PREFIX, MEDUSA_PREFIX, PARD_PREFIX
from specserve.core.errors import UserError

TRAINABLE = ("pair", "eagle", "medusa", "exit-head", "pard")
# how --draft loads each
DRAFT_PREFIX = {"eagle": EAGLE_PREFIX, "medusa": MEDUSA_PREFIX, "exit-head": LAYERSKIP_PREFIX, "pard": PARD_PREFIX}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "`train` / `train pair`: the default target and draft model on the Python standard library. "
        "`train eagle|medusa|exit-head --target DIR`: a drafter head for a frozen target, on the default corpus or "
        "--data FOLDER; `train pard`: the shipped draft model (or --init-from DIR) adapted to draft a block per "
        "forward; checkpoints under OUT/checkpoints (a rerun resumes), a held-out acceptance report, "
        "a model card; load the result with --draft eagle:OUT, medusa:OUT, layerskip:OUT or pard:OUT."
    )
    parser.add_argument("what", nargs="?", choices=TRAINABLE, default="pair", help="what to train (default: pair)")
    parser.add_argument("--out", help="output directory (default: models/ for the pair, models/<what>/ for a head)")
    parser.add_argument("--seed", type=int, default=0)
    pair = parser.add_argument_group("the default pair")
    pair.add_argument("--target-steps", type=int, default=1000)
    pair.add_argument("--draft-steps", type=int, default=400)
    head = parser.add_argument_group("drafter heads (defaults sized for the default target on 2 CPU cores)")
    head.add_argument("--target", default=str(defaults.DEFAULT_TARGET), help="the frozen target's directory")
    head.add_argument("--data", help="a folder of text/code to train on (default: the standard library corpus)")
    head.add_argument("--steps", type=int, help="optimizer steps")
    head.add_argument("--batch-size", type=int)
    head.add_argument("--seq-len", type=int)
    head.add_argument("--max-tokens", type=int, help="cap on the training stream's tokens")
    head.add_argument(
        "--layout",
        choices=("specserve", "eagle3"),
        help="eagle: specserve's own head (default), or the published EAGLE-3 architecture, saved in SafeAILab's "
        "layout with a speculators-format copy under OUT/speculators (SGLang and vLLM load either)",
    )
    head.add_argument("--draft-vocab", type=int, help="eagle3: draft vocabulary size (the most frequent tokens)")
    head.add_argument("--speculative-tokens", type=int, help="eagle3: the γ the speculators copy suggests")
    head.add_argument("--feature-layers", help="eagle: comma-separated target layers to fuse (default: low,mid,top)")
    head.add_argument("--unroll", type=int, help="eagle: training-time-test steps on the head's own outputs")
    head.add_argument(
        "--init-from",
        help="eagle: continue from this trained head (a fresh schedule over its weights); pard: the draft model to "
        "adapt (default: the shipped one)",
    )
    head.add_argument("--block-size", type=int, help="pard: drafts per forward the model learns (default 4)")
    head.add_argument("--heads", type=int, help="medusa: number of heads (tokens t+2 .. t+1+heads)")
    head.add_argument("--layers", type=int, help="exit-head: the exit layer L")


def run_command(args: argparse.Namespace) -> int:
    if args.what == "pair":
        return _train_pair(args)
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "max_tokens",
        "unroll",
        "heads",
        "layers",
        "draft_vocab",
        "speculative_tokens",
        "block_size",
    ):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "unroll" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be >= {0 if name == 'unroll' else 1}, got {value}")
    if not Path(args.target, "config.json").is_file():
        raise UserError(f"--target {args.target} is not a model directory (no config.json)")
    out = Path(args.out or Path(defaults.MODELS_DIR) / args.what)
    common = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed}
    common["max_tokens"] = args.max_tokens
    if args.what == "eagle":
        from specserve.training.eagle import EagleRecipe, train_eagle

        options = {
            **common,
            "unroll": args.unroll,
            "layout": args.layout,
            "draft_vocab": args.draft_vocab,
            "speculative_tokens": args.speculative_tokens,
        }
        if args.feature_layers:
            try:
                options["feature_layers"] = tuple(int(x) for x in args.feature_layers.split(","))
            except ValueError as exc:
                raise UserError(
                    f"--feature-layers must be comma-separated integers, got {args.feature_layers!r}"
                ) from exc
        recipe = dataclasses.replace(EagleRecipe(), **{k: v for k, v in options.items() if v is not None})
        summary = train_eagle(args.target, out, recipe, data_folder=args.data, init_from=args.init_from)
    elif args.what == "pard":
        from specserve.training.pard import PardRecipe, train_pard

        options = {**common, "block_size": args.block_size}
        pard = dataclasses.replace(PardRecipe(), **{k: v for k, v in options.items() if v is not None})
        summary = train_pard(args.target, out, pard, draft_dir=args.init_from, data_folder=args.data)
    elif args.what == "medusa":
        from specserve.training.medusa import train_medusa

        options = {**common, "heads": args.heads}
        summary = train_medusa(
            args.target, out, data_folder=args.data, **{k: v for k, v in options.items() if v is not None}
        )
    else:
        from specserve.training.exit_head import train_exit_head

        options = {**common, "layers": args.layers}
        summary = train_exit_head(
            args.target, out, data_folder=args.data, **{k: v for k, v in options.items() if v is not None}
        )
    acceptance = summary.get("heldout_acceptance", summary.get("acceptance"))
    print(json.dumps({"out": str(out), "heldout_acceptance": acceptance}, indent=2))
    print(
        f"trained {args.what} for {args.target}: load it with --draft {DRAFT_PREFIX[args.what]}{out}", file=sys.stderr
    )
    return 0


def _train_pair(args: argparse.Namespace) -> int:
    from specserve.training import pipeline

    if args.target_steps < 1 or args.draft_steps < 1:
        raise UserError("--target-steps and --draft-steps must be >= 1")
    out = Path(args.out or defaults.MODELS_DIR)
    pipeline.run(
        pipeline.RecipeConfig(out_dir=out, target_steps=args.target_steps, draft_steps=args.draft_steps, seed=args.seed)
    )
    return 0
