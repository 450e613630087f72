"""Structured output and logprobs under speculation: what a grammar keeps of each drafter's speedup, what it costs.

    OMP_NUM_THREADS=1 python bench/structured.py [--rounds 2] [--max-new-tokens 96] [--out bench/results]

The shipped pair (float32, one thread) generates JSON for a small set of schemas (bounded strings, integers,
enums, arrays, nested objects; ``additionalProperties: false``) after code-like prompts, with plain decoding and
with each drafter (the draft model at γ 3, n-gram, suffix), greedy and at T = 1, twice: free (no grammar) and
constrained by the schema. For each drafter it reports tokens/s and the speedup over plain decoding *under the same
constraint*, and the share of the free speedup that the constrained run keeps (the issue's target: ≥ 80 %). The
grammar's own cost is timed inside the verifier (cutting proposals, masking rows, advancing the matcher) and
reported per committed token, and logprobs' cost as the throughput of the draft model with 5 alternatives per
token against without. Rounds alternate their order (machine speed drifts on a shared host). Writes
``structured.json`` and ``structured.md``; prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specserve import defaults
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.verify.grammar import RequestGrammar
from specserve.drafters.registry import build_drafter_set

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer", "maximum": 9999}},
        "required": ["name", "size"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "level": {"enum": ["debug", "info", "warning", "error"]},
            "message": {"type": "string", "maxLength": 24},
            "retry": {"type": "boolean"},
        },
        "required": ["level", "message", "retry"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "imports": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "lines": {"type": "integer", "minimum": 0, "maximum": 500},
        },
        "required": ["imports", "lines"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "function": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                },
                "required": ["name", "args"],
                "additionalProperties": False,
            },
            "returns": {"type": "string", "maxLength": 12},
        },
        "required": ["function", "returns"],
        "additionalProperties": False,
    },
}
PROMPTS = ["config = json.loads('", "def describe(self):\n    return ", "# the result as JSON:\nresult = "]
DRAFTERS = {
    "plain": ("none", 0),
    "draft model γ3": ("default", 3),
    "ngram γ4": ("ngram", 4),
    "suffix γ4": ("suffix", 4),
}


@dataclass
class Cell:
    tokens: int = 0
    seconds: float = 0.0
    grammar_seconds: float = 0.0
    accepted: int = 0
    cycles: int = 0
    valid: int = 0
    finished: int = 0
    requests: int = 0
    per_round: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class GrammarClock:
    """Time spent in the verifier's grammar work (cut, masks, advance), by patching RequestGrammar's methods."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def installed(self) -> Iterator[None]:
        names = ("prune", "row_masks", "advance")
        originals = {name: getattr(RequestGrammar, name) for name in names}

        def timed(method: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            return run

        for name, method in originals.items():
            setattr(RequestGrammar, name, timed(method))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(RequestGrammar, name, method)


def run_cell(
    engine: SpeculativeEngine,
    cell: Cell,
    drafter: str,
    gamma: int,
    temperature: float,
    constrained: bool,
    max_new_tokens: int,
    logprobs: int | None = None,
) -> None:
    clock = GrammarClock()
    start_tokens, start_seconds = cell.tokens, cell.seconds
    with clock.installed():
        for s, (name, schema) in enumerate(SCHEMAS.items()):
            for p, prompt in enumerate(PROMPTS):
                grammar = GrammarSpec("json_schema", json.dumps(schema)) if constrained else None
                params = SamplingParams(temperature=temperature, seed=17 * s + p, grammar=grammar, logprobs=logprobs)
                config = GenerationConfig(max_new_tokens, max(gamma, 1) if gamma else 0, drafter=drafter)
                begin = time.perf_counter()
                out = engine.generate(prompt, params, config)
                cell.seconds += time.perf_counter() - begin
                cell.tokens += len(out.output_ids)
                cell.accepted += out.stats.accepted_tokens
                cell.cycles += out.stats.cycles
                cell.requests += 1
                if constrained and out.finish_reason == "eos":
                    cell.finished += 1
                    try:
                        json.loads(out.text)
                        cell.valid += 1
                    except json.JSONDecodeError:
                        raise AssertionError(f"{name}: finished, not JSON: {out.text!r}") from None
    cell.grammar_seconds += clock.seconds
    cell.per_round.append((cell.tokens - start_tokens) / max(cell.seconds - start_seconds, 1e-9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--out", type=Path, default=Path("runs/structured"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = CausalLM.load(defaults.DEFAULT_TARGET, dtype="float32")
    engine = SpeculativeEngine(target, build_drafter_set(str(defaults.DEFAULT_DRAFT), target))
    engine.generate("x = 1", SamplingParams(), GenerationConfig(8, 3))  # warm-up

    keys = [(d, t, c) for t in args.temperatures for d in DRAFTERS for c in (False, True)]
    keys += [("draft model γ3", t, "logprobs") for t in args.temperatures]
    cells: dict[tuple[str, float, object], Cell] = {key: Cell() for key in keys}
    for round_index in range(args.rounds):
        order = keys if round_index % 2 == 0 else keys[::-1]
        for name, temperature, mode in order:
            drafter, gamma = DRAFTERS[name]
            constrained = mode is True
            logprobs = 5 if mode == "logprobs" else None
            run_cell(engine, cells[(name, temperature, mode)], drafter, gamma, temperature, constrained,
                     args.max_new_tokens, logprobs)  # fmt: skip
            print(f"round {round_index}: {name} T={temperature} {mode}: "
                  f"{cells[(name, temperature, mode)].per_round[-1]:.1f} tok/s", flush=True)  # fmt: skip

    rows = []
    for temperature in args.temperatures:
        plain_free = cells[("plain", temperature, False)].tokens_per_second
        plain_bound = cells[("plain", temperature, True)].tokens_per_second
        for name in DRAFTERS:
            free, bound = cells[(name, temperature, False)], cells[(name, temperature, True)]
            free_speedup = free.tokens_per_second / plain_free
            bound_speedup = bound.tokens_per_second / plain_bound
            rows.append({
                "drafter": name, "temperature": temperature,
                "free_tok_s": free.tokens_per_second, "constrained_tok_s": bound.tokens_per_second,
                "free_speedup": free_speedup, "constrained_speedup": bound_speedup,
                "kept": (bound_speedup - 1) / (free_speedup - 1) if free_speedup > 1.0 else None,
                "constrained_mean_accepted": bound.accepted / max(bound.cycles, 1),
                "free_mean_accepted": free.accepted / max(free.cycles, 1),
                "grammar_ms_per_token": 1e3 * bound.grammar_seconds / max(bound.tokens, 1),
                "grammar_share": bound.grammar_seconds / max(bound.seconds, 1e-9),
                "finished_json": f"{bound.valid}/{bound.requests}",
            })  # fmt: skip
    logprob_rows = []
    for temperature in args.temperatures:
        without = cells[("draft model γ3", temperature, False)]
        with_lp = cells[("draft model γ3", temperature, "logprobs")]
        logprob_rows.append({
            "temperature": temperature, "without_tok_s": without.tokens_per_second,
            "with_tok_s": with_lp.tokens_per_second,
            "cost": 1 - with_lp.tokens_per_second / without.tokens_per_second,
            "rounds_without": without.per_round, "rounds_with": with_lp.per_round,
        })  # fmt: skip
    report = {
        "threads": 1, "dtype": "float32", "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
        "schemas": list(SCHEMAS), "prompts": PROMPTS, "drafters": rows, "logprobs": logprob_rows,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(report, indent=2))
    markdown = render(report)
    (args.out / "structured.md").write_text(markdown)
    print(markdown)


def render(report: dict[str, Any]) -> str:
    lines = [
        f"{len(report['schemas'])} schemas x {len(report['prompts'])} prompts, {report['max_new_tokens']} new tokens"
        f" at most, {report['rounds']} rounds, {report['threads']} thread, {report['dtype']}.",
        "",
        "| drafter | T | free tok/s | constrained tok/s | free speedup | constrained speedup | kept | mean accepted"
        " free / constrained | grammar ms/token (share) | finished JSON |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["drafters"]:
        kept = f"{100 * r['kept']:.0f} %" if r["kept"] is not None else "—"
        lines.append(
            f"| {r['drafter']} | {r['temperature']:g} | {r['free_tok_s']:.1f} | {r['constrained_tok_s']:.1f} |"
            f" {r['free_speedup']:.2f}x | {r['constrained_speedup']:.2f}x | {kept} |"
            f" {r['free_mean_accepted']:.2f} / {r['constrained_mean_accepted']:.2f} |"
            f" {r['grammar_ms_per_token']:.3f} ({100 * r['grammar_share']:.1f} %) | {r['finished_json']} |"
        )
    lines += [
        "",
        "| logprobs (5 alternatives), draft model γ3 | T | without tok/s | with tok/s | cost |",
        "|---|---|---|---|---|",
    ]
    for r in report["logprobs"]:
        lines.append(
            f"| | {r['temperature']:g} | {r['without_tok_s']:.1f} | {r['with_tok_s']:.1f} | {100 * r['cost']:.1f} % |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
