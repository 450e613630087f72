"""Command-line pieces the benchmark subcommands share: comma-separated number lists and the common flags.

Each ``specserve bench*`` / ``experiment`` subcommand keeps its own ``add_arguments`` and
``run_command`` in its module; this holds only what several of them parse the same way. Runs nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from specserve import defaults
from specserve.cluster.replica_config import MODEL_SETTINGS, ReplicaConfig
from specserve.core.errors import UserError

N = TypeVar("N", int, float)


def number_list(text: str, kind: Callable[[str], N], flag: str) -> list[N]:
    """A comma-separated list of numbers from the command line."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise UserError(f"{flag} must be comma-separated numbers: {exc}") from exc


def check_max_new_tokens(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def add_prompt_arguments(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """``--prompts FILE`` and ``--num-prompts N`` (default ``num_prompts``)."""
    parser.add_argument("--prompts", help="JSON file with a list of prompt strings (default: held-out stdlib files)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)


def add_max_new_tokens_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS)


def add_model_and_prompt_arguments(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """The flags of an in-process benchmark: the replica's model settings, the length, ``--json`` and the prompts."""
    ReplicaConfig.add_arguments(parser, MODEL_SETTINGS)
    add_max_new_tokens_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_prompt_arguments(parser, num_prompts)


def options(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags ``names`` (as their ``dest``), keyed by name: for config fields named like their flags."""
    return {name: getattr(args, name) for name in names}


def model_and_prompt_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields of an in-process benchmark that come straight from the same flags: the models, the
    prompts and the length (``--target --draft --dtype --device --prompts --num-prompts --max-new-tokens``)."""
    return {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "device": args.device,
        "prompts_file": args.prompts,
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
    }
