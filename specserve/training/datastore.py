"""``specserve datastore build``: the token datastore the REST drafter (``--draft rest:FILE``) retrieves from.

Tokenises every text file under ``--data`` (by suffix, as the drafter heads' ``--data`` does; without
it, the training split of the default corpus, the standard library the shipped pair learned from)
with the tokenizer in ``--tokenizer`` (the target's directory), joins the files with a separator and
writes their suffix array to ``--out`` (:func:`specserve.drafters.datastore.build_datastore`), with
progress bars on stderr and one line on stdout: tokens, size, seconds. Arguments are checked before
torch loads; the datastore records the tokenizer's fingerprint, so a target with another tokenizer
refuses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specserve import defaults
from specserve.core.errors import UserError

if TYPE_CHECKING:
    from specserve.drafters.datastore import BuildSummary

ACTIONS = ("build",)
DEFAULT_OUT = Path("runs") / "datastore" / "datastore.rest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "`datastore build`: tokenise a folder of text or code with the target's tokenizer and write a suffix-array "
        "datastore for retrieval drafting; draft from it with --draft rest:OUT."
    )
    parser.add_argument("action", choices=ACTIONS, help="what to do with a datastore")
    parser.add_argument(
        "--data",
        metavar="FOLDER",
        help="a folder of text/code files (default: the standard library corpus the shipped pair learned)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=str(defaults.DEFAULT_TARGET),
        help="a directory holding the target's tokenizer (the target's own directory)",
    )
    parser.add_argument("--out", metavar="FILE", default=str(DEFAULT_OUT), help="the datastore file to write")
    parser.add_argument(
        "--max-tokens", type=int, metavar="N", help="stop adding files once the datastore holds this many tokens"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run_command(args: argparse.Namespace) -> int:
    if args.data is not None and not Path(args.data).is_dir():
        raise UserError(f"--data {args.data} does not exist or is not a directory")
    if not Path(args.tokenizer).is_dir():
        raise UserError(f"--tokenizer {args.tokenizer} is not a directory (give the target's model directory)")
    if Path(args.out).is_dir():
        raise UserError(f"--out {args.out} is a directory; give the datastore's file name")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    summary = build(args.data, args.tokenizer, args.out, max_tokens=args.max_tokens, progress=not args.quiet)
    print(
        f"datastore {summary.path}: {summary.tokens:,} tokens from {summary.files} files, "
        f"{summary.bytes / 2**20:.1f} MiB, {summary.seconds:.1f} s; draft with --draft rest:{summary.path}"
    )
    return 0


def build(
    data: str | Path | None,
    tokenizer_dir: str | Path,
    out: str | Path,
    max_tokens: int | None = None,
    progress: bool = False,
) -> BuildSummary:
    """Tokenise ``data`` (or the default corpus) with the tokenizer in ``tokenizer_dir`` and write the datastore."""
    import numpy as np

    from specserve.core.model.causal_lm import load_tokenizer
    from specserve.drafters.datastore import build_datastore, tokenize_texts, tokenizer_fingerprint, tokenizer_size
    from specserve.training import corpus
    from specserve.training.heads import folder_files

    started = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer is None:
        raise UserError(f"--tokenizer {tokenizer_dir} holds no tokenizer (tokenizer.json, tokenizer_config.json, ...)")
    files = corpus.load_corpus("train") if data is None else folder_files(data)
    vocab_size = tokenizer_size(tokenizer)
    tokens = tokenize_texts((f.text for f in files), tokenizer, separator=vocab_size, progress=progress)
    used = len(files)
    if max_tokens is not None and tokens.size > max_tokens:
        tokens = tokens[:max_tokens]
        used = int(np.count_nonzero(tokens == vocab_size)) + (0 if tokens[-1] == vocab_size else 1)
    summary = build_datastore(
        tokens, out, vocab_size=vocab_size, fingerprint=tokenizer_fingerprint(tokenizer), progress=progress, files=used
    )
    return dataclasses.replace(summary, seconds=time.perf_counter() - started)
