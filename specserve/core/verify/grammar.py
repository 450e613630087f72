"""Structured output: a request's grammar as a matcher over the model's tokens, and what it does to a cycle.

A request with a :class:`~specserve.core.sampling.params.GrammarSpec` (a JSON schema, a regular expression or a Lark
grammar) is decoded as plain *constrained* decoding of the target would decode it: at every position the target's
distribution is masked to the tokens the grammar allows after the text so far, and renormalised. Under speculation
that holds for every verified row, each with its own history (:class:`RequestGrammar`):

* **masks** (:meth:`RequestGrammar.row_masks`): row 0 of a cycle gets the tokens allowed after the committed text,
  row ``i + 1`` those allowed after node ``i``'s root path; the matcher advances along each path and rolls back;
* **cuts** (:meth:`RequestGrammar.prune`): before verification, every node below a token the grammar refuses is
  dropped (the target would never reach it). The refused token itself is dropped too when the proposal is
  deterministic (no q) or the request is decided without q (greedy, drafter-invariant, typical): a refused
  point-mass proposal changes no residual. A refused token *sampled* from a q stays, as a leaf the rules reject
  with certainty, because its rejection is what sends the next token through the residual norm(max(0, p − q));
  emitting from p instead would not be exact (docs/verification.md, "Structured output").

JSON is laid out as ``json.dumps`` lays it out (``", "``, ``": "``, no other whitespace: :data:`JSON_LAYOUT`).
Built on llguidance, whose matchers advance, check (``validate_tokens``) and roll back token by token on the CPU.
:class:`GrammarCompiler` wraps one tokenizer for it (built once) and compiles requests' grammars, refusing a bad
one with llguidance's own words. A grammar is compiled once (:func:`compile_grammar`) and kept, by its spec and
the vocabulary it was compiled for, in a small LRU shared by every compiler of an equal vocabulary (the target's and
a draft model's, say): the edge's check, the verifier and the drafter of one request each get a fresh matcher copied
from that one compiled grammar. :class:`DraftGrammar` lets a drafter propose only what the grammar allows (the
draft model does: its q is then the masked law it samples from). Does not sample or verify.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

try:  # a dependency of the package, but optional where only free text is served (a bare GPU image, say)
    import llguidance
    import llguidance.hf
except ImportError:  # pragma: no cover - llguidance is installed wherever the tests run
    llguidance = None  # type: ignore[assignment]

from specserve.core.draft.drafter import Draft, Proposal
from specserve.core.errors import GrammarFailed, InvalidRequest
from specserve.core.model.causal_lm import ModelInfo
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.tree.shapes import ROOT

# How JSON is laid out: json.dumps' separators and no other whitespace, so that a model cannot pad its output with
# spaces and newlines forever; a schema may choose otherwise with llguidance's "x-guidance" options.
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# A compiled grammar is run this many tokens ahead before any request uses it (:func:`probe`): llguidance builds its
# lexer lazily, so a grammar whose lexer explodes (the regex ``a{1000000}``: "too many expressions constructed")
# compiles and then fails at its first or second token. Probed at the edge, it is a 400 before it reaches a batch.
PROBE_TOKENS = 4


class _DecodedVocabulary:
    """A tokenizer llguidance cannot read itself (a decoder it does not know), as the bytes of each token's own
    decoding: exact for tokenizers whose tokens decode independently (char and byte-level vocabularies)."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        specials = set(tokenizer.all_special_ids)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        size = len(tokenizer)
        self.tokens = [
            b"\xff" + str(tokenizer.convert_ids_to_tokens(i)).encode()
            if i in specials
            else (tokenizer.decode([i]).encode() if i < size else b"")
            for i in range(vocab)
        ]
        self._tokenizer = tokenizer

    def digest(self) -> str:
        """What llguidance reads of this vocabulary (but the encoding of text: see the backend's digest), digested."""
        described = repr((self.eos_token_id, self.bos_token_id, self.special_token_ids, self.tokens))
        return hashlib.sha256(described.encode()).hexdigest()

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


class GrammarCompiler:
    """One tokenizer as llguidance sees it (built once: about a second for a large vocabulary) and the grammars of
    requests compiled against it. ``vocab``: the model's vocabulary (its logits' width), which may exceed the
    tokenizer's."""

    def __init__(self, tokenizer: Any, vocab: int, eos_token_ids: Sequence[int] = ()) -> None:
        if tokenizer is None:
            raise InvalidRequest("structured output needs the model's tokenizer, and this model has none")
        if llguidance is None:  # pragma: no cover - see the import
            raise InvalidRequest("structured output needs the llguidance package: pip install llguidance")
        eos: list[int] = list(eos_token_ids) or [int(tokenizer.eos_token_id)]
        self.eos = frozenset(eos)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
            described: Hashable = ("backend", _backend_digest(tokenizer))
        except ValueError:  # a decoder llguidance does not know: describe the vocabulary by each token's bytes
            decoded = _DecodedVocabulary(tokenizer, vocab)
            wrapper = llguidance.TokenizerWrapper(decoded)
            self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos)
            described = ("decoded", _backend_digest(tokenizer), decoded.digest())
        self.vocab = vocab
        # what the compiled grammars depend on: compilers with equal keys compile equal matchers
        self.key: Hashable = (described, vocab, tuple(eos))

    def compile(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for ``spec``; :class:`InvalidRequest` saying what is wrong with a bad grammar."""
        return RequestGrammar(self._compiled(spec).deep_copy(), self.vocab, self.eos, spec.kind)

    def check(self, spec: GrammarSpec) -> None:
        """Raises :class:`InvalidRequest` for a grammar that does not compile (and keeps one that does)."""
        self._compiled(spec)

    def _compiled(self, spec: GrammarSpec) -> Any:
        """``spec``'s matcher in its initial state, compiled once and kept (never advanced: callers copy it)."""
        key = (self.key, spec)
        with _GRAMMARS_LOCK:
            matcher = _GRAMMARS.get(key)
            if matcher is None:
                matcher = compile_grammar(self.tokenizer, spec)
                probe(matcher, spec.kind, self.eos)
                _GRAMMARS[key] = matcher
                if len(_GRAMMARS) > GRAMMAR_CACHE_SIZE:
                    _GRAMMARS.popitem(last=False)
            else:
                _GRAMMARS.move_to_end(key)
            return matcher


def compile_grammar(tokenizer: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled into an llguidance matcher over ``tokenizer`` (an ``LLTokenizer``); :class:`InvalidRequest`
    saying what is wrong with a bad grammar. The one place a grammar is compiled (:class:`GrammarCompiler` keeps its
    results)."""
    try:
        if spec.kind == "json_schema":
            text = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_LAYOUT)
        elif spec.kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec.source)
        else:
            text = llguidance.LLMatcher.grammar_from_lark(spec.source)
    except ValueError as exc:
        raise InvalidRequest(f"the {spec.kind} grammar is not valid: {one_line(str(exc))}") from exc
    limits = parser_limits()
    error = llguidance.LLMatcher.validate_grammar(text, limits=limits)
    if error:
        raise InvalidRequest(f"the {spec.kind} grammar is not valid: {one_line(error)}")
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if matcher.is_error():
        raise InvalidRequest(f"the {spec.kind} grammar is not valid: {one_line(matcher.get_error())}")
    return matcher


def parser_limits() -> Any:
    """llguidance's own lexer and parser budgets (its defaults: lexer fuel, lexer states, Earley items per step, grammar
    size), stated so they are the same for every matcher, with errors that quote no grammar state."""
    return llguidance.LLParserLimits(verbose_errors=False)


def probe(matcher: Any, kind: str, eos: frozenset[int]) -> None:
    """Run a copy of a freshly compiled ``matcher`` :data:`PROBE_TOKENS` tokens ahead (each time the first token it
    allows that is not an end of text), computing every mask on the way; :class:`InvalidRequest` when llguidance gives
    up on the grammar there. A grammar that fails only later still fails alone at run time
    (:class:`~specserve.core.errors.GrammarFailed`: the request ends, its batch goes on)."""
    ahead = matcher.deep_copy()
    for _ in range(PROBE_TOKENS):
        bias = ahead.compute_logit_bias()
        if ahead.is_error():
            break
        allowed = torch.frombuffer(bytearray(bias), dtype=torch.uint8).nonzero().flatten().tolist()
        token = next((t for t in allowed if t not in eos), None)
        if token is None or not ahead.consume_tokens([token]) or ahead.is_stopped():
            break
    if ahead.is_error():
        raise InvalidRequest(
            f"the {kind} grammar cannot run: {one_line(ahead.get_error())} (llguidance gave up on it within "
            f"{PROBE_TOKENS} tokens); simplify it, e.g. smaller repetition counts"
        )


def _backend_digest(tokenizer: Any) -> Hashable:
    """What llguidance reads of a fast tokenizer (its backend's JSON, as ``llguidance.hf.from_tokenizer`` reads it),
    digested: two tokenizers loaded from equal files (a target's and its draft model's) get equal digests. Any other
    tokenizer gets one of its own, shared with no other."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ("unique", next(_UNIQUE))
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


# Compiled grammars, oldest use first, by (compiler key, spec): a request's grammar is compiled once for all who use
# it (the edge's check, the verifier, a draft model's drafter), and a spec many requests send is compiled once.
GRAMMAR_CACHE_SIZE = 64
_GRAMMARS: OrderedDict[tuple[Hashable, GrammarSpec], Any] = OrderedDict()
_GRAMMARS_LOCK = threading.Lock()
_UNIQUE = itertools.count()


def one_line(error: str) -> str:
    """llguidance's error report in one line: its first line and every line that names an error (no source
    excerpts, no carets)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if "error" in line.lower()]
    return " ".join(kept)


_COMPILERS: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab: int, eos_token_ids: Sequence[int] = ()) -> GrammarCompiler:
    """The (cached) compiler of ``tokenizer``'s grammars."""
    if tokenizer is None:
        raise InvalidRequest("structured output needs the model's tokenizer, and this model has none")
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(tokenizer)
        if compiler is None or compiler.vocab != vocab:
            compiler = _COMPILERS[tokenizer] = GrammarCompiler(tokenizer, vocab, eos_token_ids)
        return compiler


def request_grammar(params: SamplingParams, tokenizer: Any, info: ModelInfo) -> RequestGrammar | None:
    """The request's grammar compiled for the model ``info`` describes and its ``tokenizer``; ``None`` for free
    text."""
    if params.grammar is None:
        return None
    return compiler_for(tokenizer, info.vocab_size, info.eos_token_ids).compile(params.grammar)


class RequestGrammar:
    """One request's matcher, kept at the end of its committed text (:meth:`advance`)."""

    def __init__(self, matcher: Any, vocab: int, eos_token_ids: frozenset[int], kind: str = "grammar") -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.eos = eos_token_ids
        self.kind = kind

    def _check(self) -> None:
        """:class:`GrammarFailed` once llguidance has given up on the grammar (a budget it ran out of, mid-text)."""
        if self.matcher.is_error():
            raise GrammarFailed(
                f"the {self.kind} grammar failed while generating: {one_line(self.matcher.get_error())}; simplify it"
            )

    def advance(self, tokens: Sequence[int]) -> None:
        """The committed text grew by ``tokens`` (each allowed where it stands: the masks made sure). An end of
        text, which the masks allow only where the grammar is satisfied and which ends the request, is not fed to
        the matcher (a finished matcher refuses it)."""
        text = [int(t) for t in tokens if int(t) not in self.eos]
        if text and not self.matcher.consume_tokens(text):
            self._check()
            raise RuntimeError(f"the grammar refused committed tokens: {self.matcher.get_error()}")

    def allowed(self) -> torch.Tensor:  # [vocab] bool
        """The tokens the grammar allows next."""
        bias = self.matcher.compute_logit_bias()
        self._check()
        mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8)
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        allowed[: mask.numel()] = mask[: self.vocab] > 0
        return allowed

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows after the committed text."""
        if not tokens:
            return 0
        valid = int(self.matcher.validate_tokens([int(t) for t in tokens]))
        self._check()
        return valid

    def prune(self, proposal: Proposal, keep_refused: bool) -> tuple[Proposal, list[int]]:
        """``proposal`` without the nodes below a token the grammar refuses (and without that token unless
        ``keep_refused``), and the kept nodes' indices in ``proposal``."""
        tokens = proposal.tokens.tolist()
        if isinstance(proposal, Draft):
            valid = self.valid_prefix(tokens)
            keep = min(valid + 1, len(tokens)) if keep_refused else valid
            return proposal.truncate(keep), list(range(keep))
        paths = proposal.paths
        kept = []
        valid_nodes: set[int] = set()
        for node, parent in enumerate(proposal.parents):
            if parent != ROOT and parent not in valid_nodes:
                continue  # below a refused token (or below a dropped node)
            path = [tokens[i] for i in paths[node]]
            if self.valid_prefix(path) == len(path):
                valid_nodes.add(node)
                kept.append(node)
            elif keep_refused:
                kept.append(node)
        if len(kept) == proposal.size:
            return proposal, kept
        return proposal.keep(kept), kept

    def row_masks(self, tokens: torch.Tensor, parents: Sequence[int]) -> torch.Tensor:
        """[n + 1, vocab] bool: row 0 the tokens allowed after the committed text, row ``i + 1`` those allowed after
        node ``i``'s root path (every token, when that path leaves the grammar: such a row is never read)."""
        ids = tokens.tolist()
        rows = [self.allowed()]
        paths: list[list[int]] = []
        for node, parent in enumerate(parents):
            path = [*(paths[parent] if parent != ROOT else []), int(ids[node])]
            paths.append(path)
            if self.valid_prefix(path) < len(path):
                rows.append(torch.ones(self.vocab, dtype=torch.bool))
                continue
            if not self.matcher.consume_tokens(path):
                self._check()
            rows.append(self.allowed())
            self.matcher.rollback(len(path))
        return torch.stack(rows)


class DraftGrammar:
    """A drafter's view of the request's grammar: the matcher kept at the end of the drafter's own context (which
    it may rewind) plus the tokens drafted so far this cycle, so a drafter can propose only what the grammar
    allows (:meth:`allowed`) — its q is then the masked law it really samples from, and the rules stay exact. The
    context's first ``output_start`` tokens are the prompt (a resumed request's earlier output counts as output)."""

    def __init__(self, grammar: RequestGrammar, output_start: int) -> None:
        self.grammar = grammar
        self.output_start = output_start
        self.matched: list[int] = []  # the output tokens the matcher has consumed (ends of text excluded)
        self.drafted = 0  # tokens consumed on top of them this cycle

    @classmethod
    def of(cls, params: SamplingParams, tokenizer: Any, info: ModelInfo, prompt_length: int) -> DraftGrammar | None:
        """The drafter's grammar for a request (``None`` without one, or when the drafter has no tokenizer)."""
        if params.grammar is None or tokenizer is None:
            return None
        grammar = request_grammar(params, tokenizer, info)
        assert grammar is not None
        return cls(grammar, prompt_length - min(params.prior_output_tokens, prompt_length))

    def sync(self, context: Sequence[int]) -> None:
        """Bring the matcher to the end of ``context`` (prompt + committed output), dropping this cycle's drafts."""
        self.rewind_drafts()
        output = [int(t) for t in context[self.output_start :] if int(t) not in self.grammar.eos]
        keep = 0
        while keep < min(len(self.matched), len(output)) and self.matched[keep] == output[keep]:
            keep += 1
        if keep < len(self.matched):
            self.grammar.matcher.rollback(len(self.matched) - keep)
        self.grammar.advance(output[keep:])
        self.matched = output

    def allowed(self) -> torch.Tensor:  # [vocab] bool
        return self.grammar.allowed()

    def push(self, token: int) -> bool:
        """Draft ``token`` (one :meth:`allowed` holds); False once the text is over (an end of text or a finished
        grammar): nothing can follow."""
        if int(token) in self.grammar.eos:
            return False
        self.grammar.advance([int(token)])
        self.drafted += 1
        return not self.grammar.matcher.is_stopped()

    def rewind_drafts(self) -> None:
        if self.drafted:
            self.grammar.matcher.rollback(self.drafted)
            self.drafted = 0


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token ``allowed`` does not hold set to minus infinity."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


__all__ = [
    "DraftGrammar",
    "GrammarCompiler",
    "RequestGrammar",
    "compile_grammar",
    "compiler_for",
    "mask_logits",
    "request_grammar",
]
