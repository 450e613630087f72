"""Build a drafter from its name: ``none``, ``ngram``, ``suffix``, ``lookahead[:W,N,G]``, ``layerskip:L|DIR``,
``eagle:DIR``, ``medusa:DIR``, ``pard:DIR``, ``mtp``, ``rest:FILE``, a model dir.

:func:`build_drafter_set` wraps the configured drafter in a :class:`~specserve.core.draft.drafter.DrafterSet`
whose builder is :func:`build_drafter` with the same options, so a request can also choose
``ngram``, ``suffix`` or ``none`` (built on first use, then kept). Loads no model other than the configured one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from specserve.core.draft.drafter import REQUEST_DRAFTERS, Drafter, DrafterSet, check_drafter_name
from specserve.core.draft.spec_strings import (
    BUILTIN_DRAFTERS,
    EAGLE_PREFIX,
    LAYERSKIP_PREFIX,
    LOOKAHEAD_PREFIX,
    MEDUSA_PREFIX,
    MTP_SPEC,
    PARD_PREFIX,
    REST_PREFIX,
    TEXT_PREFIX,
)
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.static.options import StaticOptions
from specserve.drafters.batched_model import BatchedDraftModel
from specserve.drafters.layerskip import LayerSkipDrafter
from specserve.drafters.layerskip_batch import BatchedLayerSkip
from specserve.drafters.lookahead import LookaheadDrafter
from specserve.drafters.medusa import MedusaDrafter
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter
from specserve.drafters.pard import PardDrafter
from specserve.drafters.pard_batch import BatchedPardModel
from specserve.drafters.rest import RestDrafter
from specserve.drafters.suffix import SuffixCache, SuffixDrafter
from specserve.drafters.text import TextDrafter

# Drafters loaded once per server whose fresh() gives each request its own (Prototype), by spec prefix
PROTOTYPE_PREFIXES = (LAYERSKIP_PREFIX, EAGLE_PREFIX, MEDUSA_PREFIX, PARD_PREFIX, REST_PREFIX, TEXT_PREFIX)


@runtime_checkable
class Prototype(Protocol):
    """A drafter built once per server (EAGLE, Medusa, layer-skip heads, a REST datastore) whose ``fresh()`` gives
    each request its own drafter sharing the loaded weights or data."""

    def fresh(self) -> Drafter: ...


def build_drafter(
    spec: str | CausalLM,
    target: CausalLM | TargetDescription,
    dtype: str = "float32",
    device: str = "cpu",
    max_ngram: int = 3,
    min_ngram: int = 1,
    suffix_cache: SuffixCache | None = None,
) -> Drafter:
    """``spec`` is ``"none"``, ``"ngram"``, ``"suffix"``, ``"lookahead"`` / ``"lookahead:W,N,G"`` (Lookahead
    decoding), ``"layerskip:L"`` (the target's first L layers) or
    ``"layerskip:DIR"`` (with a trained exit head), ``"eagle:DIR"`` / ``"medusa:DIR"`` (trained heads), ``"pard:DIR"``
    (a PARD draft model: a block per forward), ``"mtp"``
    (the MTP layer in the target's own checkpoint),
    ``"rest:FILE"`` (a token datastore), ``"text:DIR"`` (a draft model with another tokenizer, drafting through
    text), a draft model directory, or an already loaded draft model. Drafters built
    on the target's own weights load their own copy of the target in a process that holds only its description."""
    if isinstance(spec, CausalLM):
        return DraftModelDrafter(spec, target)
    if spec.startswith(LAYERSKIP_PREFIX):
        # layerskip:L (the first L layers) or layerskip:DIR (a trained exit head; L from its config)
        value = spec[len(LAYERSKIP_PREFIX) :]
        exit_head_dir = not value.isdigit()
        if exit_head_dir and not (value and Path(value).exists()):
            raise UserError(
                "layer-skip drafting is 'layerskip:L' with L the number of target layers, or 'layerskip:DIR' with "
                f"DIR a trained exit head directory; got {spec!r}"
            )
        if exit_head_dir:
            LayerSkipDrafter.check_directory(value)  # fail on a bad directory before loading a copy of the target
        model = target if isinstance(target, CausalLM) else CausalLM.load(target.info.path, dtype=dtype, device=device)
        if exit_head_dir:
            return LayerSkipDrafter.from_directory(model, value)
        return LayerSkipDrafter(model, int(value))
    if spec.startswith(EAGLE_PREFIX):
        directory = spec[len(EAGLE_PREFIX) :]
        if not directory:
            raise UserError(f"EAGLE drafting is 'eagle:DIR' with DIR a trained head directory, got {spec!r}")
        # imported here: the EAGLE head is built on transformers' Llama modelling code, which a process that serves
        # no EAGLE head (an n-gram or suffix drafter actor) need not import
        from specserve.drafters.eagle import EagleDrafter

        return EagleDrafter.load(directory, target, dtype=dtype, device=device)
    if spec == MTP_SPEC:
        from specserve.drafters.eagle import EagleDrafter
        from specserve.drafters.mtp import load_mtp_head

        model = target if isinstance(target, CausalLM) else CausalLM.load(target.info.path, dtype=dtype, device=device)
        return EagleDrafter.for_target(load_mtp_head(model), model, output_device=target.device)
    if spec.startswith(MEDUSA_PREFIX):
        directory = spec[len(MEDUSA_PREFIX) :]
        if not directory:
            raise UserError(f"Medusa drafting is 'medusa:DIR' with DIR a trained heads directory, got {spec!r}")
        return MedusaDrafter.load(directory, target, dtype=dtype, device=device)
    if spec.startswith(PARD_PREFIX):
        directory = spec[len(PARD_PREFIX) :]
        if not directory:
            raise UserError(f"PARD drafting is 'pard:DIR' with DIR a PARD draft model directory, got {spec!r}")
        return PardDrafter.load(directory, target, dtype=dtype, device=device)
    if spec.startswith(REST_PREFIX):
        path = spec[len(REST_PREFIX) :]
        if not path:
            raise UserError(f"REST drafting is 'rest:FILE' with FILE a token datastore file, got {spec!r}")
        return RestDrafter.load(path, target)
    if spec.startswith(TEXT_PREFIX):
        directory = spec[len(TEXT_PREFIX) :]
        if not directory:
            raise UserError(f"drafting through text is 'text:DIR' with DIR a draft model directory, got {spec!r}")
        return TextDrafter(CausalLM.load(Path(directory), dtype=dtype, device=device), target)
    if spec == "none":
        return NoDrafter(target.device)
    if spec == "ngram":
        return NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram, device=target.device)
    if spec == "suffix":  # the global store given, or one of its own (kept while the drafter is)
        return SuffixDrafter(suffix_cache, device=target.device)
    if spec == "lookahead" or spec.startswith(LOOKAHEAD_PREFIX):
        return LookaheadDrafter.from_spec(spec, device=target.device)
    return DraftModelDrafter(CausalLM.load(Path(spec), dtype=dtype, device=device), target)


def build_drafter_set(
    spec: str | CausalLM,
    target: CausalLM | TargetDescription,
    dtype: str = "float32",
    device: str = "cpu",
    max_ngram: int = 3,
    min_ngram: int = 1,
    suffix_cache: SuffixCache | None = None,
) -> DrafterSet:
    """The configured drafter (built now, as :func:`build_drafter` would) and the built-ins requests may choose.

    The built-ins are made on the first request naming them, by whatever thread calls ``get``. A suffix drafter
    keeps its outputs in ``suffix_cache`` when one is given (a store shared across replicas, for one)."""

    def build(name: str | CausalLM) -> Drafter:
        return build_drafter(
            name,
            target,
            dtype=dtype,
            device=device,
            max_ngram=max_ngram,
            min_ngram=min_ngram,
            suffix_cache=suffix_cache,
        )

    return DrafterSet(build(spec), build)


def request_drafters(
    spec: str | CausalLM,
    target: CausalLM | TargetDescription,
    dtype: str = "float32",
    device: str = "cpu",
    max_ngram: int = 3,
    min_ngram: int = 1,
    *,
    max_num_seqs: int | None = None,
    max_seq_len: int | None = None,
    suffix_cache: SuffixCache | None = None,
    static: StaticOptions | None = None,
) -> Callable[[str], Drafter]:
    """For the batched engine: ``new_drafter(name)`` gives each request a drafter of its own (``name`` one of
    :data:`~specserve.core.draft.drafter.REQUEST_DRAFTERS`). A draft model is loaded once, now, and shared by all
    requests' drafters (each keeps its own cache); ``ngram``, ``suffix`` and ``none`` are cheap to build per request
    (the ``suffix`` drafters share one global store of finished requests' outputs: ``suffix_cache``, or a new one).
    Drafters that read the target's features or KV (EAGLE, MTP, Medusa, layer-skip), PARD and ``text:DIR`` load
    their weights (and, given only the target's description, a copy of the target) once, now; each request gets a
    fresh drafter over them.
    The engine says whether it can run them.

    With ``max_num_seqs`` (and ``max_seq_len``, by default the target's ``max_positions``) a configured draft
    model drafts for all requests in shared forwards: ``default`` drafters are
    :class:`~specserve.drafters.batched_model.PooledDraftModelDrafter` of one
    :class:`~specserve.drafters.batched_model.BatchedDraftModel` whose KV pool holds that many requests of that
    many positions (a drafter holds its span from ``start`` to ``release``); with ``static`` options, its forwards
    replay as captured graphs where they fit (:mod:`specserve.core.static.batch_graphs`). A configured PARD model
    (``pard:DIR``) is pooled alike, all requests' blocks in one forward
    (:class:`~specserve.drafters.pard_batch.BatchedPardModel`), and a layer-skip drafter drafts all requests'
    chains in shared forwards over the batched engine's own KV pool
    (:class:`~specserve.drafters.layerskip_batch.BatchedLayerSkip`). Other drafters are unaffected."""
    if max_seq_len is not None and max_num_seqs is None:
        raise ValueError("max_seq_len sizes the draft model's KV pool; give max_num_seqs with it")
    configured: CausalLM | str = spec
    if (
        isinstance(spec, str)
        and spec not in (*BUILTIN_DRAFTERS, MTP_SPEC)
        and not spec.startswith((*PROTOTYPE_PREFIXES, LOOKAHEAD_PREFIX))
    ):
        configured = CausalLM.load(Path(spec), dtype=dtype, device=device)  # a draft model directory: load it once
    batcher: BatchedDraftModel | None = None
    length = target.info.max_positions if max_seq_len is None else max_seq_len
    if max_num_seqs is not None and isinstance(configured, CausalLM):
        batcher = BatchedDraftModel(configured, target, max_num_seqs, length, static=static)
    elif max_num_seqs is not None and isinstance(spec, str) and spec.startswith(LAYERSKIP_PREFIX):
        built = build_drafter(spec, target, dtype=dtype, device=device)  # the early-exit view, checked
        assert isinstance(built, LayerSkipDrafter)
        batcher = BatchedLayerSkip(built.model, built.layers, target)
    elif max_num_seqs is not None and isinstance(spec, str) and spec.startswith(PARD_PREFIX):
        built = build_drafter(spec, target, dtype=dtype, device=device)  # checked as pard:DIR is, then pooled
        assert isinstance(built, PardDrafter)
        batcher = BatchedPardModel(built.model, built.pard_token, target, max_num_seqs, length)
    if suffix_cache is None:
        suffix_cache = SuffixCache()  # the global store every request's suffix drafter shares
    prototype: Prototype | None = None
    if batcher is None and isinstance(spec, str) and (spec == MTP_SPEC or spec.startswith(PROTOTYPE_PREFIXES)):
        built = build_drafter(spec, target, dtype=dtype, device=device, max_ngram=max_ngram, min_ngram=min_ngram)
        assert isinstance(built, Prototype)
        prototype = built  # never drafts itself: each request gets prototype.fresh()

    def new_drafter(name: str) -> Drafter:
        check_drafter_name(name)
        if name == REQUEST_DRAFTERS[0] and batcher is not None:
            return batcher.new_drafter()
        if name == REQUEST_DRAFTERS[0] and prototype is not None:
            return prototype.fresh()
        chosen = configured if name == REQUEST_DRAFTERS[0] else name
        if chosen == "suffix":
            return SuffixDrafter(suffix_cache, device=target.device)
        return build_drafter(chosen, target, dtype=dtype, device=device, max_ngram=max_ngram, min_ngram=min_ngram)

    return new_drafter
