"""The drafter spec strings (``ngram``, ``suffix``, ``lookahead[:W,N,G]``, ``none``, ``layerskip:L|DIR``, ``eagle:DIR``,
``medusa:DIR``, ``pard:DIR``, ``mtp``, ``rest:FILE``, ``text:DIR``, a draft model directory): their grammar, checks and
paths. Torch-free.

Every edge that takes a drafter (``--draft``, the Serve ``draft`` setting, Python) parses the same
strings. :func:`check_drafter_spec` refuses a spec that names nothing here with a message listing
the valid forms and the closest one (``ngrams`` → ``ngram``), before any model loads;
:func:`absolute_spec` makes the directory a spec names absolute so that a replica started on
another node or in another working directory finds it. Building the drafter is
:mod:`specserve.drafters.registry`.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.errors import UserError
from specserve.core.model.checkpoint_dir import check_checkpoint_dir, looks_like_hub_id, missing_directory_message

BUILTIN_DRAFTERS = ("none", "ngram", "suffix", "lookahead")
LAYERSKIP_PREFIX = "layerskip:"
EAGLE_PREFIX = "eagle:"
MEDUSA_PREFIX = "medusa:"
PARD_PREFIX = "pard:"  # pard:DIR, a PARD draft model (a causal LM whose config names a pard_token)
REST_PREFIX = "rest:"  # rest:FILE, a token datastore file (specserve datastore build)
LOOKAHEAD_PREFIX = "lookahead:"  # lookahead:W,N,G, Lookahead decoding with a window W, n-grams N, G candidates
TEXT_PREFIX = "text:"  # text:DIR, a draft model with another tokenizer, drafting through text
MTP_SPEC = "mtp"  # the multi-token-prediction layer the target's own checkpoint carries (DeepSeek-V3, GLM-4.5)
LOOKAHEAD_DEFAULTS = (4, 3, 4)  # W, N, G of a bare ``lookahead``
MAX_PROBE_NODES = 256  # W x (N - 1) at most: the window is computed in every verify forward
DIRECTORY_PREFIXES = (EAGLE_PREFIX, MEDUSA_PREFIX, PARD_PREFIX, LAYERSKIP_PREFIX, TEXT_PREFIX)

# Every form, as the error message lists them ("DIR" alone: a draft model directory).
FORMS = (
    "ngram",
    "suffix",
    "lookahead",
    "lookahead:W,N,G",
    "none",
    "layerskip:L",
    "layerskip:DIR",
    "eagle:DIR",
    "medusa:DIR",
    "pard:DIR",
    "mtp",
    "rest:FILE",
    "text:DIR",
    "DIR",
)


class InvalidDrafterSpec(UserError):
    """A drafter spec that names no drafter; the message lists the valid forms."""


def is_model_free(spec: str) -> bool:
    """Whether ``spec`` drafts without trained weights of any kind: ``none``, ``ngram``, ``suffix``, ``lookahead``
    (the target's own Jacobi iterations) or ``rest:FILE`` (a datastore file, not a model). Such a spec is never
    loaded as a draft model directory; a new model-free form says so here."""
    return spec in BUILTIN_DRAFTERS or spec.startswith((REST_PREFIX, LOOKAHEAD_PREFIX))


def lookahead_settings(spec: str) -> tuple[int, int, int] | None:
    """``(W, N, G)`` of a ``lookahead`` (:data:`LOOKAHEAD_DEFAULTS`) or ``lookahead:W,N,G`` spec, ``None`` for any
    other spec; raises :class:`InvalidDrafterSpec` for a malformed one."""
    if spec == "lookahead":
        return LOOKAHEAD_DEFAULTS
    if not spec.startswith(LOOKAHEAD_PREFIX):
        return None
    parts = spec[len(LOOKAHEAD_PREFIX) :].split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise InvalidDrafterSpec(
            f"Lookahead settings are 'lookahead:W,N,G' (window, n-gram size, candidates: three integers), got {spec!r}"
        )
    window, ngram, candidates = (int(p) for p in parts)
    check_lookahead(window, ngram, candidates, f", got {spec!r}")
    return window, ngram, candidates


def check_lookahead(window: int, ngram: int, candidates: int, where: str = "") -> None:
    """Raises :class:`InvalidDrafterSpec` unless W >= 1, N >= 2, G >= 1 and the window's W x (N - 1) extra positions
    per forward stay within :data:`MAX_PROBE_NODES`; ``where`` ends the message (which spec said so)."""
    if window < 1 or ngram < 2 or candidates < 1:
        raise InvalidDrafterSpec(
            f"Lookahead needs W >= 1, N >= 2 and G >= 1 (window, n-gram size, candidates){where}: "
            f"W {window}, N {ngram}, G {candidates}"
        )
    if window * (ngram - 1) > MAX_PROBE_NODES:
        raise InvalidDrafterSpec(
            f"a Lookahead window of W x (N - 1) = {window * (ngram - 1)} extra positions in every forward is too "
            f"many (at most {MAX_PROBE_NODES}){where}"
        )


def probe_nodes_of(spec: str) -> int:
    """The most probe nodes the drafter ``spec`` names adds to a verify forward (W x (N - 1) for Lookahead, 0 for
    any other): a request reserves that much KV room beyond its draft."""
    settings = lookahead_settings(spec)
    return settings[0] * (settings[1] - 1) if settings is not None else 0


def drafter_kind(spec: str) -> str:
    """What kind of drafter ``spec`` names, as a short metrics tag: a built-in's name (``ngram``, ``lookahead``...),
    a prefixed form's prefix (``eagle``, ``medusa``, ``layerskip``, ``rest``, ``text``), ``mtp``, or ``draft_model``."""
    if spec in BUILTIN_DRAFTERS or spec == MTP_SPEC:
        return spec
    for prefix in (LOOKAHEAD_PREFIX, REST_PREFIX, *DIRECTORY_PREFIXES):
        if spec.startswith(prefix):
            return prefix.rstrip(":")
    return "draft_model"


def absolute_spec(spec: str) -> str:
    """``spec`` with the directory it names made absolute when that directory exists here: a draft model
    directory, or the DIR of ``eagle:DIR``, ``medusa:DIR`` and ``layerskip:DIR``. ``none``, ``ngram``, ``suffix``,
    ``layerskip:L`` and missing directories are returned unchanged. A new spec form that names a directory
    says so here. The FILE of ``rest:FILE`` is made absolute the same way when that file exists here."""
    if spec in BUILTIN_DRAFTERS or spec.startswith(LOOKAHEAD_PREFIX):
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
    if spec in BUILTIN_DRAFTERS or spec == MTP_SPEC:  # mtp: the target's own files say at load whether it has one
        return
    if lookahead_settings(spec) is not None:  # raises for malformed settings
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
                missing = missing_directory_message(value, "head directory", f"--draft {prefix}")
                raise InvalidDrafterSpec(f"{missing} (in {spec!r})")
            return
    if Path(spec).exists():
        check_checkpoint_dir(spec, "draft model directory")
        return
    if looks_like_hub_id(spec):
        raise InvalidDrafterSpec(missing_directory_message(spec, "draft model directory", "--draft "))
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


def suggested_gamma(spec: str) -> int | None:
    """The γ a published head suggests for itself (:func:`speculative_tokens` of the ``config.json`` of
    ``eagle:DIR``), capped at ``MAX_GAMMA``; ``None`` for any other spec or a head that suggests none."""
    if not spec.startswith(EAGLE_PREFIX):
        return None
    try:
        config = json.loads(Path(spec[len(EAGLE_PREFIX) :], "config.json").read_text())
    except (OSError, ValueError):
        return None
    tokens = speculative_tokens(config) if isinstance(config, dict) else None
    return None if tokens is None else min(tokens, MAX_GAMMA)


def speculative_tokens(config: Mapping[str, Any]) -> int | None:
    """``speculators_config.proposal_methods[0].speculative_tokens`` of a head's config (vLLM's speculators format):
    the γ its publisher suggests, or ``None`` when absent or not a positive integer."""
    settings = config.get("speculators_config")
    methods = settings.get("proposal_methods") if isinstance(settings, dict) else None
    first = methods[0] if isinstance(methods, list) and methods and isinstance(methods[0], dict) else {}
    tokens = first.get("speculative_tokens")
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None
