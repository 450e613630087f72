"""``specserve generate``: one prompt through the in-process engine or a distributed replica, printed.

The flags are the replica's settings (made from the fields of
:class:`~specserve.cluster.replica_config.ReplicaConfig`), the request's sampling and generation
options, and the draft-tree shape. Without ``--distributed`` the target and the drafter run in this
process (:class:`~specserve.core.engine.SpeculativeEngine`); with it, a replica of Ray actors does
(:class:`~specserve.actors.coordinator.Coordinator`, imported only then). Both are a
:class:`~specserve.core.engine.GenerationFrontend` and print the same way: streamed text with a
summary line on stderr, or one JSON object.

This module sits at the command line's layer, since it imports the engine and the actors alike;
:mod:`specserve.cli` registers it. It does not serve HTTP (``specserve serve``) or benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve import defaults
from specserve.cluster.replica_config import DISTRIBUTED_SETTINGS, MODEL_SETTINGS, ReplicaConfig
from specserve.core.draft.schedule import MAX_GAMMA, POLICY_NAMES
from specserve.core.draft.spec_strings import suggested_gamma
from specserve.core.errors import UserError
from specserve.core.sampling.params import TYPICAL_DELTA, TYPICAL_EPSILON, GrammarSpec, SamplingParams
from specserve.core.tree.shapes import InvalidTree, TreeBudget, TreeSpec, TreeTopology

if TYPE_CHECKING:  # the engine and the actors load torch: imported once the arguments are checked
    from specserve.actors.coordinator import Coordinator
    from specserve.core.engine import GenerationFrontend, SpeculativeEngine
    from specserve.core.request import GenerationConfig, GenerationResult


class UnsetInt(int):
    """An option's default that help shows as the number it is, and that the command can tell from the same number
    typed on the command line (argparse gives those as plain ``int``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ReplicaConfig.add_arguments(parser, MODEL_SETTINGS)
    parser.add_argument(
        "--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS, help="tokens to generate at most"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument(
        "--compare-plain",
        action="store_true",
        help="then run the same request without drafting and report the speedup (and whether the tokens match)",
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="UTF-8 text file whose whole content is the prompt")
    parser.add_argument(
        "--gamma",
        type=int,
        default=UnsetInt(defaults.DEFAULT_GAMMA),
        help=f"draft tokens per cycle (1..{MAX_GAMMA}); without it, a speculators-format head's own suggestion",
    )
    parser.add_argument(
        "--policy",
        choices=list(POLICY_NAMES),
        default="fixed",
        help="how much to draft each cycle: --gamma (or --tree) every cycle, transformers' +2/-1 schedule "
        "from --gamma, or the γ that maximises predicted tokens/s from online estimates (0 = plain decoding)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                        "whose probability reaches top-p (1 = off)")  # fmt: skip
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed of a sampled request: the same seed, the same output"
    )
    parser.add_argument(
        "--drafter-invariant",
        action="store_true",
        help="tokens = argmax(log p + Gumbel noise keyed by (seed, position)): the same output for a seed whatever "
        "the drafter, gamma or tree (exact, fewer drafts accepted); no effect at temperature 0",
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    processors = parser.add_argument_group(
        "penalties, biases and logprobs (exact under speculation: every drafted position is processed with its own "
        "history)"
    )
    processors.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    processors.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    processors.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="transformers' and vLLM's, over prompt and output, in (0, 10] (1 = off)",
    )
    processors.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit at every position (repeatable)",
    )
    processors.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens less likely than min-p times the most likely (0 = off)"
    )
    processors.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="report every output token's log-probability and its K most likely alternatives (0 to 20; with --json)",
    )
    processors.add_argument(
        "--logprobs-mode",
        choices=["raw", "processed"],
        default="raw",
        help="logprobs of the model's own distribution (raw) or of the one each token was chosen from (processed)",
    )
    formats = parser.add_argument_group(
        "structured output (exact under speculation: drafts are cut where they leave the grammar); at most one"
    ).add_mutually_exclusive_group()
    formats.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    formats.add_argument("--json-schema", metavar="FILE", help="the output is JSON following the schema in FILE")
    formats.add_argument("--regex", metavar="PATTERN", help="the output matches the regular expression PATTERN")
    formats.add_argument("--lark", metavar="FILE", help="the output follows the Lark grammar in FILE (llguidance's)")
    lossy = parser.add_argument_group(
        "lossy acceptance (NOT exact: the output is no longer distributed as the target's)"
    )
    lossy.add_argument(
        "--typical-acceptance",
        action="store_true",
        help="Medusa's typical acceptance: accept a draft token x when p(x) > min(epsilon, delta * exp(-H(p))); "
        "needs --lossy; the output then says lossy true",
    )
    lossy.add_argument(
        "--typical-epsilon", type=float, default=TYPICAL_EPSILON, help="typical acceptance: epsilon, in (0, 1)"
    )
    lossy.add_argument(
        "--typical-delta", type=float, default=TYPICAL_DELTA, help="typical acceptance: delta, in (0, 1]"
    )
    lossy.add_argument("--lossy", action="store_true", help="allow a lossy acceptance rule (--typical-acceptance)")
    trees = parser.add_argument_group("draft trees (exact at any temperature; in process or --distributed)")
    trees.add_argument("--tree", choices=["chain", "static", "dynamic"], default="chain", help="draft shape")
    trees.add_argument("--tree-depth", type=int, default=4, help="dynamic: levels below the root")
    trees.add_argument("--tree-width", type=int, default=2, help="dynamic: children per expanded node")
    trees.add_argument("--tree-nodes", type=int, default=8, help="dynamic: nodes verified per cycle")
    trees.add_argument(
        "--tree-expand",
        type=int,
        help="dynamic: nodes expanded per level (default: --tree-width; 1 = cheapest drafting)",
    )
    trees.add_argument(
        "--tree-topology", help="static: JSON file with a list of index paths, e.g. [[0], [1], [0, 0]] (Medusa form)"
    )
    dist = parser.add_argument_group("distributed (Ray actors, gRPC draft streams, tensor-parallel target)")
    dist.add_argument("--distributed", action="store_true", help="run through a target replica and drafter actor")
    ReplicaConfig.add_arguments(dist, DISTRIBUTED_SETTINGS)
    dist.add_argument(
        "--ray-address",
        help="Ray cluster to join (default: the `specserve cluster up` cluster if running, else a private local one)",
    )


def run_command(args: argparse.Namespace) -> int:
    """Check every argument, the prompt and the models' paths (no torch yet: a mistake is reported at once), then
    load and generate."""
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    args.gamma = chosen_gamma(args.gamma, args.draft)
    if not 1 <= args.gamma <= MAX_GAMMA:
        raise UserError(f"--gamma must be between 1 and {MAX_GAMMA}, got {args.gamma}")
    if not args.distributed and (args.tp_degree != 1 or args.overlap or args.drafter_placement != "colocated"):
        raise UserError("--tp, --drafter-placement and --overlap need --distributed")
    if args.distributed and args.static_shapes == "on":
        raise UserError("--static-shapes on runs in process only; leave out --distributed or --static-shapes")
    params = sampling_params(args)
    tree = tree_spec(args)
    prompt = read_prompt(args)
    if not prompt:
        raise UserError("the prompt is empty; pass some text with --prompt or --prompt-file")
    replica = ReplicaConfig.from_args(args)
    replica.check_local_models()

    from specserve.core.request import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, gamma=args.gamma, stop=tuple(args.stop), tree=tree, policy=args.policy
    )
    if args.distributed:
        with distributed_runner(replica, args.ray_address) as coordinator:
            return print_generation(coordinator, prompt, params, config, args.json, args.compare_plain)
    return print_generation(build_engine(replica), prompt, params, config, args.json, args.compare_plain)


def chosen_gamma(gamma: int, draft: str) -> int:
    """``--gamma`` as typed; when it was not (its :class:`UnsetInt` default), what the ``--draft`` head's publisher
    suggests (a speculators-format head's ``speculative_tokens``, capped at ``MAX_GAMMA``), else the default."""
    if not isinstance(gamma, UnsetInt):
        return gamma
    suggested = suggested_gamma(draft)
    return int(gamma) if suggested is None else suggested


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as :class:`SamplingParams` (which checks their ranges)."""
    named = (
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "drafter_invariant",
        "lossy",
        "typical_epsilon",
        "typical_delta",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "logprobs",
        "logprobs_mode",
    )
    return SamplingParams(
        acceptance="typical" if args.typical_acceptance else "exact",
        logit_bias=logit_bias(args.logit_bias),
        grammar=grammar_spec(args),
        **{name: getattr(args, name) for name in named},
    )


def grammar_spec(args: argparse.Namespace) -> GrammarSpec | None:
    """The structured output the flags ask for; ``None`` for free text."""
    if args.json_object:
        return GrammarSpec.json_object()
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    if args.lark is not None:
        return GrammarSpec("lark", read_flag_file("--lark", args.lark))
    if args.json_schema is not None:
        text = read_flag_file("--json-schema", args.json_schema)
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"--json-schema {args.json_schema} is not JSON: {exc}") from exc
        return GrammarSpec("json_schema", text)
    return None


def read_flag_file(flag: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc


def logit_bias(pairs: Sequence[str]) -> tuple[tuple[int, float], ...]:
    """``--logit-bias ID=BIAS`` flags as sorted pairs; a malformed one is a :class:`UserError` saying what to write."""
    bias: dict[int, float] = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UserError(f"--logit-bias takes ID=BIAS, e.g. --logit-bias 50256=-100; got {pair!r}") from None
    return tuple(sorted(bias.items()))


def tree_spec(args: argparse.Namespace) -> TreeSpec | None:
    """The draft shape the tree flags ask for; ``None`` for a chain."""
    if args.tree == "chain":
        if args.tree_topology:
            raise UserError("--tree-topology needs --tree static")
        return None
    try:
        if args.tree == "dynamic":
            budget = TreeBudget(args.tree_depth, args.tree_width, args.tree_nodes, args.tree_expand)
            return TreeSpec("dynamic", budget=budget)
        if not args.tree_topology:
            raise UserError("--tree static needs --tree-topology FILE (a JSON list of index paths)")
        path = Path(args.tree_topology)
        try:
            paths = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read the tree topology {path}: {exc}") from exc
        if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
            raise UserError(f"{path} must hold a JSON list of index paths, e.g. [[0], [1], [0, 0]]")
        return TreeSpec("static", topology=TreeTopology.from_lists(paths))
    except (InvalidTree, ValueError, TypeError) as exc:  # a malformed topology or budget
        raise UserError(f"bad tree options: {exc}") from exc


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return str(args.prompt)
    path = Path(args.prompt_file)
    if path.is_dir():
        raise UserError(f"prompt file {path} is a directory; pass a text file")
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"prompt file {path} is not UTF-8 text: {exc}") from exc


def build_engine(config: ReplicaConfig) -> SpeculativeEngine:
    """The target and the drafter of ``config`` in this process, with every γ policy available."""
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.model.causal_lm import CausalLM
    from specserve.drafters import build_drafter_set
    from specserve.policies.schedules import schedules

    target = CausalLM.load(config.target, dtype=config.dtype, device=config.device)
    drafter = build_drafter_set(config.draft, target, **config.drafter_options())  # a request may also ask for none
    static = config.static_options()
    if static is None:
        return SpeculativeEngine(target, drafter, schedules=schedules())
    static = static.resolve(target.device.type)  # the policy prices each width at its bucket's cost
    return SpeculativeEngine(target, drafter, schedules=schedules(buckets=static.buckets), static=static)


@contextlib.contextmanager
def distributed_runner(config: ReplicaConfig, ray_address: str | None) -> Iterator[Coordinator]:
    """A replica of ``config`` on Ray (joined as :func:`~specserve.cluster.connect.connect_ray` says), shut down
    on exit."""
    from specserve.actors.coordinator import Coordinator
    from specserve.cluster.connect import connect_ray

    with connect_ray(ray_address, tp_degree=config.tp_degree, spec=config.spec()):
        coordinator = Coordinator.spawn(config)
        try:
            yield coordinator
        finally:
            coordinator.shutdown()


def print_generation(
    runner: GenerationFrontend,
    prompt: str,
    params: SamplingParams,
    config: GenerationConfig,
    as_json: bool,
    compare_plain: bool = False,
) -> int:
    """Print one generation: one JSON object, or the text as it streams and a summary line on stderr. With
    ``compare_plain`` the same request then runs without drafting, and the speedup is reported (a ``plain`` object
    in the JSON, one more line on stderr), after a short warm-up run so that neither side pays first-call costs."""
    if compare_plain:
        runner.generate(prompt, params, dataclasses.replace(config, max_new_tokens=min(8, config.max_new_tokens)))
    if as_json:
        result = runner.generate(prompt, params, config)
        report = {
            "prompt_ids": result.prompt_ids,
            "output_ids": result.output_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "sampling": params.mode,
            "lossy": params.lossy_acceptance,  # true: a lossy acceptance rule ran (not the target's law)
            "stats": result.stats.to_dict(),
        }
        if result.logprobs is not None:
            report["logprobs"] = [
                {"token": entry.token, "logprob": entry.logprob, "top": [list(pair) for pair in entry.top]}
                for entry in result.logprobs
            ]
        if compare_plain:
            report["plain"] = plain_comparison(runner, prompt, params, config, result)
        print(json.dumps(report))
        return 0
    final: GenerationResult | None = None
    for chunk in runner.stream(prompt, params, config):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.result is not None:
            final = chunk.result
            s = final.stats
            print(
                f"\n[{s.new_tokens} tokens, {s.cycles} cycles, mean accepted {s.mean_accepted:.2f}, "
                f"{s.tokens_per_second:.1f} tok/s, finish={final.finish_reason}, "
                f"lossy={'true' if params.lossy_acceptance else 'false'}]",
                file=sys.stderr,
            )
    if compare_plain and final is not None:
        print(comparison_line(plain_comparison(runner, prompt, params, config, final)), file=sys.stderr)
    return 0


def plain_comparison(
    runner: GenerationFrontend,
    prompt: str,
    params: SamplingParams,
    config: GenerationConfig,
    speculative: GenerationResult,
) -> dict[str, Any]:
    """The same request without drafting (drafter ``none``) on the same runner: its speed, the speedup, and whether
    the tokens are identical (they must be when greedy; sampled runs draw differently unless drafter-invariant)."""
    plain = runner.generate(prompt, params, dataclasses.replace(config, drafter="none"))
    speedup = speculative.stats.tokens_per_second / plain.stats.tokens_per_second
    return {
        "tokens_per_second": plain.stats.tokens_per_second,
        "speculative_tokens_per_second": speculative.stats.tokens_per_second,
        "speedup": speedup,
        "identical": plain.output_ids == speculative.output_ids,
        "greedy": params.greedy,
    }


def comparison_line(plain: dict[str, Any]) -> str:
    same = "identical output" if plain["identical"] else "different sample (same distribution)"
    if plain["greedy"] and not plain["identical"]:
        same = "OUTPUT DIFFERS (a bug: please report it)"
    return (
        f"[speculative {plain['speculative_tokens_per_second']:.1f} tok/s vs plain decoding "
        f"{plain['tokens_per_second']:.1f} tok/s: {plain['speedup']:.2f}x, {same}]"
    )
