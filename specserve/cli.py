"""The ``specserve`` command line: a registry of subcommands, and one way of reporting what the user must fix.

Each subcommand's arguments and entry point live beside the feature it drives, in a module with
``add_arguments(parser)`` and ``run_command(args) -> int`` (:class:`Subcommand`); :data:`COMMANDS`
maps each name to its module. Only the chosen subcommand's module is imported, so ``specserve
cluster status`` does not load torch.

Every failure the user can fix (a missing model directory, mismatched vocabularies, an empty
prompt, an out-of-range parameter: a :class:`~specserve.core.errors.UserError`) is reported as
one ``error: ...`` line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from specserve.core.errors import UserError


class Subcommand(Protocol):
    """What a subcommand's module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run_command(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class Command:
    module: str  # the Subcommand module
    help: str  # one line for `specserve --help`

    def load(self) -> Subcommand:
        return cast(Subcommand, importlib.import_module(self.module))


COMMANDS: dict[str, Command] = {
    "generate": Command("specserve.generate", "generate text from a prompt with speculative decoding"),
    "bench": Command(
        "specserve.benchmarks.speculative", "benchmark speculative decoding against plain decoding and transformers"
    ),
    "bench-trees": Command(
        "specserve.benchmarks.trees", "draft chains vs static vs dynamic trees at equal verified nodes"
    ),
    "bench-drafters": Command(
        "specserve.benchmarks.learned", "every drafter (draft model, EAGLE, Medusa, layer-skip, n-gram, HF)"
    ),
    "bench-distributed": Command(
        "specserve.benchmarks.distributed", "in-process engine vs distributed runtime (greedy)"
    ),
    "bench-serve": Command(
        "specserve.benchmarks.serve_load", "load test of the HTTP API: speculation on vs off by concurrency"
    ),
    "bench-batch": Command(
        "specserve.benchmarks.batch",
        "batched serving in process by concurrency: one at a time, batched γ, transformers",
    ),
    "experiment": Command(
        "specserve.benchmarks.experiment", "γ policies over workloads: live, or replayed from cycle traces"
    ),
    "train": Command(
        "specserve.training.command",
        "train the default model pair, or a drafter head (eagle, medusa, exit-head) for a frozen target",
    ),
    "serve": Command("specserve.serve.command", "serve the OpenAI-compatible API on Ray Serve until Ctrl-C"),
    "cluster": Command(
        "specserve.cluster.command", "a local multi-node Ray cluster on this machine (up, down, status)"
    ),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; only those named in ``commands`` (default: all) get their arguments."""
    chosen = set(COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(prog="specserve", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(name, help=command.help)
        if name in chosen:
            command.load().add_arguments(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((arg for arg in argv if not arg.startswith("-")), None)  # the subcommand, if any
    args = build_parser([name] if name in COMMANDS else []).parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would clutter streamed text and error lines
    hf_logging.set_verbosity_error()
    try:
        return COMMANDS[args.command].load().run_command(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
