"""The drafter spec strings (``ngram``, ``suffix``, ``none``, ``layerskip:L|DIR``, ``eagle:DIR``, ``medusa:DIR``, a
draft model directory): their grammar, checks and paths. Torch-free.

Every edge that takes a drafter (``--draft``, the Serve ``draft`` setting, Python) parses the same
strings. :func:`check_drafter_spec` refuses a spec that names nothing here with a message listing
the valid forms and the closest one (``ngrams`` → ``ngram``), before any model loads;
:func:`absolute_spec` makes the directory a spec names absolute so that a replica started on
another node or in another working directory finds it. Building the drafter is
:mod:`specserve.drafters.registry`.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from specserve.core.checkpoint_dir import check_checkpoint_dir, looks_like_hub_id, missing_directory_message
from specserve.core.errors import UserError

BUILTIN_DRAFTERS = ("none", "ngram", "suffix")
LAYERSKIP_PREFIX = "layerskip:"
EAGLE_PREFIX = "eagle:"
MEDUSA_PREFIX = "medusa:"
REST_PREFIX = "rest:"  # rest:FILE, a token datastore file (specserve datastore build)
DIRECTORY_PREFIXES = (EAGLE_PREFIX, MEDUSA_PREFIX, LAYERSKIP_PREFIX)

# Every form, as the error message lists them ("DIR" alone: a draft model directory).
FORMS = ("ngram", "suffix", "none", "layerskip:L", "layerskip:DIR", "eagle:DIR", "medusa:DIR", "rest:FILE", "DIR")


class InvalidDrafterSpec(UserError):
    """A drafter spec that names no drafter; the message lists the valid forms."""


def is_model_free(spec: str) -> bool:
    """Whether ``spec`` drafts without trained weights of any kind: ``none``, ``ngram``, ``suffix`` or
    ``rest:FILE`` (a datastore file, not a model). Such a spec is never loaded as a draft model directory; a new
    model-free form says so here."""
    return spec in BUILTIN_DRAFTERS or spec.startswith(REST_PREFIX)


def absolute_spec(spec: str) -> str:
    """``spec`` with the directory it names made absolute when that directory exists here: a draft model
    directory, or the DIR of ``eagle:DIR``, ``medusa:DIR`` and ``layerskip:DIR``. ``none``, ``ngram``, ``suffix``,
    ``layerskip:L`` and missing directories are returned unchanged. A new spec form that names a directory
    says so here. The FILE of ``rest:FILE`` is made absolute the same way when that file exists here."""
    if spec in BUILTIN_DRAFTERS:
        return spec
    if spec.startswith(REST_PREFIX):  # a file, not a directory
        value = spec[len(REST_PREFIX) :]
        return REST_PREFIX + (os.path.abspath(value) if value and os.path.isfile(value) else value)
    for prefix in DIRECTORY_PREFIXES:
        if spec.startswith(prefix):
            value = spec[len(prefix) :]
            if prefix == LAYERSKIP_PREFIX and value.isdigit():
                return spec  # a layer count, not a directory
            return prefix + _absolute(value)
    return _absolute(spec)


def check_drafter_spec(spec: str) -> None:
    """Raise :class:`InvalidDrafterSpec` unless ``spec`` is a built-in drafter, ``layerskip:L``, or names a
    directory that exists here (a draft model directory must also look like a checkpoint). Call it where the
    models are loaded (a command on this machine), not where a configuration is only read."""
    if spec in BUILTIN_DRAFTERS:
        return
    if spec.startswith(REST_PREFIX):
        value = spec[len(REST_PREFIX) :]
        if not value:
            raise InvalidDrafterSpec(f"{spec!r} names no file; write {REST_PREFIX}FILE. {_forms()}")
        if not Path(value).is_file():
            what = "is a directory, not a datastore file" if Path(value).is_dir() else "does not exist"
            raise InvalidDrafterSpec(
                f"datastore {value} {what} (in {spec!r}); build one with "
                f"`specserve datastore build --data FOLDER --tokenizer TARGET_DIR --out {value}`"
            )
        return
    for prefix in DIRECTORY_PREFIXES:
        if spec.startswith(prefix):
            value = spec[len(prefix) :]
            if prefix == LAYERSKIP_PREFIX and value.isdigit():
                if int(value) < 1:
                    raise InvalidDrafterSpec(f"layerskip:L needs L >= 1 target layers, got {spec!r}")
                return
            if not value:
                raise InvalidDrafterSpec(f"{spec!r} names no directory; write {prefix}DIR. {_forms()}")
            if not Path(value).is_dir():
                raise InvalidDrafterSpec(f"{missing_directory_message(value, 'head directory')} (in {spec!r})")
            return
    if Path(spec).exists():
        check_checkpoint_dir(spec, "draft model directory")
        return
    if looks_like_hub_id(spec):
        raise InvalidDrafterSpec(
            missing_directory_message(spec, "draft model directory").replace("--target", "--draft")
        )
    raise InvalidDrafterSpec(
        f"unknown drafter {spec!r}: no built-in drafter and no directory of that name.{_closest(spec)} {_forms()}"
    )


def _closest(spec: str) -> str:
    """`` Did you mean 'X'?`` for the form whose keyword is closest to the spec's, or nothing."""
    keywords: dict[str, str] = {}
    for form in FORMS:
        if form != "DIR":
            keywords.setdefault(form.split(":")[0], form)  # the first form of each keyword: layerskip:L
    match = difflib.get_close_matches(spec.split(":")[0].lower(), list(keywords), n=1, cutoff=0.6)
    return f" Did you mean {keywords[match[0]]!r}?" if match else ""


def _forms() -> str:
    return "A drafter is " + ", ".join(form for form in FORMS if form != "DIR") + " or a draft model directory."


def _absolute(path: str) -> str:
    return os.path.abspath(path) if path and not os.path.isabs(path) and os.path.isdir(path) else path
