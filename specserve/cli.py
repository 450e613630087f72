"""The ``specserve`` command line: ``generate``, ``bench``, ``train`` and ``cluster``.

Every failure the user can fix (a missing model directory, mismatched vocabularies, an empty
prompt, an out-of-range parameter) is reported as one ``error: ...`` line on stderr with exit
status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from specserve import defaults
from specserve.core.errors import UserError

N = TypeVar("N", int, float)
TRAINABLE = ("pair", "eagle", "medusa", "exit-head")
DRAFT_PREFIX = {"eagle": "eagle:", "medusa": "medusa:", "exit-head": "layerskip:"}  # how --draft loads each head


class UsageError(UserError):
    """A command-line value the user must change."""


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(defaults.DEFAULT_TARGET), help="target model directory (HF checkpoint)")
    parser.add_argument(
        "--draft",
        default=str(defaults.DEFAULT_DRAFT),
        help="draft model directory, 'ngram' (prompt lookup), 'layerskip:L' (the target's first L layers) or "
        "'layerskip:DIR' (with a trained exit head), 'eagle:DIR' or 'medusa:DIR' (trained heads), or 'none'",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--ngram-max", type=int, default=3, help="longest n-gram the ngram drafter matches")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram the ngram drafter matches")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt with speculative decoding")
    _add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="file whose whole content is the prompt")
    gen.add_argument("--gamma", type=int, default=defaults.DEFAULT_GAMMA, help="draft tokens per cycle (1..64)")
    gen.add_argument(
        "--policy",
        choices=["fixed", "heuristic", "adaptive"],
        default="fixed",
        help="how much to draft each cycle: --gamma (or --tree) every cycle, transformers' +2/-1 schedule "
        "from --gamma, or the γ that maximises predicted tokens/s from online estimates (0 = plain decoding)",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--drafter-invariant",
        action="store_true",
        help="tokens = argmax(log p + Gumbel noise keyed by (seed, position)): the same output for a seed whatever "
        "the drafter, gamma or tree (exact, fewer drafts accepted); no effect at temperature 0",
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    lossy = gen.add_argument_group("lossy acceptance (NOT exact: the output is no longer distributed as the target's)")
    lossy.add_argument(
        "--typical-acceptance",
        action="store_true",
        help="Medusa's typical acceptance: accept a draft token x when p(x) > min(epsilon, delta * exp(-H(p))); "
        "needs --lossy; the output then says lossy true",
    )
    lossy.add_argument("--typical-epsilon", type=float, default=0.09, help="typical acceptance: epsilon, in (0, 1)")
    lossy.add_argument("--typical-delta", type=float, default=0.3, help="typical acceptance: delta, in (0, 1]")
    lossy.add_argument("--lossy", action="store_true", help="allow a lossy acceptance rule (--typical-acceptance)")
    trees = gen.add_argument_group("draft trees (exact at any temperature; in process or --distributed)")
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
    dist = gen.add_argument_group("distributed (Ray actors, gRPC draft streams, tensor-parallel target)")
    dist.add_argument("--distributed", action="store_true", help="run through a target replica and drafter actor")
    dist.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the target replica (1, 2, 4, ...)")
    dist.add_argument(
        "--drafter-placement",
        choices=["colocated", "separate"],
        default="colocated",
        help="drafter in the target's placement group, or on a node with the 'cheap' resource",
    )
    dist.add_argument("--overlap", action="store_true", help="draft the next tree while the target verifies")
    dist.add_argument(
        "--ray-address",
        help="Ray cluster to join (default: the `specserve cluster up` cluster if running, else a private local one)",
    )
    dist.add_argument("--threads-per-shard", type=int, default=1, help="torch threads in each target shard actor")
    dist.add_argument("--threads-per-drafter", type=int, default=1, help="torch threads in the drafter actor")

    bench = sub.add_parser("bench", help="benchmark speculative decoding against plain decoding and transformers")
    _add_model_args(bench)
    bench.add_argument("--prompts", help="JSON file with a list of prompt strings (default: held-out stdlib files)")
    bench.add_argument("--num-prompts", type=int, default=20)
    bench.add_argument("--gammas", default="1,2,3,4,5,6,7,8", help="comma-separated gammas for the draft model")
    bench.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    bench.add_argument("--out", default="bench/results", help="directory for speculative.json/.png/.md")
    bench.add_argument("--quick", action="store_true", help="fewer configurations (for smoke tests)")

    tbench = sub.add_parser("bench-trees", help="draft chains vs static vs dynamic trees at equal verified nodes")
    _add_model_args(tbench)
    tbench.add_argument("--prompts", help="JSON file with a list of prompt strings (default: held-out stdlib files)")
    tbench.add_argument("--num-prompts", type=int, default=8)
    tbench.add_argument("--ks", default="4,8,16,32", help="comma-separated draft nodes verified per cycle")
    tbench.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    tbench.add_argument("--rounds", type=int, default=2, help="rounds over every configuration, order alternating")
    tbench.add_argument("--out", default="bench/results", help="directory for trees.json/.png/.md")

    lbench = sub.add_parser("bench-drafters", help="every drafter (draft model, EAGLE, Medusa, layer-skip, n-gram, HF)")
    lbench.add_argument("--target", default=str(defaults.DEFAULT_TARGET))
    lbench.add_argument("--draft", default=str(defaults.DEFAULT_DRAFT), help="the small draft model directory")
    lbench.add_argument("--eagle", default=str(defaults.MODELS_DIR / "eagle"), help="trained EAGLE head directory")
    lbench.add_argument("--medusa", default=str(defaults.MODELS_DIR / "medusa"), help="trained Medusa heads directory")
    lbench.add_argument("--exit-head", default=str(defaults.MODELS_DIR / "exit-head"), help="trained exit head dir")
    lbench.add_argument("--prompts", help="JSON file with a list of prompt strings (default: held-out stdlib files)")
    lbench.add_argument("--num-prompts", type=int, default=6)
    lbench.add_argument("--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS)
    lbench.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    lbench.add_argument("--rounds", type=int, default=2, help="rounds over every cell, order alternating")
    lbench.add_argument("--gamma", type=int, default=4, help="γ of the chains")
    lbench.add_argument("--out", default="bench/results", help="directory for drafters.json/.md/.png")
    lbench.add_argument("--json", action="store_true", help="print only the JSON headline, not the table")

    dbench = sub.add_parser("bench-distributed", help="in-process engine vs distributed runtime (greedy)")
    dbench.add_argument("--target", default=str(defaults.DEFAULT_TARGET))
    dbench.add_argument("--draft", default=str(defaults.DEFAULT_DRAFT))
    dbench.add_argument("--num-prompts", type=int, default=20)
    dbench.add_argument("--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS)
    dbench.add_argument("--gamma", type=int, default=4)
    dbench.add_argument("--tp", default="1,2", help="comma-separated TP degrees")
    dbench.add_argument("--threads", type=int, default=2, help="torch threads in process and per TP-1 shard")
    dbench.add_argument("--out", default="bench/results")

    sbench = sub.add_parser("bench-serve", help="load test of the HTTP API: speculation on vs off by concurrency")
    sbench.add_argument("--target", default=str(defaults.DEFAULT_TARGET))
    sbench.add_argument("--draft", default=str(defaults.DEFAULT_DRAFT))
    sbench.add_argument("--gamma", type=int, default=defaults.DEFAULT_GAMMA, help="γ of the draft-model mode")
    sbench.add_argument("--ngram-gamma", type=int, default=8, help="γ of the n-gram mode (0 = no n-gram mode)")
    sbench.add_argument("--rounds", type=int, default=4, help="rounds per level, mode order reversed every other")
    sbench.add_argument("--max-tokens", type=int, default=128, help="tokens per request (EOS ignored)")
    sbench.add_argument("--temperature", type=float, default=0.0)
    sbench.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    sbench.add_argument("--requests", default="4,8,16", help="requests per round and mode, one per concurrency level")
    sbench.add_argument("--time-limit", type=float, default=300.0, help="seconds per level; no request starts after")
    sbench.add_argument("--port", type=int, default=8123, help="HTTP port on 127.0.0.1")
    sbench.add_argument("--out", default="bench/results")

    exp = sub.add_parser("experiment", help="γ policies over workloads: live, or replayed from cycle traces")
    exp.add_argument("--target", default=str(defaults.DEFAULT_TARGET), help="target model directory (live runs)")
    exp.add_argument("--draft", default=str(defaults.DEFAULT_DRAFT), help="draft model directory (live runs)")
    exp.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    exp.add_argument("--device", default="cpu", help="cpu or cuda")
    exp.add_argument(
        "--workloads",
        help="comma-separated of code-t0, code-t1, code-t1.5, shuffled (default: all; replays: those in the traces)",
    )
    exp.add_argument(
        "--policies",
        help="comma-separated fixed:γ, heuristic, adaptive, none (plain decoding), module:ClassName or "
        "file.py:ClassName (default: fixed:1,fixed:2,fixed:4,fixed:6,fixed:8,heuristic,adaptive,none)",
    )
    exp.add_argument("--prompts", help="JSON file with a list of prompt strings (default: held-out stdlib files)")
    exp.add_argument("--num-prompts", type=int, default=8)
    exp.add_argument("--max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS)
    exp.add_argument("--rounds", type=int, default=2, help="rounds over every cell, order alternating")
    exp.add_argument("--max-gamma", type=int, default=16, help="the largest γ adaptive and heuristic may choose")
    exp.add_argument("--seed", type=int, default=0)
    exp.add_argument("--replay", nargs="+", metavar="TRACE", help="simulate the policies over these trace files")
    exp.add_argument("--trace-out", metavar="FILE", help="live runs: append every cycle to this trace file")
    exp.add_argument("--out", default="bench/results/experiment", help="directory for experiment.csv/.json/*.png")
    exp.add_argument("--json", action="store_true", help="print only the JSON summary line, not the table")

    train = sub.add_parser(
        "train",
        help="train the default model pair, or a drafter head (eagle, medusa, exit-head) for a frozen target",
        description="`train` / `train pair`: the default target and draft model on the Python standard library. "
        "`train eagle|medusa|exit-head --target DIR`: a drafter head for a frozen target, on the default corpus or "
        "--data FOLDER; checkpoints under OUT/checkpoints (a rerun resumes), a held-out acceptance report, "
        "a model card; load the result with --draft eagle:OUT, medusa:OUT or layerskip:OUT.",
    )
    train.add_argument("what", nargs="?", choices=TRAINABLE, default="pair", help="what to train (default: pair)")
    train.add_argument("--out", help="output directory (default: models/ for the pair, models/<what>/ for a head)")
    train.add_argument("--seed", type=int, default=0)
    pair = train.add_argument_group("the default pair")
    pair.add_argument("--target-steps", type=int, default=1000)
    pair.add_argument("--draft-steps", type=int, default=400)
    head = train.add_argument_group("drafter heads (defaults sized for the default target on 2 CPU cores)")
    head.add_argument("--target", default=str(defaults.DEFAULT_TARGET), help="the frozen target's directory")
    head.add_argument("--data", help="a folder of text/code to train on (default: the standard library corpus)")
    head.add_argument("--steps", type=int, help="optimizer steps")
    head.add_argument("--batch-size", type=int)
    head.add_argument("--seq-len", type=int)
    head.add_argument("--max-tokens", type=int, help="cap on the training stream's tokens")
    head.add_argument("--feature-layers", help="eagle: comma-separated target layers to fuse (default: low,mid,top)")
    head.add_argument("--unroll", type=int, help="eagle: training-time-test steps on the head's own outputs")
    head.add_argument("--init-from", help="eagle: continue from this trained head (a fresh schedule over its weights)")
    head.add_argument("--heads", type=int, help="medusa: number of heads (tokens t+2 .. t+1+heads)")
    head.add_argument("--layers", type=int, help="exit-head: the exit layer L")

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve until Ctrl-C")
    srv.add_argument("--config", help="Serve config YAML (as deploy/serve.yaml; default: the default models)")
    srv.add_argument("--host", help="interface for the HTTP proxy (default: the config's, else 127.0.0.1)")
    srv.add_argument("--port", type=int, help="HTTP port (default: the config's, else 8000)")
    srv.add_argument(
        "--ray-address",
        help="Ray cluster to join (default: the `specserve cluster up` cluster if running, else a private local one)",
    )

    _add_cluster_parser(sub)
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return str(args.prompt)
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UsageError(f"prompt file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"prompt file {path} is not UTF-8 text: {exc}") from exc


def _number_list(text: str, kind: Callable[[str], N], flag: str) -> list[N]:
    """A comma-separated list of numbers from the command line."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise UsageError(f"{flag} must be comma-separated numbers: {exc}") from exc


def _check_common(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.core.engine import GenerationConfig
    from specserve.core.sampling import SamplingParams

    _check_common(args)
    if not 1 <= args.gamma <= 64:
        raise UsageError(f"--gamma must be between 1 and 64, got {args.gamma}")
    if not args.distributed and (args.tp != 1 or args.overlap or args.drafter_placement != "colocated"):
        raise UsageError("--tp, --drafter-placement and --overlap need --distributed")
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        drafter_invariant=args.drafter_invariant,
        acceptance="typical" if args.typical_acceptance else "exact",
        lossy=args.lossy,
        typical_epsilon=args.typical_epsilon,
        typical_delta=args.typical_delta,
    )
    tree = _tree_spec(args)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, gamma=args.gamma, stop=tuple(args.stop), tree=tree, policy=args.policy
    )
    prompt = _read_prompt(args)
    if not prompt:
        raise UsageError("the prompt is empty; pass some text with --prompt or --prompt-file")
    if args.distributed:
        with _coordinator(args) as coordinator:
            return _print_generation(coordinator, prompt, params, config, args.json)
    return _print_generation(_engine(args), prompt, params, config, args.json)


def _tree_spec(args: argparse.Namespace) -> Any:
    from specserve.core.tree import InvalidTree, TreeBudget, TreeSpec, TreeTopology

    if args.tree == "chain":
        if args.tree_topology:
            raise UsageError("--tree-topology needs --tree static")
        return None
    try:
        if args.tree == "dynamic":
            budget = TreeBudget(args.tree_depth, args.tree_width, args.tree_nodes, args.tree_expand)
            return TreeSpec("dynamic", budget=budget)
        if not args.tree_topology:
            raise UsageError("--tree static needs --tree-topology FILE (a JSON list of index paths)")
        path = Path(args.tree_topology)
        try:
            paths = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read the tree topology {path}: {exc}") from exc
        if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
            raise UsageError(f"{path} must hold a JSON list of index paths, e.g. [[0], [1], [0, 0]]")
        return TreeSpec("static", topology=TreeTopology.from_lists(paths))
    except (InvalidTree, ValueError, TypeError) as exc:  # a malformed topology or budget
        raise UsageError(f"bad tree options: {exc}") from exc


def _engine(args: argparse.Namespace) -> Any:
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.model import CausalLM
    from specserve.drafters import build_drafter
    from specserve.policies.schedules import schedules

    target = CausalLM.load(args.target, dtype=args.dtype, device=args.device)
    drafter = build_drafter(
        args.draft, target, dtype=args.dtype, device=args.device, max_ngram=args.ngram_max, min_ngram=args.ngram_min
    )
    return SpeculativeEngine(target, drafter, schedules=schedules())


@contextlib.contextmanager
def _coordinator(args: argparse.Namespace) -> Iterator[Any]:
    from specserve.actors import Coordinator, ReplicaConfig
    from specserve.cluster.connect import connect_ray

    if not Path(args.target).is_dir():
        raise UsageError(f"model directory {args.target} does not exist")
    config = ReplicaConfig(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        device=args.device,
        tp_degree=args.tp,
        drafter_placement=args.drafter_placement,
        overlap=args.overlap,
        max_ngram=args.ngram_max,
        min_ngram=args.ngram_min,
        threads_per_shard=args.threads_per_shard,
        threads_per_drafter=args.threads_per_drafter,
    )
    with connect_ray(args.ray_address, tp_degree=args.tp):
        coordinator = Coordinator.spawn(config)
        try:
            yield coordinator
        finally:
            coordinator.shutdown()


def _sampling_mode(params: Any) -> str:
    """How tokens were chosen: ``greedy`` (temperature 0, where --drafter-invariant has no effect),
    ``drafter_invariant`` (keyed Gumbel noise), ``typical`` (lossy typical acceptance) or ``rejection``
    (speculative rejection sampling)."""
    if params.greedy:
        return "greedy"
    if params.lossy_acceptance:
        return "typical"
    return "drafter_invariant" if params.drafter_invariant else "rejection"


def _print_generation(runner: Any, prompt: str, params: Any, config: Any, as_json: bool) -> int:
    """Print one generation of a single-process engine or a distributed coordinator (same interface)."""
    if as_json:
        result = runner.generate(prompt, params, config)
        stats = result.stats.to_dict()
        print(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "output_ids": result.output_ids,
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "sampling": _sampling_mode(params),
                    "lossy": params.lossy_acceptance,  # true: a lossy acceptance rule ran (not the target's law)
                    "stats": stats,
                }
            )
        )
        return 0
    for chunk in runner.stream(prompt, params, config):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.result is not None:
            s = chunk.result.stats
            print(
                f"\n[{s.new_tokens} tokens, {s.cycles} cycles, mean accepted {s.mean_accepted:.2f}, "
                f"{s.tokens_per_second:.1f} tok/s, finish={chunk.result.finish_reason}, "
                f"lossy={'true' if params.lossy_acceptance else 'false'}]",
                file=sys.stderr,
            )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.serve.config import ServeConfig
    from specserve.serve.deploy_file import ServeFile, load_serve_file
    from specserve.serve.launch import serving, wait_for_interrupt

    file = load_serve_file(args.config) if args.config else ServeFile(config=ServeConfig())
    if args.host:
        file.host = args.host
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise UsageError(f"--port must be between 1 and 65535, got {args.port}")
        file.port = args.port
    if not Path(file.config.target).is_dir():
        raise UsageError(f"model directory {file.config.target} does not exist")
    print(f"starting {file.config.model_name!r} (target {file.config.target}) ...", file=sys.stderr, flush=True)
    with serving(file, args.ray_address) as where:
        print(f"specserve: serving {where['model']!r} at {where['url']}  ({where['ray']})", flush=True)
        print(f"  health: {where['health']}", flush=True)
        if where["metrics"]:
            print(f"  Prometheus metrics: {where['metrics']}", flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        wait_for_interrupt()
        print("stopping ...", file=sys.stderr, flush=True)
    print("stopped", file=sys.stderr, flush=True)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve.benchmarks import speculative

    _check_common(args)
    gammas = _number_list(args.gammas, int, "--gammas")
    temperatures = _number_list(args.temperatures, float, "--temperatures")
    if not gammas or any(not 1 <= g <= 64 for g in gammas):
        raise UsageError(f"--gammas must be between 1 and 64, got {args.gammas}")
    results = speculative.run(
        speculative.BenchConfig(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype,
            device=args.device,
            prompts_file=args.prompts,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            gammas=tuple(gammas),
            temperatures=tuple(temperatures),
            out_dir=Path(args.out),
            quick=args.quick,
            max_ngram=args.ngram_max,
            min_ngram=args.ngram_min,
        )
    )
    if args.json:
        print(json.dumps(results))
    return 0


def cmd_bench_drafters(args: argparse.Namespace) -> int:
    from specserve.benchmarks import learned

    if args.rounds < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.gamma <= 64:
        raise UsageError("--rounds, --num-prompts and --max-new-tokens must be >= 1, --gamma in 1..64")
    report = learned.run(
        learned.DrafterBenchConfig(
            target=args.target,
            draft=args.draft,
            eagle=args.eagle,
            medusa=args.medusa,
            exit_head=args.exit_head,
            prompts_file=args.prompts,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            temperatures=tuple(_number_list(args.temperatures, float, "--temperatures")),
            rounds=args.rounds,
            gamma=args.gamma,
            out_dir=Path(args.out),
        )
    )
    if not args.json:
        print(learned.markdown(report))
    print(json.dumps(report["headline"]))
    return 0


def cmd_bench_trees(args: argparse.Namespace) -> int:
    from specserve.benchmarks import trees

    _check_common(args)
    ks = _number_list(args.ks, int, "--ks")
    if not ks or any(not 1 <= k <= 64 for k in ks):
        raise UsageError(f"--ks must be between 1 and 64, got {args.ks}")
    if args.rounds < 1 or args.num_prompts < 1:
        raise UsageError("--rounds and --num-prompts must be >= 1")
    report = trees.run(
        trees.TreeBenchConfig(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype,
            device=args.device,
            prompts_file=args.prompts,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            ks=tuple(ks),
            temperatures=tuple(_number_list(args.temperatures, float, "--temperatures")),
            rounds=args.rounds,
            out_dir=Path(args.out),
        )
    )
    print(json.dumps(report["headline"]) if args.json else trees.markdown(report))
    return 0


def cmd_bench_distributed(args: argparse.Namespace) -> int:
    from specserve.benchmarks import distributed

    _check_common(args)
    tps = tuple(_number_list(args.tp, int, "--tp"))
    distributed.run(
        distributed.DistributedBenchConfig(
            target=args.target,
            draft=args.draft,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            gamma=args.gamma,
            tp_degrees=tps,
            threads=args.threads,
            out_dir=Path(args.out),
        )
    )
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specserve.benchmarks import serve_load

    concurrency = _number_list(args.concurrency, int, "--concurrency")
    counts = _number_list(args.requests, int, "--requests")
    if not concurrency or any(c < 1 for c in concurrency) or len(counts) != len(concurrency):
        raise UsageError("--concurrency needs positive integers and --requests one count per concurrency level")
    if any(n < 1 for n in counts) or args.max_tokens < 1 or args.time_limit <= 0 or args.rounds < 1:
        raise UsageError("--requests, --max-tokens, --rounds and --time-limit must be positive")
    if not 1 <= args.gamma <= 64 or not 0 <= args.ngram_gamma <= 64:
        raise UsageError("--gamma must be between 1 and 64 and --ngram-gamma between 0 and 64")
    modes: list[tuple[str, dict[str, Any]]] = [
        ("off", {"enabled": False}),
        (f"draft model γ{args.gamma}", {"drafter": "default", "gamma": args.gamma}),
    ]
    if args.ngram_gamma:
        modes.append((f"n-gram γ{args.ngram_gamma}", {"drafter": "ngram", "gamma": args.ngram_gamma}))
    report = serve_load.run(
        serve_load.LoadConfig(
            target=args.target,
            draft=args.draft,
            modes=tuple(modes),
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            concurrency=tuple(concurrency),
            requests_per_level=tuple(counts),
            level_time_limit_s=args.time_limit,
            port=args.port,
            out_dir=Path(args.out),
        )
    )
    print(serve_load.markdown(report))
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from specserve.benchmarks import experiment

    workloads = None
    if args.workloads is not None:
        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        if not workloads:
            raise UsageError("--workloads needs at least one workload name")
    report = experiment.run(
        experiment.ExperimentConfig(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype,
            device=args.device,
            prompts_file=args.prompts,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            workloads=workloads,
            policies=args.policies or experiment.DEFAULT_POLICIES,
            rounds=args.rounds,
            out_dir=Path(args.out),
            seed=args.seed,
            replay=tuple(args.replay or ()),
            trace_out=args.trace_out,
            max_gamma=args.max_gamma,
        )
    )
    if not args.json:
        print(experiment.markdown(report))
    print(json.dumps(experiment.headline(report)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.what == "pair":
        from specserve.training import pipeline

        if args.target_steps < 1 or args.draft_steps < 1:
            raise UsageError("--target-steps and --draft-steps must be >= 1")
        out = Path(args.out or defaults.MODELS_DIR)
        pipeline.run(
            pipeline.RecipeConfig(
                out_dir=out, target_steps=args.target_steps, draft_steps=args.draft_steps, seed=args.seed
            )
        )
        return 0
    for name in ("steps", "batch_size", "seq_len", "max_tokens", "unroll", "heads", "layers"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "unroll" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be >= {0 if name == 'unroll' else 1}, got {value}")
    if not Path(args.target, "config.json").is_file():
        raise UsageError(f"--target {args.target} is not a model directory (no config.json)")
    out = Path(args.out or Path(defaults.MODELS_DIR) / args.what)
    common = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed}
    common["max_tokens"] = args.max_tokens
    if args.what == "eagle":
        import dataclasses

        from specserve.training.eagle import EagleRecipe, train_eagle

        options = {**common, "unroll": args.unroll}
        if args.feature_layers:
            try:
                options["feature_layers"] = tuple(int(x) for x in args.feature_layers.split(","))
            except ValueError as exc:
                raise UsageError(
                    f"--feature-layers must be comma-separated integers, got {args.feature_layers!r}"
                ) from exc
        recipe = dataclasses.replace(EagleRecipe(), **{k: v for k, v in options.items() if v is not None})
        summary = train_eagle(args.target, out, recipe, data_folder=args.data, init_from=args.init_from)
    elif args.what == "medusa":
        from specserve.training.medusa import train_medusa

        options = {**common, "heads": args.heads}
        summary = train_medusa(
            args.target, out, data_folder=args.data, **{k: v for k, v in options.items() if v is not None}
        )
    else:
        from specserve.training.exit_head import train_exit_head

        options = {**common, "layers": args.layers}
        summary = train_exit_head(
            args.target, out, data_folder=args.data, **{k: v for k, v in options.items() if v is not None}
        )
    acceptance = summary.get("heldout_acceptance", summary.get("acceptance"))
    print(json.dumps({"out": str(out), "heldout_acceptance": acceptance}, indent=2))
    print(
        f"trained {args.what} for {args.target}: load it with --draft {DRAFT_PREFIX[args.what]}{out}", file=sys.stderr
    )
    return 0


# ---------------------------------------------------------------------------------------------
# specserve cluster up | down | status


def _add_cluster_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from specserve.cluster.local import DEFAULT_PORT

    cluster = subparsers.add_parser("cluster", help="a local multi-node Ray cluster on this machine (up, down, status)")
    actions = cluster.add_subparsers(dest="cluster_command", required=True)
    up = actions.add_parser("up", help="start a head (large resource) and workers (cheap resource) on this machine")
    up.add_argument("--workers", type=int, default=2, help="worker nodes beside the head")
    up.add_argument("--large", type=int, default=4, help="units of the 'large' resource on the head (target shards)")
    up.add_argument("--cheap", type=int, default=1, help="units of the 'cheap' resource per worker (drafters)")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="GCS port of the head (port + 1 is used too)")
    actions.add_parser("down", help="stop the local cluster (only it: other Ray sessions keep running)")
    stat = actions.add_parser("status", help="nodes, resources and actors of the local cluster")
    stat.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _cmd_cluster(args: argparse.Namespace) -> int:
    from specserve.cluster import local

    if args.cluster_command == "up":
        spec = local.LocalClusterSpec(workers=args.workers, large=args.large, cheap=args.cheap, port=args.port)
        cluster = local.up(spec)
        workers = f"{spec.workers} worker{'s' if spec.workers != 1 else ''} ({spec.cheap_resource}: {spec.cheap} each)"
        print(f"local Ray cluster up at {cluster.address}: head ({spec.large_resource}: {spec.large}) + {workers}")
        print(f"state: {cluster.state_file}; stop it with `specserve cluster down`")
    elif args.cluster_command == "down":
        report = local.down()
        if report.was_running:
            print(f"stopped the local Ray cluster at {report.address} ({report.nodes} nodes)")
        else:
            print(f"the local Ray cluster at {report.address} had already stopped; cleaned up its state")
    else:
        status = local.status()
        print(json.dumps(status.to_dict()) if args.json else local.format_status(status))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would clutter streamed text and error lines
    hf_logging.set_verbosity_error()
    handlers = {
        "generate": cmd_generate,
        "bench": cmd_bench,
        "bench-trees": cmd_bench_trees,
        "bench-drafters": cmd_bench_drafters,
        "bench-distributed": cmd_bench_distributed,
        "bench-serve": cmd_bench_serve,
        "experiment": cmd_experiment,
        "train": cmd_train,
        "cluster": _cmd_cluster,
        "serve": cmd_serve,
    }
    try:
        return handlers[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
