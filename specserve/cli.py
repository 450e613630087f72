"""The ``specserve`` command line: a registry of subcommands, and one way of reporting what the user must fix.

Each subcommand's arguments and entry point live beside the feature it drives, in a module with
``add_arguments(parser)`` and ``run_command(args) -> int`` (:class:`Subcommand`); :data:`COMMANDS`
maps each name to its module. Only the chosen subcommand's module is imported, so ``specserve
cluster status`` does not load torch.

Arguments are checked before torch loads, so a mistake costs a fraction of a second: this module
imports nothing heavy, and each subcommand checks its arguments and paths before importing the
engine. ``--help`` shows every default. Subcommands that compute in this process
(``Command.threads``) get ``--threads`` here, applied before torch is imported (:func:`use_threads`).

Every failure the user can fix (a missing model directory, mismatched vocabularies, an empty
prompt, an out-of-range parameter: a :class:`~specserve.core.errors.UserError`) is reported as
one ``error: ...`` line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from specserve import defaults
from specserve.core.errors import UserError


class Subcommand(Protocol):
    """What a subcommand's module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run_command(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class Command:
    module: str  # the Subcommand module
    help: str  # one line for `specserve --help`
    threads: bool = False  # computes in this process: takes --threads

    def load(self) -> Subcommand:
        return cast(Subcommand, importlib.import_module(self.module))


COMMANDS: dict[str, Command] = {
    "generate": Command("specserve.generate", "generate text from a prompt with speculative decoding", threads=True),
    "bench": Command(
        "specserve.benchmarks.speculative",
        "benchmark speculative decoding against plain decoding and transformers",
        threads=True,
    ),
    "bench-trees": Command(
        "specserve.benchmarks.trees", "draft chains vs static vs dynamic trees at equal verified nodes", threads=True
    ),
    "bench-drafters": Command(
        "specserve.benchmarks.learned",
        "every drafter (draft model, EAGLE, Medusa, layer-skip, n-gram, suffix, REST, HF) on a workload",
        threads=True,
    ),
    "bench-distributed": Command(
        "specserve.benchmarks.distributed", "in-process engine vs distributed runtime (greedy)"
    ),
    "bench-serve": Command(
        "specserve.benchmarks.serve_command",
        "load test of the HTTP API: speculation on vs off by concurrency, or the prefix cache on vs off",
    ),
    "bench-chaos": Command(
        "specserve.benchmarks.chaos", "a soak of the HTTP API with a drafter and a shard killed during it"
    ),
    "bench-batch": Command(
        "specserve.benchmarks.batch",
        "batched serving in process by concurrency: one at a time, batched γ, transformers",
        threads=True,
    ),
    "experiment": Command(
        "specserve.benchmarks.experiment",
        "γ policies over workloads: live, or replayed from cycle traces",
        threads=True,
    ),
    "train": Command(
        "specserve.training.command",
        "train the default model pair, or a drafter head (eagle, medusa, exit-head) for a frozen target",
    ),
    "datastore": Command(
        "specserve.training.datastore", "build a token datastore (suffix array) for the REST drafter, rest:FILE"
    ),
    "replay": Command(
        "specserve.replay", "re-run a shadow check's repro bundle in one process: confirm or clear it", threads=True
    ),
    "serve": Command("specserve.serve.command", "serve the OpenAI-compatible API on Ray Serve until Ctrl-C"),
    "cluster": Command(
        "specserve.cluster.command", "a local multi-node Ray cluster on this machine (up, down, status)"
    ),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, except switches (off unless given) and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.option_strings and not any(action.default is x for x in (None, False, argparse.SUPPRESS))
        return text if not shown or "%(default)" in text else f"{text} (default: %(default)s)"


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; only those named in ``commands`` (default: all) get their arguments."""
    chosen = set(COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(prog="specserve", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(
            name, help=command.help, description=command.help, formatter_class=DefaultsHelpFormatter
        )
        if name in chosen:
            command.load().add_arguments(subparser)
            if command.threads:
                add_threads_argument(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((arg for arg in argv if not arg.startswith("-")), None)  # the subcommand, if any
    args = build_parser([name] if name in COMMANDS else []).parse_args(argv)
    quiet_transformers()
    try:
        if getattr(args, "threads", None) is not None:
            use_threads(args.threads)
        return COMMANDS[args.command].load().run_command(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def add_threads_argument(parser: argparse.ArgumentParser, default: int = defaults.DEFAULT_THREADS) -> None:
    """``--threads N``: torch's CPU threads in this process (:func:`main` applies it before torch is imported)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=default,
        help="torch CPU threads in this process. 1 is the default because the shipped models are small: on a 2-core "
        "machine 2 threads were no faster idle and 4-6x slower when other work shared the cores "
        "(docs/usage.md#threads); raise it on an idle many-core machine with a larger model. Ray actors use "
        "--threads-per-shard / --threads-per-drafter",
    )


def use_threads(threads: int) -> None:
    """Run torch's intra-op pool with ``threads`` threads: through the environment when torch is not imported yet
    (OpenMP reads it once), directly when it is."""
    if threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def quiet_transformers() -> None:
    """No weight-loading progress bars (they would clutter streamed text and error lines) and only transformers'
    errors: through the environment when transformers is not imported yet (so that nothing is imported before the
    arguments are checked), through its logging module when it is."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


if __name__ == "__main__":
    sys.exit(main())
