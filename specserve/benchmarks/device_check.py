"""The device check (issue 20): one run on one GPU that says whether the engine is exact and fast there.

Run it as ``bench/device_check.sh`` (or ``python bench/device_check.py``), which documents how to send it to a lent
GPU. In one process, within a wall-clock budget (:data:`BUDGET_SECONDS`, under the script's 8 minutes), it measures:

* **plain** — plain decoding of the shipped target over the held-out prompts: our engine with CUDA graphs
  (``graphs``: :mod:`specserve.core.static.slots` with graphs), on static shapes without graphs (``static``) and on
  the growing cache (``dynamic``, ``static=None``), against transformers' ``generate`` (``hf/eager``, whose greedy
  tokens are also the reference of every exactness check) and its static-cache mode, which transformers compiles
  by itself on a GPU (``hf/static``, timed after a warm-up that compiles it);
* **drafters** — every drafter whose files are here (:func:`drafter_plans`; one whose files are missing is
  reported skipped), as chains and as a dynamic tree, on the graphed engine (the static one on a CPU) and then the
  dynamic one: tokens/s, the speedup over plain decoding, mean accepted length, and whether every output equals
  transformers' greedy tokens (a mismatch is kept with the target's logit margin where the two part);
* **verify_cost** — T_verify(k) of the target, median ms of one forward of k tokens after the first prompt, per
  engine mode;
* **llama_1b** — the same plain decoding and T_verify(k) for a random-initialised 1.1B-parameter Llama (TinyLlama's
  shape) in bf16, whose speed is what a real model's would be (its tokens mean nothing, so agreement with
  transformers is shown, not judged: random bf16 logits tie often).

* **batched_target**, **batched_llama_1b** — what a server's path does: the batched engine at 1, 16 and 64 requests
  (plain, and the shipped pair's draft model at γ 3) against transformers' continuous batching (``generate_batch``)
  on the same requests: tokens/s, ITL p50, greedy outputs against one at a time, and on CUDA the host
  synchronisations and kernel launches per decode step (:mod:`specserve.benchmarks.device_batch`).

Then :func:`evaluate_targets` judges the issue's targets (our graphed plain ≥ 2× transformers' eager plain and ≥ 1×
without graphs; the best drafter ≥ 2.5× our graphed plain, greedy; every output exact) and whether the run stayed
clear of Ray and llguidance. Results: ``device_check.json`` (written after every section, so a run cut short keeps
what it measured) and ``device_check.png`` under ``--out``; stdout carries the tables, a PASS / FAIL line per target
and, last, one JSON line. A section that fails is recorded with its error and the run goes on; one that would not
fit in what is left of the budget is recorded as skipped.

``--quick`` is the CPU smoke run (tiny random models built in a temporary directory, random heads, 2 prompts × 8
tokens): it takes every path above in seconds. The check needs torch, transformers (numpy, msgpack, grpcio and
protobuf come with specserve's core) and, for the plot, matplotlib; it imports nothing of Ray, pydantic or the
serving stack. Greedy only: sampling exactness is a statistical property the test suite checks.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from specserve import defaults
from specserve.benchmarks.baselines import hf_generate
from specserve.benchmarks.device_batch import LEVELS, QUICK_LEVELS, batched_section, batched_targets
from specserve.benchmarks.device_batch import MAX_NEW_TOKENS as BATCH_MAX_NEW_TOKENS
from specserve.benchmarks.prompts import heldout_prompts
from specserve.benchmarks.tally import Tally
from specserve.benchmarks.timing import median_forward_seconds, synchronize
from specserve.core.draft.drafter import DrafterSet, TreeDrafter
from specserve.core.engine import SpeculativeEngine
from specserve.core.kv.cache import KVCache
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.static.graphs import GraphCache
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import StaticKVCache, StaticTarget
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters import build_drafter_set

BUDGET_SECONDS = 430.0
"""Wall-clock budget of a full run, from the start of the process: the script's ``timeout 480`` leaves the rest for
Python's start, the plot and slack."""
RESERVE_SECONDS = 10.0  # kept back from every estimate for writing the results
MUST_NOT_LOAD = ("ray", "llguidance")  # the device image has neither; nothing the check runs may need them
# EAGLE-2's shape at 15 nodes: with the root a block of 16, a GPU bucket (specserve.core.model.buckets.GPU_BUCKETS)
TREE = TreeSpec("dynamic", budget=TreeBudget(depth=6, width=3, nodes=15, expand=3))
VERIFY_KS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
LLAMA_PROMPTS = 3
LLAMA_PROMPT_TOKENS = 256
GRAPHED_OVER_HF = 2.0
UNGRAPHED_OVER_HF = 1.0
BEST_DRAFTER_OVER_GRAPHED = 2.5
MAX_MISMATCHES = 3  # kept per configuration, each with the target's logit margin


@dataclass(frozen=True)
class LlamaShape:
    """A Llama architecture to initialise at random (the plain-decoding and T_verify(k) section's second model)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int

    def config(self) -> LlamaConfig:
        fields = {k: v for k, v in asdict(self).items() if k != "name"}
        return LlamaConfig(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)


LLAMA_1B = LlamaShape("llama-1.1b", 2048, 5632, 22, 32, 4, 32000, 2048)  # TinyLlama's shape
LLAMA_TINY = LlamaShape("llama-tiny", 64, 128, 2, 4, 2, 512, 512)


@dataclass(frozen=True)
class CheckConfig:
    device: str = "cuda"
    dtype: str = "float32"  # the shipped target's; the Llama section is always bf16
    models: Path = defaults.MODELS_DIR
    num_prompts: int = 8
    max_new_tokens: int = 128
    budget_seconds: float = BUDGET_SECONDS
    out_dir: Path = Path("bench/results/device_check")
    quick: bool = False
    verify_ks: tuple[int, ...] = VERIFY_KS
    repeats: int = 21
    llama: LlamaShape = LLAMA_1B
    llama_prompts: int = LLAMA_PROMPTS
    llama_prompt_tokens: int = LLAMA_PROMPT_TOKENS
    estimate_scale: float = 1.0  # sections' time estimates (GPU seconds) times this, for the budget guard
    warmup_tokens: int | None = None  # new tokens of each configuration's warm-up request (None: as many as timed)
    batch_levels: tuple[int, ...] = LEVELS  # the batched section's concurrencies
    batch_max_new_tokens: int = BATCH_MAX_NEW_TOKENS  # per request of the batched section


QUICK = {
    "dtype": "float64",  # tiny random models have tiny logit margins: float64 keeps greedy ties out of the smoke run
    "num_prompts": 2,
    "max_new_tokens": 8,
    "budget_seconds": 120.0,
    "verify_ks": (1, 2, 4, 8),
    "repeats": 3,
    "llama": LLAMA_TINY,
    "llama_prompts": 2,
    "llama_prompt_tokens": 16,
    "estimate_scale": 0.05,
    "warmup_tokens": 2,  # nothing to capture on a CPU: the warm-up only has to take the configuration's path
    "batch_levels": QUICK_LEVELS,
    "batch_max_new_tokens": 16,
}


# ---------------------------------------------------------------------------------------------
# Budget, report


class Budget:
    """The run's wall clock: what is left, and whether a step estimated at ``seconds`` still fits."""

    def __init__(self, seconds: float, start: float | None = None) -> None:
        self.deadline = (time.perf_counter() if start is None else start) + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds + RESERVE_SECONDS

    def skip_reason(self, seconds: float) -> str:
        return f"skipped: budget ({self.left():.0f} s left, about {seconds:.0f} s needed)"


class Report:
    """The JSON report, saved after every section: sections' status, every run's row, T_verify(k), the targets."""

    def __init__(self, cfg: CheckConfig, budget: Budget) -> None:
        self.cfg = cfg
        self.budget = budget
        self.data: dict[str, Any] = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "environment": {},
            "sections": {},
            "runs": [],
            "verify_cost": {},
            "batched": [],
            "targets": [],
        }

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.data["runs"]

    def section(self, name: str, estimate: float, body: Callable[[], dict[str, Any] | None]) -> None:
        """Run ``body`` as section ``name`` unless the budget has no room for ``estimate`` seconds; an exception is
        recorded with the section, not raised."""
        estimate *= self.cfg.estimate_scale
        if not self.budget.allows(estimate):
            self.skip(name, self.budget.skip_reason(estimate))
            return
        print(f"[{name}] ({self.budget.left():.0f} s left)", flush=True)
        start = time.perf_counter()
        entry: dict[str, Any]
        try:
            entry = {"status": "ok", **(body() or {})}
        except Exception as exc:  # one section's failure must not lose the others' results
            entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"[{name}] error: {entry['error']}", flush=True)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        self.data["sections"][name] = entry
        self.save()

    def skip(self, name: str, reason: str) -> None:
        self.data["sections"][name] = {"status": reason}
        print(f"[{name}] {reason}", flush=True)
        self.save()

    def save(self) -> Path:
        self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.cfg.out_dir / "device_check.json"
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        return path


# ---------------------------------------------------------------------------------------------
# Engine modes, drafters


@dataclass(frozen=True)
class Mode:
    """How our engine runs the target: ``graphs`` (static shapes + CUDA graphs), ``static`` (static shapes, eager)
    or ``dynamic`` (the growing cache; ``static=None``)."""

    name: str
    static: StaticOptions | None = None  # None: the growing cache

    def engine(self, target: CausalLM, drafters: DrafterSet) -> SpeculativeEngine:
        return SpeculativeEngine(target, drafters, static=self.static)

    def cache(self, target: CausalLM) -> KVCache | StaticKVCache:
        """An empty cache of this mode (a growing one, or a static engine's slot)."""
        return target.new_cache() if self.static is None else StaticTarget(target, self.static).new_cache()


def engine_modes(device: torch.device) -> tuple[list[Mode], dict[str, str]]:
    """The modes this machine runs, fastest first, and why the others are skipped."""
    skipped: dict[str, str] = {}
    modes: list[Mode] = []
    if device.type == "cuda":
        modes.append(Mode("graphs", StaticOptions(cuda_graphs=True)))
    else:
        skipped["graphs"] = "skipped: CUDA graphs need a CUDA device"
    modes.append(Mode("static", StaticOptions(cuda_graphs=False)))
    modes.append(Mode("dynamic"))
    return modes, skipped


def graph_counts(engine: SpeculativeEngine) -> dict[str, Any] | None:
    """The target's graphs in a graphed engine: captured, replayed, failed (with why), eager calls beside them."""
    graphs: GraphCache | None = engine.static.graphs if engine.static is not None else None
    if graphs is None or graphs.backend is None:
        return None
    return {
        "captured": len(graphs.keys),
        "replays": sum(graphs.replays(key) for key in graphs.keys),
        "eager_runs": graphs.eager_runs,
        "failures": {str(key): why for key, why in graphs.failures.items()},
    }


@dataclass(frozen=True)
class DrafterPlan:
    """One drafter: its name in the report, its ``build_drafter_set`` spec, the files it needs, the chains it runs
    (gammas) and whether it also runs :data:`TREE` (when it can draft trees)."""

    name: str
    spec: str
    needs: Path | None = None
    gammas: tuple[int, ...] = (3,)  # blocks of γ + 1: 4, 8 and 16 are GPU buckets, so chains run unpadded
    tree: bool = True

    def missing(self) -> str | None:
        if self.needs is None or (self.needs / "config.json").is_file():
            return None
        return f"skipped: files missing ({self.needs})"


def drafter_plans(models: Path, quick: bool) -> list[DrafterPlan]:
    """Every drafter the check runs, model-free ones first. ``models`` holds ``draft``, ``medusa``, ``eagle`` and
    ``exit-head``; the quick run's layer skip drafts with the target's first layer (it has no exit head)."""
    layerskip = (
        DrafterPlan("layer-skip", "layerskip:1", gammas=(3,))
        if quick
        else DrafterPlan("layer-skip + exit head", f"layerskip:{models / 'exit-head'}", models / "exit-head", (3,))
    )
    return [
        DrafterPlan("ngram", "ngram", gammas=(7, 15)),
        DrafterPlan("suffix", "suffix", gammas=(7,)),
        DrafterPlan("lookahead", "lookahead", gammas=(3,)),
        DrafterPlan("draft model", str(models / "draft"), models / "draft", gammas=(3, 7)),
        DrafterPlan("medusa", f"medusa:{models / 'medusa'}", models / "medusa"),
        DrafterPlan("eagle", f"eagle:{models / 'eagle'}", models / "eagle"),
        layerskip,
    ]


def plan_configs(plan: DrafterPlan, drafter: object, max_new_tokens: int) -> list[tuple[str, GenerationConfig]]:
    """(shape label, generation config) for each chain of ``plan`` and its tree when ``drafter`` drafts trees."""
    out = [(f"chain {g}", GenerationConfig(max_new_tokens=max_new_tokens, gamma=g)) for g in plan.gammas]
    if plan.tree and isinstance(drafter, TreeDrafter):
        assert TREE.budget is not None
        budget = TREE.budget
        label = f"tree {budget.nodes} (d{budget.depth} w{budget.width} e{budget.expanded})"
        out.append((label, GenerationConfig(max_new_tokens=max_new_tokens, tree=TREE)))
    return out


# ---------------------------------------------------------------------------------------------
# Measuring


@dataclass
class Check:
    """What the sections share: the configuration, the shipped target, its prompts and transformers' tokens."""

    cfg: CheckConfig
    report: Report
    device: torch.device
    modes: list[Mode]
    target: CausalLM | None = None
    prompt_ids: list[list[int]] = field(default_factory=list)
    reference: list[list[int]] | None = None  # transformers' greedy tokens per prompt
    llama: CausalLM | None = None
    llama_prompt_ids: list[list[int]] = field(default_factory=list)
    llama_reference: list[list[int]] | None = None
    last_config_seconds: float = 5.0  # the last configuration's wall time: the next one's estimate

    @property
    def budget(self) -> Budget:
        return self.report.budget

    def has_target(self) -> bool:
        return self.target is not None and bool(self.prompt_ids)

    def has_reference(self) -> bool:
        return self.reference is not None

    def has_llama(self) -> bool:
        return self.llama is not None


def run_ours(
    target: CausalLM,
    engine: SpeculativeEngine,
    prompt_ids: list[list[int]],
    config: GenerationConfig,
    warmup_tokens: int | None = None,
) -> tuple[dict[str, Any], list[GenerationResult]]:
    """Warm up on the first prompt (kernels load; a whole request's worth captures every graph the timed requests
    replay), then time every prompt."""
    warmup = config if warmup_tokens is None else replace(config, max_new_tokens=warmup_tokens)
    engine.generate(prompt_ids[0], None, warmup)
    synchronize(target.device)
    tally = Tally()
    results = tally.run_requests(engine, prompt_ids, 0.0, config)
    decode = tally.stats.total_seconds - tally.stats.prefill_seconds
    row = {
        "new_tokens": tally.new_tokens,
        "seconds": round(tally.seconds, 4),
        "tokens_per_second": tally.tokens_per_second,
        "decode_tokens_per_second": tally.stats.new_tokens / decode if decode > 0 else None,
        "mean_accepted": tally.stats.mean_accepted,
        "cycles": tally.stats.cycles,
    }
    return row, results


def run_hf(
    target: CausalLM, prompt_ids: list[list[int]], max_new_tokens: int, **generate_kwargs: Any
) -> tuple[dict[str, Any], list[list[int]]]:
    """transformers' ``generate`` over every prompt after a warm-up on the longest (a static cache is sized, and
    compiled, once for it); the row and the tokens."""
    longest = max(prompt_ids, key=len)
    start = time.perf_counter()
    hf_generate(target, longest, max_new_tokens, **generate_kwargs)
    synchronize(target.device)
    warmup = time.perf_counter() - start
    outputs, seconds = [], 0.0
    for ids in prompt_ids:
        start = time.perf_counter()
        outputs.append(hf_generate(target, ids, max_new_tokens, **generate_kwargs))
        seconds += time.perf_counter() - start
    new_tokens = sum(map(len, outputs))
    row = {
        "new_tokens": new_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": new_tokens / seconds if seconds else 0.0,
        "warmup_seconds": round(warmup, 2),
    }
    return row, outputs


def first_difference(ours: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first position where the two token lists differ (a length difference counts); ``None`` if equal."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def logit_margin(target: CausalLM, prefix: list[int]) -> dict[str, Any]:
    """The target's top-2 logits after ``prefix`` (one full forward): how near a tie the greedy choice was."""
    logits = target.forward(KVCache(target.model), torch.tensor(prefix, dtype=torch.long), last_only=True)[-1]
    top = torch.topk(logits.float(), 2)
    return {"top2_tokens": top.indices.tolist(), "top2_gap": float(top.values[0] - top.values[1])}


def exactness(
    target: CausalLM, prompt_ids: list[list[int]], outputs: list[list[int]], reference: list[list[int]]
) -> dict[str, Any]:
    """How many outputs equal transformers' greedy tokens; the first few mismatches with the target's margin."""
    mismatches: list[dict[str, Any]] = []
    for i, (ours, ref) in enumerate(zip(outputs, reference, strict=True)):
        position = first_difference(ours, ref)
        if position is None:
            continue
        entry: dict[str, Any] = {
            "prompt": i,
            "position": position,
            "ours": ours[position] if position < len(ours) else None,
            "reference": ref[position] if position < len(ref) else None,
        }
        if len(mismatches) < MAX_MISMATCHES:
            entry.update(logit_margin(target, prompt_ids[i] + ref[:position]))
        mismatches.append(entry)
    return {"outputs": len(outputs), "exact": len(outputs) - len(mismatches), "mismatches": mismatches[:MAX_MISMATCHES]}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, int]:
    """Outputs equal to the reference, and tokens before each output's first difference (summed)."""
    same = [first_difference(a, b) for a, b in zip(outputs, reference, strict=True)]
    prefix = sum(len(a) if p is None else p for a, p in zip(outputs, same, strict=True))
    return {"outputs": len(outputs), "equal": sum(p is None for p in same), "agreeing_prefix_tokens": prefix}


# ---------------------------------------------------------------------------------------------
# Models and prompts


def load_target(check: Check) -> dict[str, Any]:
    cfg = check.cfg
    check.target = CausalLM.load(cfg.models / "target", dtype=cfg.dtype, device=cfg.device)
    tokenizer = check.target.tokenizer
    limit = check.target.info.max_positions - cfg.max_new_tokens
    if tokenizer is None:  # a checkpoint without a tokenizer: random prompts of a held-out prompt's length
        generator = torch.Generator().manual_seed(0)
        vocab = check.target.info.vocab_size
        ids = [
            torch.randint(0, vocab, (min(300, limit),), generator=generator).tolist() for _ in range(cfg.num_prompts)
        ]
    else:
        texts = heldout_prompts(cfg.num_prompts)
        ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"])[-limit:] for t in texts]
    check.prompt_ids = [p for p in ids if p]
    return {"prompts": len(check.prompt_ids), "prompt_tokens": [len(p) for p in check.prompt_ids]}


def random_llama(shape: LlamaShape, device: torch.device, seed: int = 0) -> CausalLM:
    """``shape`` initialised at random (transformers' own init) in bf16 on ``device``; no tokenizer, no EOS."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no float32 copy of 1.1B parameters first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(shape.config())
    finally:
        torch.set_default_dtype(default)
    return CausalLM(model, tokenizer=None, path=f"<random {shape.name}>")


def tiny_models(root: Path, models: Path) -> Path:
    """The quick run's models under ``root`` in the layout of ``models/``: a 2-layer target and a 1-layer draft
    (random, saved as checkpoints with the shipped tokenizer when ``models/target`` has one), random Medusa heads and
    a random EAGLE head."""
    from transformers import AutoTokenizer

    from specserve.drafters.eagle_head import EagleConfig, EagleHead
    from specserve.training.medusa import heads_for

    tokenizer = None
    if (models / "target" / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(models / "target"), local_files_only=True)
    vocab = len(tokenizer) if tokenizer is not None else 512
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    torch.manual_seed(0)
    shapes = {"target": (64, 128, 2, 4, 2), "draft": (32, 64, 1, 2, 1)}
    built = {}
    for role, (hidden, inter, layers, heads, kv) in shapes.items():
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        model.save_pretrained(root / role)
        if tokenizer is not None:
            tokenizer.save_pretrained(root / role)
        built[role] = model
    medusa = heads_for(built["target"], num_heads=3)
    with torch.no_grad():  # zero heads would all repeat the target's next token: give them something to say
        for parameter in medusa.parameters():
            parameter.normal_(0.0, 0.05)
    medusa.save(root / "medusa")
    EagleHead(EagleConfig.for_target(built["target"])).save(root / "eagle")
    return root


# ---------------------------------------------------------------------------------------------
# Sections


def plain_section(check: Check) -> dict[str, Any]:
    """transformers' eager ``generate`` (the reference tokens), then our plain decoding in every mode."""
    cfg, target = check.cfg, check.target
    assert target is not None
    row, check.reference = run_hf(target, check.prompt_ids, cfg.max_new_tokens)
    check.report.runs.append({"model": "target", "method": "hf/eager", "drafter": None, "shape": "plain", **row})
    print(f"  hf/eager {row['tokens_per_second']:.1f} tok/s", flush=True)
    for mode in check.modes:
        run_drafter(check, mode, DrafterPlan("plain", "none", gammas=(0,), tree=False), plain=True)
    return {}


def hf_static_section(check: Check, model: str) -> dict[str, Any]:
    """transformers' static cache (compiled by transformers on a GPU) on ``model`` ("target" or "llama_1b")."""
    cfg = check.cfg
    target = check.target if model == "target" else check.llama
    prompts = check.prompt_ids if model == "target" else check.llama_prompt_ids
    assert target is not None
    row, outputs = run_hf(target, prompts, cfg.max_new_tokens, cache_implementation="static")
    reference = check.reference if model == "target" else check.llama_reference
    compiled = target.device.type == "cuda"  # transformers compiles a static-cache generate on a GPU only
    entry = {"model": model, "method": "hf/static", "drafter": None, "shape": "plain", "compiled": compiled, **row}
    if reference is not None:
        entry["agreement_with_hf_eager"] = agreement(outputs, reference)
    check.report.runs.append(entry)
    print(f"  hf/static (compiled: {compiled}) {row['tokens_per_second']:.1f} tok/s, warm-up {row['warmup_seconds']} s")
    return {"compiled": compiled}


def run_drafter(check: Check, mode: Mode, plan: DrafterPlan, plain: bool = False) -> None:
    """Every configuration of ``plan`` in ``mode`` on the shipped target, each checked against the reference."""
    cfg, target = check.cfg, check.target
    assert target is not None and check.reference is not None
    base = {"model": "target", "method": f"ours/{mode.name}", "drafter": None if plain else plan.name}
    missing = plan.missing()
    if missing is not None:
        check.report.runs.append({**base, "shape": None, "status": missing})
        print(f"  {mode.name:8s} {plan.name}: {missing}", flush=True)
        return
    drafters = build_drafter_set(plan.spec, target, dtype=cfg.dtype, device=cfg.device)
    engine = mode.engine(target, drafters)
    configs = (
        [("plain", GenerationConfig(max_new_tokens=cfg.max_new_tokens, gamma=0))]
        if plain
        else plan_configs(plan, drafters.configured, cfg.max_new_tokens)
    )
    for shape, config in configs:
        entry: dict[str, Any] = {**base, "shape": shape}
        estimate = 2.0 * check.last_config_seconds
        if not check.budget.allows(estimate):
            check.report.runs.append({**entry, "status": check.budget.skip_reason(estimate)})
            continue
        start = time.perf_counter()
        try:
            row, results = run_ours(target, engine, check.prompt_ids, config, cfg.warmup_tokens)
            outputs = [r.output_ids for r in results]
            entry.update(row, status="ok", exact=exactness(target, check.prompt_ids, outputs, check.reference))
            entry["graphs"] = graph_counts(engine)
        except Exception as exc:  # one drafter's failure must not end the section
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        check.last_config_seconds = time.perf_counter() - start
        check.report.runs.append(entry)
        print(f"  {describe_run(entry)}", flush=True)


def drafters_section(check: Check, modes: Sequence[Mode]) -> dict[str, Any]:
    plans = drafter_plans(check.cfg.models, check.cfg.quick)
    for mode in modes:
        for plan in plans:
            run_drafter(check, mode, plan)
    return {"modes": [m.name for m in modes], "drafters": [p.name for p in plans]}


def syncs_section(check: Check) -> dict[str, Any]:
    """Host synchronisations per cycle on the fastest engine, as CUDA's sync debug mode counts them, for plain
    decoding and the draft model's chains (the aim: one per cycle, the verdict's, and none in the draft steps)."""
    cfg, target = check.cfg, check.target
    assert target is not None
    if check.device.type != "cuda":
        return {"syncs": "not counted: CUDA's sync debug mode needs a CUDA device"}
    mode, counts = check.modes[0], {}
    draft = cfg.models / "draft"
    for name, spec, gamma in (("plain", "none", 0), ("draft model", str(draft), 3), ("ngram", "ngram", 7)):
        if spec == str(draft) and not (draft / "config.json").is_file():
            continue
        engine = mode.engine(target, build_drafter_set(spec, target, dtype=cfg.dtype, device=cfg.device))
        config = GenerationConfig(max_new_tokens=32, gamma=gamma)
        engine.generate(check.prompt_ids[0], None, config)  # warm: graphs captured, kernels loaded
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = engine.generate(check.prompt_ids[0], None, config)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
        cycles = max(result.stats.cycles, 1)
        counts[name] = {"mode": mode.name, "syncs": syncs, "cycles": cycles, "per_cycle": round(syncs / cycles, 2)}
        print(f"  {name}: {syncs / cycles:.2f} host synchronisations per cycle ({mode.name})", flush=True)
    return {"syncs": counts}


def verify_cost(check: Check, model: CausalLM, prefix: list[int]) -> dict[str, Any]:
    """Median ms of one forward of k tokens after ``prefix``, per mode and k (a graphed k runs at its bucket)."""
    cfg = check.cfg
    generator = torch.Generator().manual_seed(1)
    vocab = model.info.vocab_size
    blocks = {k: torch.randint(0, vocab, (k,), generator=generator).tolist() for k in cfg.verify_ks}
    table: dict[str, dict[int, float]] = {}
    for mode in check.modes:
        table[mode.name] = {
            k: round(1000 * median_forward_seconds(model, prefix, block, cfg.repeats, cache=mode.cache(model)), 4)
            for k, block in blocks.items()
        }
        print(f"  T_verify ms {mode.name:8s} " + " ".join(f"{k}:{ms:.2f}" for k, ms in table[mode.name].items()))
    return {"prefix_tokens": len(prefix), "repeats": cfg.repeats, "ms_by_k": table}


def target_verify_section(check: Check) -> dict[str, Any]:
    assert check.target is not None
    check.report.data["verify_cost"]["target"] = verify_cost(check, check.target, check.prompt_ids[0])
    return {}


def llama_section(check: Check) -> dict[str, Any]:
    """The random 1.1B Llama: our plain decoding per mode and transformers' eager ``generate``, then T_verify(k)."""
    cfg = check.cfg
    start = time.perf_counter()
    check.llama = llama = random_llama(cfg.llama, check.device)
    parameters = sum(p.numel() for p in llama.model.parameters())
    generator = torch.Generator().manual_seed(2)
    check.llama_prompt_ids = [
        torch.randint(0, cfg.llama.vocab_size, (cfg.llama_prompt_tokens,), generator=generator).tolist()
        for _ in range(cfg.llama_prompts)
    ]
    built = time.perf_counter() - start
    row, reference = run_hf(llama, check.llama_prompt_ids, cfg.max_new_tokens)
    check.llama_reference = reference
    check.report.runs.append({"model": "llama_1b", "method": "hf/eager", "drafter": None, "shape": "plain", **row})
    print(f"  llama hf/eager {row['tokens_per_second']:.1f} tok/s", flush=True)
    config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, gamma=0, ignore_eos=True)
    for mode in check.modes:
        entry: dict[str, Any] = {"model": "llama_1b", "method": f"ours/{mode.name}", "drafter": None, "shape": "plain"}
        try:
            engine = mode.engine(llama, build_drafter_set("none", llama, device=cfg.device))
            row, results = run_ours(llama, engine, check.llama_prompt_ids, config, cfg.warmup_tokens)
            outputs = [r.output_ids for r in results]
            entry.update(row, status="ok", agreement_with_hf_eager=agreement(outputs, reference))
            entry["graphs"] = graph_counts(engine)
        except Exception as exc:  # the other modes still run
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        check.report.runs.append(entry)
        print(f"  llama {describe_run(entry)}", flush=True)
    check.report.data["verify_cost"]["llama_1b"] = verify_cost(check, llama, check.llama_prompt_ids[0])
    return {"shape": asdict(cfg.llama), "parameters": parameters, "build_seconds": round(built, 2)}


def batched_target_section(check: Check) -> dict[str, Any]:
    """The shipped target in batches, plain and with its draft model, against transformers' batching
    (:mod:`specserve.benchmarks.device_batch`)."""
    assert check.target is not None
    cfg, rows = check.cfg, check.report.data["batched"]
    draft = cfg.models / "draft"
    return batched_section(
        "target", check.target, check.prompt_ids, draft, cfg.batch_levels, rows.append, cfg.batch_max_new_tokens
    )


def batched_llama_section(check: Check) -> dict[str, Any]:
    """The random 1.1B Llama in batches, plain, against transformers' batching."""
    assert check.llama is not None
    cfg, rows = check.cfg, check.report.data["batched"]
    prompts = check.llama_prompt_ids
    return batched_section(
        "llama_1b",
        check.llama,
        prompts,
        None,
        cfg.batch_levels,
        rows.append,
        cfg.batch_max_new_tokens,
        every_row_count=False,
    )


# ---------------------------------------------------------------------------------------------
# Summary: speedups, targets, environment


def summarise(report: Report) -> None:
    """Each run's speedups: over plain decoding in its own mode, over our graphed plain, over transformers' eager."""
    runs = [r for r in report.runs if r.get("tokens_per_second")]

    def rate(model: str, method: str) -> float | None:
        found = next((r for r in runs if r["model"] == model and r["method"] == method and r["shape"] == "plain"), None)
        return found["tokens_per_second"] if found else None

    for r in runs:
        plain, graphed, hf = (
            rate(r["model"], r["method"]),
            rate(r["model"], "ours/graphs"),
            rate(r["model"], "hf/eager"),
        )
        if r["drafter"] is not None:
            r["speedup_over_plain"] = r["tokens_per_second"] / plain if plain else None
            r["speedup_over_graphed_plain"] = r["tokens_per_second"] / graphed if graphed else None
        else:
            r["over_hf_eager"] = r["tokens_per_second"] / hf if hf else None


def target_entry(name: str, value: float | None, threshold: float, detail: str) -> dict[str, Any]:
    status = "NOT EVALUATED" if value is None else "PASS" if value >= threshold else "FAIL"
    return {"target": name, "value": value, "threshold": threshold, "status": status, "detail": detail}


def evaluate_targets(report: Report) -> list[dict[str, Any]]:
    runs = [r for r in report.runs if r["model"] == "target" and r.get("status", "ok") == "ok"]
    plain = {r["method"]: r for r in runs if r["drafter"] is None}
    hf = plain.get("hf/eager")

    def over_hf(method: str) -> tuple[float | None, str]:
        ours = plain.get(method)
        if ours is None or hf is None:
            return None, f"{method} or hf/eager not measured"
        ratio = ours["tokens_per_second"] / hf["tokens_per_second"]
        return ratio, f"{ours['tokens_per_second']:.1f} vs {hf['tokens_per_second']:.1f} tok/s"

    targets = []
    for method, threshold, label in (
        ("ours/graphs", GRAPHED_OVER_HF, "plain with CUDA graphs"),
        ("ours/static", UNGRAPHED_OVER_HF, "plain without graphs (static shapes)"),
        ("ours/dynamic", UNGRAPHED_OVER_HF, "plain without graphs (dynamic cache)"),
    ):
        value, detail = over_hf(method)
        targets.append(target_entry(f"{label} >= {threshold:g}x transformers eager plain", value, threshold, detail))
    drafted = [r for r in runs if r["drafter"] is not None and r.get("speedup_over_graphed_plain") is not None]
    best = max(drafted, key=lambda r: r["speedup_over_graphed_plain"], default=None)
    targets.append(
        target_entry(
            f"best drafter >= {BEST_DRAFTER_OVER_GRAPHED:g}x our graphed plain (greedy)",
            None if best is None else best["speedup_over_graphed_plain"],
            BEST_DRAFTER_OVER_GRAPHED,
            "no drafter ran on the graphed engine"
            if best is None
            else f"{best['drafter']}, {best['shape']}, {best['method']}: {best['tokens_per_second']:.1f} tok/s",
        )
    )
    checked = [r["exact"] for r in runs if "exact" in r]
    outputs = sum(e["outputs"] for e in checked)
    exact = sum(e["exact"] for e in checked)
    targets.append(
        target_entry(
            "greedy exactness 100 % (every output of ours equals transformers' greedy)",
            100.0 * exact / outputs if outputs else None,
            100.0,
            f"{exact}/{outputs} outputs over {len(checked)} configurations",
        )
    )
    targets += batched_targets(report.data["batched"], target_entry)
    loaded = [name for name in MUST_NOT_LOAD if sys.modules.get(name) is not None]
    targets.append(
        {
            "target": f"import closure free of {', '.join(MUST_NOT_LOAD)}",
            "value": loaded,
            "threshold": [],
            "status": "FAIL" if loaded else "PASS",
            "detail": f"loaded: {', '.join(loaded)}" if loaded else "none loaded",
        }
    )
    return targets


def environment(cfg: CheckConfig, device: torch.device, skipped_modes: dict[str, str]) -> dict[str, Any]:
    cuda = device.type == "cuda"
    models = {}
    for name in ("target", "draft", "medusa", "eagle", "exit-head"):
        folder = cfg.models / name
        models[name] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "cpu_threads": torch.get_num_threads(),
        "models_dir": str(cfg.models),
        "model_bytes": models,
        "skipped_modes": skipped_modes,
    }


def loaded_packages() -> list[str]:
    """The top-level packages outside the standard library this process has imported."""
    names = {name.split(".")[0] for name, module in sys.modules.items() if module is not None}
    return sorted(n for n in names - set(sys.stdlib_module_names) if not n.startswith("_"))


# ---------------------------------------------------------------------------------------------
# Output


def describe_run(r: dict[str, Any]) -> str:
    name = f"{r['method']:13s} {r['drafter'] or 'plain':24s} {r['shape'] or '':22s}"
    if r.get("status", "ok") != "ok":
        return f"{name} {r.get('error') or r['status']}"
    exact = r.get("exact")
    exact_text = f"exact {exact['exact']}/{exact['outputs']}" if exact else ""
    accepted = f"acc {r['mean_accepted']:.2f}" if r.get("drafter") else ""
    graphs = r.get("graphs")
    graph_text = f" graphs: {graphs['captured']} captured, {graphs['replays']} replays, {graphs['eager_runs']} eager" \
        if graphs else ""  # fmt: skip
    return f"{name} {r['tokens_per_second']:8.1f} tok/s {accepted:9s} {exact_text}{graph_text}"


def print_summary(report: Report) -> None:
    data = report.data
    print("\n== runs (tok/s end to end, prefill included; ours also detokenises as it goes)")
    order = {"target": 0, "llama_1b": 1}
    runs = sorted(report.runs, key=lambda r: (order.get(r["model"], 2), r["drafter"] is not None))
    print(f"{'model':9s} {'method':13s} {'drafter':24s} {'shape':22s} {'tok/s':>8s} {'x plain':>8s} "
          f"{'x graphed':>9s} {'x hf':>6s} {'acc':>5s} exact")  # fmt: skip
    for r in runs:
        if r.get("status", "ok") != "ok":
            print(f"{r['model']:9s} {r['method']:13s} {r['drafter'] or 'plain':24s} {r['shape'] or '':22s} "
                  f"{r.get('error') or r['status']}")  # fmt: skip
            continue
        exact = r.get("exact")
        exact_text = f"{exact['exact']}/{exact['outputs']}" if exact else ""
        print(
            f"{r['model']:9s} {r['method']:13s} {r['drafter'] or 'plain':24s} {r['shape']:22s} "
            f"{r['tokens_per_second']:8.1f} {cell(r.get('speedup_over_plain')):>8s} "
            f"{cell(r.get('speedup_over_graphed_plain')):>9s} {cell(r.get('over_hf_eager')):>6s} "
            f"{cell(r.get('mean_accepted') if r['drafter'] else None):>5s} "
            f"{exact_text}"
        )
    if data["batched"]:
        print("\n== batched (c requests at once, greedy; tok/s end to end, prefill included)")
        print(f"{'model':9s} {'c':>3s} {'method':25s} {'tok/s':>9s} {'ITL p50 ms':>10s} {'attention':9s} equal")
        for r in data["batched"]:
            if r.get("status") != "ok":
                print(f"{r['model']:9s} {r['concurrency']:3d} {r['method']:25s} {r.get('error')}")
                continue
            print(f"{r['model']:9s} {r['concurrency']:3d} {r['method']:25s} {r['tokens_per_second']:9.1f} "
                  f"{cell(r['itl_p50_ms']):>10s} {r.get('attention', '-'):9s} "
                  f"{r['equal_to_one_at_a_time']}/{r['requests']}")  # fmt: skip
        for name in ("batched_target", "batched_llama_1b"):
            for kind, counts in (data["sections"].get(name, {}).get("step_counts") or {}).items():
                if counts.get("status") == "ok":
                    syncs, launches = counts["host_syncs_per_step"], counts["kernel_launches_per_step"]
                    print(f"{name} ({kind}): {syncs:.1f} host syncs and {launches:.0f} kernel launches per decode "
                          f"step at {counts['concurrency']} requests")  # fmt: skip
    for model, costs in data["verify_cost"].items():
        print(f"\n== T_verify(k), {model}: median ms per forward after {costs['prefix_tokens']} cached tokens")
        for mode, by_k in costs["ms_by_k"].items():
            print(f"{mode:8s} " + " ".join(f"{k}:{ms:.2f}" for k, ms in by_k.items()))
    print("\n== sections")
    for name, entry in data["sections"].items():
        print(f"{name:22s} {entry['status']:10s} {entry.get('seconds', '')} {entry.get('error', '')}")
    print("\n== targets")
    for t in data["targets"]:
        value = t["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else "-" if value is None else str(value)
        print(f"{t['status']:13s} {t['target']}: {shown} ({t['detail']})")


def cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(report: Report, path: Path) -> str | None:
    """``device_check.png``: plain rates and T_verify(k) of both models, drafter speedups, the targets. The reason
    when it cannot be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (the JSON has everything)"
    runs = [r for r in report.runs if r.get("status", "ok") == "ok" and r.get("tokens_per_second")]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    for row, model in enumerate(("target", "llama_1b")):
        plain = [r for r in runs if r["model"] == model and r["drafter"] is None]
        ax = axes[row][0]
        ax.bar([r["method"] for r in plain], [r["tokens_per_second"] for r in plain], color="tab:blue")
        ax.set_title(f"plain decoding, {model} (tokens/s)")
        ax.tick_params(axis="x", rotation=20)
        ax = axes[row][1] if row == 1 else axes[0][2]
        costs = report.data["verify_cost"].get(model)
        for mode, by_k in (costs or {}).get("ms_by_k", {}).items():
            ks = sorted(by_k)
            ax.plot(ks, [by_k[k] for k in ks], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (tokens in one forward)")
        ax.set_ylabel("median ms per forward")
        ax.set_title(f"T_verify(k), {model}")
        if costs:
            ax.legend(fontsize=8)
    drafted = [r for r in runs if r["drafter"] is not None and r["model"] == "target"]
    key = "speedup_over_graphed_plain" if any(r.get("speedup_over_graphed_plain") for r in drafted) else None
    key = key or "speedup_over_plain"
    ax = axes[0][1]
    ax.barh([f"{r['drafter']}, {r['shape']} [{r['method'][5:]}]" for r in drafted],
            [r.get(key) or 0.0 for r in drafted], color="tab:green")  # fmt: skip
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(BEST_DRAFTER_OVER_GRAPHED, color="red", ls="--", lw=0.8)
    ax.set_title(f"drafters on the target: {key.replace('_', ' ')}")
    ax.tick_params(axis="y", labelsize=6)
    ax = axes[1][2]
    ax.axis("off")
    lines = [f"{t['status']}: {t['target']}  [{cell(t['value']) if isinstance(t['value'], float) else t['value']}]"
             for t in report.data["targets"]]  # fmt: skip
    ax.text(0.0, 1.0, "\n".join(lines), va="top", fontsize=8, family="monospace", wrap=True)
    ax.set_title("targets")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str]) -> CheckConfig:
    parser = argparse.ArgumentParser(prog="device_check", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default=None, help="the shipped target's dtype (default float32; --quick float64)")
    parser.add_argument("--models", type=Path, default=defaults.MODELS_DIR, help="the models directory")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument(
        "--budget", type=float, default=None, help=f"seconds for everything (default {BUDGET_SECONDS:g})"
    )
    parser.add_argument("--out", type=Path, default=CheckConfig.out_dir, help="where the JSON and PNG go")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny random models, 2 prompts x 8 tokens")
    args = parser.parse_args(list(argv))
    cfg = CheckConfig(device=args.device, models=args.models, out_dir=args.out, quick=args.quick)
    if args.quick:
        cfg = replace(cfg, **QUICK)  # type: ignore[arg-type]
    given = {"dtype": args.dtype, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
             "budget_seconds": args.budget}  # fmt: skip
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if cfg.num_prompts < 1 or cfg.max_new_tokens < 1:
        parser.error("--num-prompts and --max-new-tokens must be >= 1")
    return cfg


def device_error(name: str) -> str | None:
    """One line saying why ``name`` cannot run here, or ``None``."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"device_check: --device {name} needs CUDA, but torch {torch.__version__} ({build}) sees no CUDA "
                "device here; on a CPU run --device cpu --quick")  # fmt: skip
    if name != "cpu" and not name.startswith("cuda"):
        return f"device_check: --device must be cuda or cpu, got {name!r}"
    return None


def main(argv: Sequence[str] | None = None, start: float | None = None) -> int:
    """Run the check; 0 when it ran to the end (the targets' PASS / FAIL are results, not errors), 2 when this
    machine cannot run what was asked. ``start``: when the process began (the budget counts from it)."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    error = device_error(cfg.device)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()  # weights load in a blink; keep the log to our lines
    report = Report(cfg, Budget(cfg.budget_seconds, start))
    device = torch.device(cfg.device)
    modes, skipped = engine_modes(device)
    report.data["environment"] = environment(cfg, device, skipped)
    check = Check(cfg, report, device, modes)
    with tempfile.TemporaryDirectory(prefix="device-check-") as scratch:
        if cfg.quick:
            check.cfg = cfg = replace(cfg, models=tiny_models(Path(scratch), cfg.models))
        loaded, referenced, llama = check.has_target, check.has_reference, check.has_llama
        # (section, GPU seconds it needs at least, what it runs, what it needs from an earlier section)
        sections: list[tuple[str, float, Callable[[], dict[str, Any]], tuple[str, Callable[[], bool]] | None]] = [
            ("load", 30.0, lambda: load_target(check), None),
            ("plain", 30.0, lambda: plain_section(check), ("load", loaded)),
            ("drafters", 30.0, lambda: drafters_section(check, modes[:1]), ("plain", referenced)),
            ("verify_cost", 10.0, lambda: target_verify_section(check), ("load", loaded)),
            ("syncs", 10.0, lambda: syncs_section(check), ("load", loaded)),
            ("batched_target", 60.0, lambda: batched_target_section(check), ("load", loaded)),
            ("llama_1b", 40.0, lambda: llama_section(check), None),
            ("batched_llama_1b", 90.0, lambda: batched_llama_section(check), ("llama_1b", llama)),
            ("hf_static_target", 60.0, lambda: hf_static_section(check, "target"), ("load", loaded)),
            ("drafters_dynamic", 30.0, lambda: drafters_section(check, modes[-1:]), ("plain", referenced)),
            ("hf_static_llama_1b", 90.0, lambda: hf_static_section(check, "llama_1b"), ("llama_1b", llama)),
        ]  # fmt: skip
        for name, estimate, body, needs in sections:
            if needs is not None and not needs[1]():
                report.skip(name, f"skipped: needs what section {needs[0]!r} did not finish")
            else:
                report.section(name, estimate, body)
    report.data["environment"]["loaded_packages"] = loaded_packages()
    summarise(report)
    report.data["targets"] = evaluate_targets(report)
    report.data["elapsed_seconds"] = round(cfg.budget_seconds - report.budget.left(), 1)
    json_path = report.save()
    try:
        plot_note = plot(report, cfg.out_dir / "device_check.png")
    except Exception as exc:  # a plot is a convenience: the JSON and the lines below are the results
        plot_note = f"no plot: {type(exc).__name__}: {exc}"
    if plot_note is not None:
        report.data["plot"] = plot_note
        report.save()
    print_summary(report)
    if plot_note:
        print(plot_note)
    statuses = {t["target"]: t["status"] for t in report.data["targets"]}
    print(json.dumps({"device_check": str(json_path), "elapsed_seconds": report.data["elapsed_seconds"], **statuses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
