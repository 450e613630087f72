"""Command-line pieces the benchmark subcommands share: number lists, the common flags, ``--quick``, and output.

Each ``specserve bench*`` / ``experiment`` subcommand keeps its own ``add_arguments`` and
``run_command`` in its module; this holds what all of them do the same way:

* **where results go** — ``--out`` defaults to a scratch directory, ``runs/<subcommand>/`` under the
  current directory (not checked in); the checked-in results under ``bench/results`` are written
  only when ``--out`` names them (``make bench`` does);
* **what stdout carries** — with ``--json``, exactly one JSON document on one line: the full report,
  as the ``.json`` file holds it; without, the Markdown table as the ``.md`` file holds it, then one
  ``results: ...`` line naming the files. Everything else (progress bars, per-configuration lines,
  library chatter) goes to stderr (:func:`stdout_to_stderr`);
* **``--quick``** — a smoke run of about a minute: it changes the defaults of the flags it names,
  and only those the user did not give (:class:`Quick`).

Runs no benchmark itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from specserve import defaults
from specserve.cluster.replica_config import MODEL_SETTINGS, ReplicaConfig
from specserve.core.errors import UserError

N = TypeVar("N", int, float)

RUNS_DIR = Path("runs")  # scratch results, under the current directory; /runs/ is in .gitignore
JSON_HELP = (
    "print only the full report (what the .json file holds) as one line of JSON on stdout; "
    "progress and the list of files go to stderr"
)


# ---------------------------------------------------------------------------------------------
# Parsing


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
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help="how many of the prompts to run")


def add_max_new_tokens_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS)


def add_model_and_prompt_arguments(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """The flags of an in-process benchmark: the replica's model settings, the length and the prompts."""
    ReplicaConfig.add_arguments(parser, MODEL_SETTINGS)
    add_max_new_tokens_argument(parser)
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


# ---------------------------------------------------------------------------------------------
# Where results go, and what stdout carries


def scratch_dir(command: str) -> Path:
    """The default ``--out`` of ``specserve <command>``: ``runs/<command>`` under the current directory."""
    return RUNS_DIR / command


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def add_output_arguments(parser: argparse.ArgumentParser, command: str, files: str) -> None:
    """``--out DIR`` (default ``runs/<command>``) for ``files`` (e.g. ``"trees.json/.md/.png"``), and ``--json``."""
    parser.add_argument(
        "--out",
        default=str(scratch_dir(command)),
        help=f"directory for {files} (default: %(default)s under the current directory; "
        "the checked-in results are rewritten only with --out bench/results)",
    )
    add_json_argument(parser)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While a benchmark runs, whatever it or a library prints goes to stderr: stdout is kept for the report."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def results_line(paths: Sequence[Path]) -> str:
    """``results: runs/bench/speculative.json, speculative.md, speculative.png``: the first path in full, the
    others by name when they sit beside it."""
    first, *rest = paths
    return "results: " + ", ".join([str(first), *(p.name if p.parent == first.parent else str(p) for p in rest)])


def print_results(args: argparse.Namespace, report: Mapping[str, Any], markdown: str, paths: Sequence[Path]) -> None:
    """The command's stdout: one JSON line (``--json``), or the table and the ``results:`` line.

    With ``--json`` the ``results:`` line goes to stderr, so that stdout parses as one document."""
    if args.json:
        print(json.dumps(report))
        print(results_line(paths), file=sys.stderr)
    else:
        print(markdown.rstrip("\n"))
        print(results_line(paths))


# ---------------------------------------------------------------------------------------------
# --quick


@dataclass(frozen=True)
class Quick:
    """What ``--quick`` changes: the defaults of some flags, for a smoke run of about a minute.

    ``defaults`` maps flag destinations (``"num_prompts"``) to their values under ``--quick``, written
    as the command line would give them; ``runs`` says in a phrase what a quick run runs (for
    ``--help``). A flag the user gives wins over both its full and its quick default.
    """

    defaults: Mapping[str, Any]
    runs: str

    def add_argument(self, parser: argparse.ArgumentParser) -> None:
        """Add ``--quick``; call it after the flags it changes. Their parsed default becomes ``None`` (unset), the
        full defaults are kept in ``full_defaults``, and :meth:`apply` fills the unset ones."""
        full = {dest: parser.get_default(dest) for dest in self.defaults}
        parser.set_defaults(**dict.fromkeys(self.defaults), full_defaults=full)
        parser.add_argument(
            "--quick",
            action="store_true",
            help=f"a smoke run in about a minute: {self.runs}. It means {_as_flags(self.defaults)} for the flags "
            f"you do not give (without --quick their defaults are {_as_flags(full)})",
        )

    def apply(self, args: argparse.Namespace) -> None:
        """Give every flag the user left unset its quick default (with ``--quick``) or its full one."""
        for dest, quick in self.defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, quick if args.quick else args.full_defaults[dest])


def _as_flags(values: Mapping[str, Any]) -> str:
    """``{"num_prompts": 4}`` as ``--num-prompts 4``; a flag whose default is ``None`` (its help says what that means)
    is left out."""
    return " ".join(f"--{dest.replace('_', '-')} {value}" for dest, value in values.items() if value is not None)
