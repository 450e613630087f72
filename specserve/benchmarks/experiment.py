"""`specserve experiment`: a grid of γ policies over workloads, run live or replayed from cycle traces.

One question: which speculation policy emits tokens fastest on which workload, and how far is
each from the best fixed γ chosen in hindsight? Every (workload, policy) cell runs the same
prompts with the same seeds:

* **live** — through the in-process :class:`~specserve.core.engine.SpeculativeEngine` with the
  shipped default pair (or ``--target``/``--draft``), each request's γ chosen by the policy via
  ``GenerationConfig(policy=..., gamma=...)``; ``--trace-out FILE`` appends every cycle to a trace;
* **replay** — ``--replay TRACE...`` simulates every policy over recorded traces
  (:mod:`specserve.policies.simulator`; its docstring lists what a replay assumes).

Workloads (``--workloads``) are named (prompts, temperature) sets: ``code-t0``, ``code-t1``,
``code-t1.3`` and ``code-t1.5`` (held-out standard-library code at temperature 0, 1, 1.3 and 1.5),
``prose-t0.7`` (held-out module docstrings cut halfway, at temperature 0.7: English prose, the nearest
to chat text the shipped code model knows; :func:`~specserve.benchmarks.prompts.prose_prompts`) and
``shuffled`` (the code prompts' token ids shuffled with the seed, temperature 1: a workload where every
drafter fails, so speculation must switch itself off). ``--prompts FILE`` replaces every workload's
prompts. Policies (``--policies``) are ``fixed:γ``,
``heuristic``, ``adaptive``, ``none`` (plain decoding: the ``none`` drafter, γ 0) and a
researcher's own policy given as ``module:ClassName`` or ``path/to/file.py:ClassName``: one class
in one file, built with no arguments, that satisfies :class:`~specserve.policies.base.Policy`, runs
through the same harness, live or replayed::

    # my_policy.py — specserve experiment --policies fixed:4,adaptive,none,my_policy.py:FirstDepth
    from specserve.core.draft.schedule import Budget
    from specserve.policies.base import PolicyState

    class FirstDepth:
        name = "first-depth"

        def decide(self, state: PolicyState) -> Budget:
            alpha = state.alpha[0] if state.alpha else 0.5  # acceptance at depth 0, shrunk to the prior
            return Budget(gamma=0 if alpha < 0.3 else 3 if alpha < 0.7 else 6)

Machine speed drifts on a shared host, so every cell of a workload decodes each prompt back to back (the cells'
order alternating from prompt to prompt and round to round), each prompt once per round (``--rounds``), and the
totals pool all rounds; each policy is warmed up first. A drift of minutes then falls on all cells alike.

Outputs under ``--out`` (default ``runs/experiment/``): ``experiment.json`` (rows, α per depth per
workload, and the issue's targets: per workload the best fixed γ in hindsight and adaptive / best
fixed, adaptive / none, and adaptive / heuristic overall, as total tokens over total seconds across
workloads — reported, never asserted), ``experiment.md`` (the table and the targets),
``experiment.csv`` (one row per workload × policy), four PNG plots (``throughput.png``,
``gamma_over_time.png``, ``alpha_by_depth.png``, ``predicted_vs_measured.png``). stdout carries the
table and a ``results:`` line, or with ``--json`` the report alone (:mod:`specserve.benchmarks.arguments`).

The predicted speedup of a cell applies the performance model (docs/architecture.md#performance-model) to the workload's
final estimates — α per depth and the cost curves over every cycle of the workload, as
:class:`~specserve.policies.simulator.WorkloadModel` builds them — at the γ the policy chose in
each of its cycles: Σ E[tokens | γ] / Σ (T_draft(γ) + T_verify(γ + 1)), over 1 / T_verify(1).

This module runs and reports experiments; it decides nothing itself (the policies do) and
times only whole requests (the engine times the cycles).
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import importlib.util
import itertools
import json
import random
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specserve.benchmarks.arguments import (
    RUNS_DIR,
    add_max_new_tokens_argument,
    add_output_arguments,
    add_prompt_arguments,
    model_and_prompt_options,
    print_results,
    stdout_to_stderr,
)
from specserve.benchmarks.tables import table_cell
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.draft.schedule import MAX_GAMMA, Budget, FixedSchedule, Schedule, ScheduleFactory
from specserve.core.draft.spec_strings import check_drafter_spec
from specserve.core.errors import UserError
from specserve.core.stats import merge_policy_reports
from specserve.policies.base import Policy
from specserve.policies.ceiling import ReplicaCeilings
from specserve.policies.controller import DEFAULT_MAX_GAMMA_CAP, SpeculationController
from specserve.policies.estimators import Estimators, ReplicaPrior
from specserve.policies.policies import build_policy
from specserve.policies.rates import cycle_seconds, expected_tokens
from specserve.policies.simulator import WorkloadModel, acceptance_counts, simulate
from specserve.policies.traces import TraceRecord, TraceWriter, read_traces

__all__ = [
    "DEFAULT_POLICIES",
    "TARGETS",
    "WORKLOADS",
    "ExperimentConfig",
    "PolicySpec",
    "Workload",
    "parse_policies",
    "run",
]

DEFAULT_POLICIES = "fixed:1,fixed:2,fixed:4,fixed:6,fixed:8,heuristic,adaptive,none"
# The targets: adaptive / best fixed per workload, adaptive / heuristic overall, adaptive / none per workload.
TARGETS = {"adaptive_over_best_fixed": 0.95, "adaptive_over_heuristic_overall": 1.15, "adaptive_over_none": 0.97}
BUILTIN_POLICIES = ("heuristic", "adaptive", "none")
MIN_REACHED_TO_PLOT = 10  # α at a depth fewer cycles reached is too noisy to draw


@dataclass(frozen=True)
class Workload:
    name: str
    temperature: float
    shuffled: bool = False  # prompt token ids shuffled (seeded): no drafter can predict the continuation
    prose: bool = False  # prose prompts (module docstrings) instead of code openings


WORKLOADS = {
    w.name: w
    for w in (
        Workload("code-t0", 0.0),
        Workload("code-t1", 1.0),
        Workload("code-t1.3", 1.3),
        Workload("code-t1.5", 1.5),
        Workload("prose-t0.7", 0.7, prose=True),
        Workload("shuffled", 1.0, shuffled=True),
    )
}


# ---------------------------------------------------------------------------------------------
# Policies of the grid


@dataclass(frozen=True)
class PolicySpec:
    """One column of the grid: a label as the user wrote it and how to run it."""

    label: str  # "fixed:4", "heuristic", "adaptive", "none", "my_policy.py:FirstDepth"
    kind: str  # fixed | heuristic | adaptive | none | custom
    gamma: int = 0  # fixed: the γ
    custom: Policy | None = None  # custom: the policy object

    @property
    def is_fixed(self) -> bool:
        return self.kind == "fixed"

    def generation_options(self) -> dict[str, Any]:
        """The GenerationConfig fields that select this policy."""
        if self.kind == "none":
            return {"policy": "fixed", "gamma": 0, "drafter": "none"}
        if self.kind == "fixed":
            return {"policy": "fixed", "gamma": self.gamma}
        # heuristic, adaptive; a custom policy is run by its cell's schedule factory whatever the name says
        return {"policy": "adaptive" if self.kind == "custom" else self.kind}

    def decision(self, max_gamma: int) -> Policy | None:
        """The policy object a controller runs (None: fixed budgets need no controller)."""
        if self.kind == "custom":
            return self.custom
        if self.kind == "adaptive":
            return build_policy("adaptive", max_gamma=max_gamma)
        if self.kind == "heuristic":
            return build_policy("heuristic")
        return None


def parse_policies(text: str) -> list[PolicySpec]:
    """``fixed:1,fixed:4,heuristic,adaptive,none,my_policy.py:Mine`` → specs (labels must be unique)."""
    specs: list[PolicySpec] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in BUILTIN_POLICIES:
            specs.append(PolicySpec(part, part))
        elif part.startswith("fixed:"):
            try:
                gamma = int(part.removeprefix("fixed:"))
            except ValueError:
                raise UserError(f"--policies: {part!r} needs an integer γ, e.g. fixed:4") from None
            if not 1 <= gamma <= MAX_GAMMA:
                raise UserError(f"--policies: {part!r}: γ must be between 1 and {MAX_GAMMA} (plain decoding is 'none')")
            specs.append(PolicySpec(part, "fixed", gamma))
        elif ":" in part:
            specs.append(PolicySpec(part, "custom", custom=load_policy(part)))
        else:
            raise UserError(
                f"--policies: unknown policy {part!r}; use fixed:γ, heuristic, adaptive, none or module:ClassName"
            )
    labels = [s.label for s in specs]
    if not specs or len(set(labels)) != len(labels):
        raise UserError(f"--policies needs at least one policy, each once, got {text!r}")
    return specs


def load_policy(reference: str) -> Policy:
    """Build ``module:ClassName`` or ``path/to/file.py:ClassName`` with no arguments and check the Policy protocol."""
    where, _, class_name = reference.rpartition(":")
    if not where or not class_name.isidentifier():
        raise UserError(f"a custom policy is module:ClassName or file.py:ClassName, got {reference!r}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UserError(f"policy file {path} does not exist")
            spec = importlib.util.spec_from_file_location(f"specserve_user_policy_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # modules in the working directory, as `python -m` finds them
            module = importlib.import_module(where)
    except ImportError as exc:
        raise UserError(f"cannot import the policy module {where!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UserError(f"{where!r} has no class {class_name!r}")
    try:
        policy = cls()
    except TypeError as exc:
        raise UserError(f"{reference}: a custom policy is built with no arguments: {exc}") from exc
    if not isinstance(policy, Policy) or not isinstance(getattr(policy, "name", None), str):
        raise UserError(f"{reference} is not a Policy: it needs a `name` string and `decide(state) -> Budget`")
    return policy


def cell_schedules(spec: PolicySpec, prior: ReplicaPrior, max_gamma: int = DEFAULT_MAX_GAMMA_CAP) -> ScheduleFactory:
    """The engine's per-request schedules for one grid cell: the request's fixed budget for ``fixed`` and
    ``none``, otherwise a :class:`SpeculationController` around the cell's policy, seeded from (and
    feeding) the cell's own replica prior, so cells do not learn from each other. Replays use the same."""
    decision = spec.decision(max_gamma)
    ceilings = ReplicaCeilings()  # the cell's requests share them, as a replica's do
    adaptive = spec.kind == "adaptive"

    def make(policy: str, budget: Budget) -> Schedule:
        if decision is None:
            return FixedSchedule(budget)
        # as served (specserve.policies.schedules): the adaptive policy under its drafter's measured ceiling
        return SpeculationController(decision, prior, max_gamma, ceiling=ceilings if adaptive else None)

    return make


# ---------------------------------------------------------------------------------------------
# Configuration and cells


@dataclass(frozen=True)
class ExperimentConfig:
    target: str = ""
    draft: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    prompts_file: str | None = None
    num_prompts: int = 8
    max_new_tokens: int = 128
    workloads: tuple[str, ...] | None = None  # None: all (live) / every workload in the traces (replay)
    policies: str = DEFAULT_POLICIES
    rounds: int = 2
    out_dir: Path = RUNS_DIR / "experiment"
    seed: int = 0
    replay: tuple[str, ...] = ()  # trace files: replay instead of running live
    trace_out: str | None = None  # live: append every cycle to this trace file
    max_gamma: int = DEFAULT_MAX_GAMMA_CAP  # cap on the γ adaptive policies may choose

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.rounds < 1:
            raise UserError("--num-prompts, --max-new-tokens and --rounds must be >= 1")
        if not 1 <= self.max_gamma <= MAX_GAMMA:
            raise UserError(f"--max-gamma must be between 1 and {MAX_GAMMA}, got {self.max_gamma}")
        for name in self.workloads or ():
            if name not in WORKLOADS and not self.replay:
                raise UserError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        if self.replay and self.trace_out:
            raise UserError("--trace-out records live runs; it cannot be combined with --replay")


@dataclass
class Cell:
    """One workload × policy: pooled over prompts and rounds."""

    workload: str
    temperature: float
    policy: PolicySpec
    requests: int = 0
    tokens: int = 0  # tokens delivered
    seconds: float = 0.0  # wall time of whole requests (live) or charged cycle seconds (replay)
    records: list[TraceRecord] = field(default_factory=list)  # every cycle, in order
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> output ids (first round)
    report: dict[str, Any] = field(default_factory=dict)  # the requests' schedule reports, pooled (live runs)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cycles(self) -> int:
        return len(self.records)

    @property
    def mean_accepted(self) -> float:
        return sum(r.accepted + 1 for r in self.records) / len(self.records) if self.records else 0.0

    @property
    def gammas(self) -> list[int]:
        """The γ chosen per cycle, in order (γ over time)."""
        return [r.gamma for r in self.records]

    @property
    def mean_gamma(self) -> float:
        return sum(self.gammas) / len(self.records) if self.records else 0.0


# ---------------------------------------------------------------------------------------------
# Running


def run(cfg: ExperimentConfig) -> dict[str, Any]:
    specs = parse_policies(cfg.policies)
    if cfg.replay:
        records = read_traces(cfg.replay)
        cells = _replay(cfg, specs, records)
        sources = {w: [r for r in records if r.workload == w] for w in {c.workload for c in cells}}
        report = summarise(cfg, cells, sources)
    else:
        cells = _live(cfg, specs)
        report = summarise(cfg, cells)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path, csv_path, *_ = output_paths(cfg.out_dir)
    json_path.write_text(json.dumps(report, indent=2))
    markdown_path.write_text(markdown(report))
    write_csv(report["rows"], csv_path)
    plot(report, cells, cfg.out_dir)
    return report


def output_paths(out_dir: Path) -> list[Path]:
    """Every file a run writes under ``out_dir``: the report, its table, the CSV, then the plots (:func:`plot`)."""
    names = ("experiment.json", "experiment.md", "experiment.csv", *PLOT_FILES)
    return [out_dir / name for name in names]


def workload_prompts(workload: Workload, prompt_ids: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
    """The workload's prompts as token ids: as encoded, or each shuffled with its own seeded generator."""
    if not workload.shuffled:
        return [list(ids) for ids in prompt_ids]
    out = []
    for i, ids in enumerate(prompt_ids):
        shuffled = list(ids)
        random.Random(seed * 1_000_003 + i).shuffle(shuffled)
        out.append(shuffled)
    return out


def _live(cfg: ExperimentConfig, specs: list[PolicySpec]) -> list[Cell]:
    import torch

    from specserve.benchmarks.prompts import heldout_prompts, load_prompts, prose_prompts
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.request import GenerationConfig
    from specserve.core.sampling.params import SamplingParams

    torch.manual_seed(cfg.seed)
    target, drafters = _load_models(cfg)
    workloads = [WORKLOADS[name] for name in (cfg.workloads or tuple(WORKLOADS))]
    if cfg.prompts_file:
        texts = {False: load_prompts(cfg.prompts_file)[: cfg.num_prompts]}
    else:
        texts = {prose: (prose_prompts if prose else heldout_prompts)(cfg.num_prompts) for prose in (False, True)}
    if not all(texts.values()):
        raise UserError("no prompts: the held-out corpus is empty (pass --prompts FILE)")
    cells = [Cell(w.name, w.temperature, spec) for w in workloads for spec in specs]
    engines = {
        (cell.workload, cell.policy.label): SpeculativeEngine(
            target, drafters, schedules=cell_schedules(cell.policy, ReplicaPrior(), cfg.max_gamma)
        )
        for cell in cells
    }
    warm = SpeculativeEngine(target, drafters)
    encoded = {prose: [warm.encode(text) for text in listed] for prose, listed in texts.items()}
    prompts = {w.name: workload_prompts(w, encoded[w.prose and not cfg.prompts_file], cfg.seed) for w in workloads}

    def config(spec: PolicySpec, max_new_tokens: int) -> Any:
        return GenerationConfig(max_new_tokens=max_new_tokens, **spec.generation_options())

    for spec in specs:  # warm-up: one short request per policy (on a throwaway prior)
        engine = SpeculativeEngine(target, drafters, schedules=cell_schedules(spec, ReplicaPrior(), cfg.max_gamma))
        engine.generate(encoded[False][0], SamplingParams(seed=cfg.seed), config(spec, min(8, cfg.max_new_tokens)))
    writer = TraceWriter(cfg.trace_out) if cfg.trace_out else None
    if writer is not None:
        writer.open()
    run_id = uuid.uuid4().hex[:8]  # request ids stay unique when several runs append to one trace
    total = cfg.rounds * sum(len(prompts[cell.workload]) for cell in cells)
    progress = tqdm(total=total, desc="experiment", unit="req")
    try:
        for round_index in range(cfg.rounds):
            for workload in workloads:
                at = [cell for cell in cells if cell.workload == workload.name]
                for i, ids in enumerate(prompts[workload.name]):
                    # every cell of the workload on this prompt back to back, the order alternating, so that
                    # drift of the machine's speed (minutes long on a shared host) falls on all cells alike
                    for cell in at if (round_index + i) % 2 == 0 else at[::-1]:
                        params = SamplingParams(temperature=workload.temperature, seed=cfg.seed + i)
                        start = time.perf_counter()
                        engine = engines[(cell.workload, cell.policy.label)]
                        result = engine.generate(ids, params, config(cell.policy, cfg.max_new_tokens))
                        seconds = time.perf_counter() - start
                        request_id = f"{run_id}/{cell.workload}/{cell.policy.label}/round{round_index}/prompt{i}"
                        records = cycle_records(result.stats.observations, request_id, cell, cfg.max_new_tokens)
                        cell.requests += 1
                        cell.tokens += len(result.output_ids)
                        cell.seconds += seconds
                        cell.records.extend(records)
                        cell.report = merge_policy_reports(cell.report, result.stats.policy)
                        if round_index == 0:
                            cell.outputs[i] = list(result.output_ids)
                        if writer is not None:
                            writer.write_many(records)
                        progress.update()
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    return cells


def _load_models(cfg: ExperimentConfig) -> tuple[Any, Any]:
    from specserve.core.model.causal_lm import CausalLM
    from specserve.drafters.registry import build_drafter_set

    if not Path(cfg.target).is_dir():
        raise UserError(f"model directory {cfg.target} does not exist")
    check_drafter_spec(cfg.draft)  # a draft model directory, eagle:DIR, medusa:DIR, layerskip:DIR, ngram, ...
    target = CausalLM.load(cfg.target, dtype=cfg.dtype, device=cfg.device)
    return target, build_drafter_set(cfg.draft, target, dtype=cfg.dtype, device=cfg.device)


def cycle_records(observations: Sequence[Any], request_id: str, cell: Cell, max_new_tokens: int) -> list[TraceRecord]:
    """One request's observations as trace records; ``remaining`` follows the engine (max_new_tokens − committed)."""
    records = []
    committed = 0
    for index, observation in enumerate(observations):
        records.append(
            TraceRecord.from_observation(
                observation,
                request_id,
                index,
                cell.workload,
                cell.policy.label,
                cell.temperature,
                remaining=max_new_tokens - committed,
            )
        )
        committed += observation.accepted + 1
    return records


def _replay(cfg: ExperimentConfig, specs: list[PolicySpec], records: list[TraceRecord]) -> list[Cell]:
    present = sorted({r.workload for r in records})
    chosen = list(cfg.workloads) if cfg.workloads else present
    missing = [w for w in chosen if w not in present]
    if missing:
        raise UserError(f"workloads {', '.join(missing)} are not in the traces (they hold: {', '.join(present)})")
    cells = []
    progress = tqdm(total=len(chosen) * len(specs), desc="replay", unit="run")
    for workload in chosen:
        model = WorkloadModel.from_records(records, workload)
        for spec in specs:
            schedules = functools.partial(
                cell_schedules(spec, ReplicaPrior(), cfg.max_gamma),
                spec.generation_options()["policy"],
                Budget(spec.gamma),
            )
            result = simulate(model, schedules, policy_name=spec.label, seed=cfg.seed)
            cell = Cell(workload, model.temperature, spec, requests=len(model.acceptance.requests))
            cell.tokens = result.tokens
            cell.seconds = result.seconds
            pairs = zip(result.cycles, result.observations(), strict=True)
            for request, group in itertools.groupby(pairs, key=lambda pair: pair[0].request):
                observations = [observation for _, observation in group]
                request_id = f"{workload}/{spec.label}/replay/request{request}"
                cell.records.extend(cycle_records(observations, request_id, cell, cfg.max_new_tokens))
            cells.append(cell)
            progress.update()
    progress.close()
    return cells


# ---------------------------------------------------------------------------------------------
# Summary


def final_estimates(records: Sequence[TraceRecord], max_depth: int = DEFAULT_MAX_GAMMA_CAP) -> Any:
    """The estimators' state after every chain cycle of a workload (no forgetting): α per depth and costs."""
    estimators = Estimators(half_life=None)
    for record in records:
        if record.tree is None:
            estimators.observe(record.observation())
    return estimators.snapshot(None, max_depth=max_depth)


def predicted_speedup(state: Any, gammas: Sequence[int]) -> float | None:
    """The performance model's speedup over plain decoding at the γs a policy chose (see the module docstring)."""
    if not gammas:
        return None
    tokens = sum(expected_tokens(state, Budget(g)) for g in gammas)
    seconds = sum(cycle_seconds(state, Budget(g)) for g in gammas)
    return tokens / seconds * state.t_verify(1) if seconds > 0 else None


def summarise(
    cfg: ExperimentConfig, cells: list[Cell], sources: dict[str, list[TraceRecord]] | None = None
) -> dict[str, Any]:
    """Rows, per-workload targets and the overall ratio; ``sources``: per workload, the records the
    estimates come from (replays: the traces; default: the cells' own cycles)."""
    sources = sources or {}
    workloads = list(dict.fromkeys(c.workload for c in cells))
    rows: list[dict[str, Any]] = []
    per_workload: dict[str, Any] = {}
    for workload in workloads:
        at = [c for c in cells if c.workload == workload]
        records = sources.get(workload) or [r for c in at for r in c.records]
        state = final_estimates(records, cfg.max_gamma)
        none = next((c for c in at if c.policy.kind == "none"), None)
        for cell in at:
            speedup = cell.tokens_per_second / none.tokens_per_second if none and none.tokens_per_second else None
            rows.append(
                {
                    "workload": workload,
                    "policy": cell.policy.label,
                    "temperature": cell.temperature,
                    "requests": cell.requests,
                    "new_tokens": cell.tokens,
                    "seconds": cell.seconds,
                    "tokens_per_second": cell.tokens_per_second,
                    "speedup_vs_none": speedup,
                    "predicted_speedup": predicted_speedup(state, cell.gammas),
                    "mean_accepted": cell.mean_accepted,
                    "cycles": cell.cycles,
                    "mean_gamma": cell.mean_gamma,
                    # cycles decoded plainly: the policy's own choice, or its ceiling's cut (live adaptive cells)
                    "plain_share": sum(1 for g in cell.gammas if g == 0) / cell.cycles if cell.cycles else None,
                    "fallbacks": cell.report.get("fallbacks"),
                }
            )
        per_workload[workload] = _targets(at, none)
        per_workload[workload]["temperature"] = at[0].temperature
        reached, accepted = acceptance_counts(r for r in records if r.tree is None)
        per_workload[workload]["alpha_by_depth"] = [a / r for a, r in zip(accepted, reached, strict=True)]
        per_workload[workload]["reached_by_depth"] = reached
        if at[0].temperature == 0.0 and not cfg.replay:
            per_workload[workload]["greedy_outputs_identical"] = _identical_outputs(at)
    overall = _overall(cells)
    met = {
        "adaptive_over_best_fixed": _all_at_least(per_workload, "adaptive_over_best_fixed"),
        "adaptive_over_none": _all_at_least(per_workload, "adaptive_over_none"),
        "adaptive_over_heuristic_overall": _at_least(
            overall.get("adaptive_over_heuristic"), TARGETS["adaptive_over_heuristic_overall"]
        ),
    }
    return {
        "mode": "replay" if cfg.replay else "live",
        "config": {**{k: v for k, v in cfg.__dict__.items() if k != "out_dir"}, "out_dir": str(cfg.out_dir)},
        "rows": rows,
        "workloads": per_workload,
        "overall": overall,
        "targets": TARGETS,
        "targets_met": met,
    }


def _targets(cells: list[Cell], none: Cell | None) -> dict[str, Any]:
    fixed = [c for c in cells if c.policy.is_fixed]
    best = max(fixed, key=lambda c: c.tokens_per_second) if fixed else None
    adaptive = next((c for c in cells if c.policy.kind == "adaptive"), None)
    heuristic = next((c for c in cells if c.policy.kind == "heuristic"), None)
    out: dict[str, Any] = {
        "best_fixed": {"policy": best.policy.label, "tokens_per_second": best.tokens_per_second} if best else None
    }
    for name, other in (("best_fixed", best), ("none", none), ("heuristic", heuristic)):
        ratio = None
        if adaptive is not None and other is not None and other.tokens_per_second > 0:
            ratio = adaptive.tokens_per_second / other.tokens_per_second
        out[f"adaptive_over_{name}"] = ratio
    return out


def _overall(cells: list[Cell]) -> dict[str, Any]:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for cell in cells:
        totals[cell.policy.label][0] += cell.tokens
        totals[cell.policy.label][1] += cell.seconds
    rates = {label: tokens / seconds if seconds > 0 else 0.0 for label, (tokens, seconds) in totals.items()}
    out: dict[str, Any] = {"tokens_per_second": rates}
    if rates.get("adaptive") and rates.get("heuristic"):
        out["adaptive_over_heuristic"] = rates["adaptive"] / rates["heuristic"]
    return out


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _all_at_least(per_workload: dict[str, Any], key: str) -> bool | None:
    values = [entry[key] for entry in per_workload.values() if entry.get(key) is not None]
    return None if not values else all(v >= TARGETS[key] for v in values)


def _identical_outputs(cells: list[Cell]) -> bool:
    """Greedy exactness across the grid: every policy emitted the same ids for every prompt (first round)."""
    outputs = [c.outputs for c in cells if c.outputs]
    return all(o == outputs[0] for o in outputs)


# ---------------------------------------------------------------------------------------------
# Outputs

CSV_COLUMNS = (
    "workload",
    "policy",
    "temperature",
    "requests",
    "new_tokens",
    "seconds",
    "tokens_per_second",
    "speedup_vs_none",
    "predicted_speedup",
    "mean_accepted",
    "cycles",
    "mean_gamma",
)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| workload | policy | tokens/s | × none | predicted × none | mean accepted | cycles | mean γ | plain cycles |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['tokens_per_second']:.1f} | {table_cell(r['speedup_vs_none'])} | "
            f"{table_cell(r['predicted_speedup'])} | {r['mean_accepted']:.2f} | {r['cycles']} | "
            f"{r['mean_gamma']:.2f} | {table_cell(r['plain_share'])} |"
        )
    lines.append("")
    for workload, entry in report["workloads"].items():
        best = entry["best_fixed"]
        parts = [f"best fixed {best['policy']} ({best['tokens_per_second']:.1f} tok/s)" if best else "no fixed γ"]
        for key, label in (("adaptive_over_best_fixed", "best fixed"), ("adaptive_over_none", "none")):
            if entry.get(key) is not None:
                parts.append(f"adaptive / {label} = {entry[key]:.3f}× (target {TARGETS[key]}×)")
        if "greedy_outputs_identical" in entry:
            parts.append(f"greedy outputs identical: {entry['greedy_outputs_identical']}")
        lines.append(f"- **{workload}**: " + "; ".join(parts))
    ratio = report["overall"].get("adaptive_over_heuristic")
    if ratio is not None:
        target = TARGETS["adaptive_over_heuristic_overall"]
        lines.append(f"- **overall**: adaptive / heuristic = {ratio:.3f}× (target {target}×)")
    return "\n".join(lines) + "\n"


PLOT_FILES = ("throughput.png", "gamma_over_time.png", "alpha_by_depth.png", "predicted_vs_measured.png")


def plot(report: dict[str, Any], cells: list[Cell], out_dir: Path) -> None:
    """The four plots of :data:`PLOT_FILES` under ``out_dir``."""
    throughput_path, gamma_path, alpha_path, predicted_path = (out_dir / name for name in PLOT_FILES)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    workloads = list(report["workloads"])
    policies = list(dict.fromkeys(r["policy"] for r in rows))

    # tokens/s per policy per workload, grouped bars
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) * max(1, len(policies)) / 4), 4))
    width = 0.8 / max(1, len(policies))
    for j, policy in enumerate(policies):
        values = [next((r["tokens_per_second"] for r in rows if r["workload"] == w and r["policy"] == policy), 0.0)
                  for w in workloads]  # fmt: skip
        ax.bar([i + (j - (len(policies) - 1) / 2) * width for i in range(len(workloads))], values, width, label=policy)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"tokens/s per policy ({report['mode']})")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=120)
    plt.close(fig)

    # chosen γ over time, adaptive and heuristic (and custom policies), per workload
    fig, axes = plt.subplots(len(workloads), 1, figsize=(8, 2.4 * len(workloads)), squeeze=False)
    for ax, workload in zip(axes[:, 0], workloads, strict=True):
        for cell in cells:
            if cell.workload == workload and cell.policy.kind in ("adaptive", "heuristic", "custom"):
                ax.step(range(len(cell.gammas)), cell.gammas, where="post", label=cell.policy.label, linewidth=0.8)
        ax.set_ylabel("γ")
        ax.set_title(workload, fontsize="small")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("cycle (requests in run order)")
    fig.tight_layout()
    fig.savefig(gamma_path, dpi=120)
    plt.close(fig)

    # α per depth per workload (depths reached by at least MIN_REACHED_TO_PLOT cycles)
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload, entry in report["workloads"].items():
        pairs = zip(entry["alpha_by_depth"], entry["reached_by_depth"], strict=True)
        points = [(d, a) for d, (a, n) in enumerate(pairs) if n >= MIN_REACHED_TO_PLOT]
        if points:
            ax.plot([d for d, _ in points], [a for _, a in points], marker="o", label=workload)
    ax.set_xlabel("depth (0 = first draft token)")
    ax.set_ylabel("α (accepted | reached)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"acceptance per depth (depths reached ≥ {MIN_REACHED_TO_PLOT} times)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(alpha_path, dpi=120)
    plt.close(fig)

    # predicted vs measured speedup per policy
    fig, ax = plt.subplots(figsize=(5.5, 5))
    scored = [r for r in rows if r["predicted_speedup"] is not None and r["speedup_vs_none"] is not None]
    for workload in workloads:
        at = [r for r in scored if r["workload"] == workload]
        if at:
            ax.scatter([r["predicted_speedup"] for r in at], [r["speedup_vs_none"] for r in at], label=workload)
            for r in at:
                ax.annotate(r["policy"], (r["predicted_speedup"], r["speedup_vs_none"]), fontsize=6)
    if scored:
        top = max(max(r["predicted_speedup"], r["speedup_vs_none"]) for r in scored) * 1.1
        ax.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=0.8, label="measured = predicted")
        ax.legend(fontsize="small")
    ax.set_xlabel("predicted speedup vs none")
    ax.set_ylabel("measured speedup vs none")
    ax.set_title("performance model vs measurement")
    fig.tight_layout()
    fig.savefig(predicted_path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `specserve experiment`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ReplicaConfig.add_arguments(parser, ["target", "draft", "dtype", "device"])  # the models of live runs
    parser.add_argument(
        "--workloads",
        help=f"comma-separated of {', '.join(WORKLOADS)} (default: all; replays: those in the traces)",
    )
    parser.add_argument(
        "--policies",
        help="comma-separated fixed:γ, heuristic, adaptive, none (plain decoding), module:ClassName or "
        f"file.py:ClassName (default: {DEFAULT_POLICIES})",
    )
    add_prompt_arguments(parser, num_prompts=8)
    add_max_new_tokens_argument(parser)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every cell, order alternating")
    parser.add_argument(
        "--max-gamma", type=int, default=DEFAULT_MAX_GAMMA_CAP, help="the largest γ adaptive and heuristic may choose"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay", nargs="+", metavar="TRACE", help="simulate the policies over these trace files")
    parser.add_argument("--trace-out", metavar="FILE", help="live runs: append every cycle to this trace file")
    add_output_arguments(parser, "experiment", "experiment.json/.md/.csv and its plots")


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    """The configuration the flags describe; raises :class:`UserError` for a bad value."""
    workloads = None
    if args.workloads is not None:
        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        if not workloads:
            raise UserError("--workloads needs at least one workload name")
    return ExperimentConfig(
        **model_and_prompt_options(args),
        workloads=workloads,
        policies=args.policies or DEFAULT_POLICIES,
        rounds=args.rounds,
        out_dir=Path(args.out),
        seed=args.seed,
        replay=tuple(args.replay or ()),
        trace_out=args.trace_out,
        max_gamma=args.max_gamma,
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), output_paths(cfg.out_dir))
    return 0
