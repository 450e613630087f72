"""Shadow checks: does a finished speculative request equal what plain decoding of the same request gives?

Speculation must change nothing: greedy output is the target's own greedy decoding, and a seeded
drafter-invariant sample (:mod:`specserve.core.verify.invariant`) is a function of the seed and the target
alone. So a replica can take a finished request, decode it again without a drafter, and compare
token for token. This module holds what that takes, with no scheduling and no I/O but the bundle:

* :func:`skip_reason` — whether plain decoding reproduces a request at all. Greedy and
  drafter-invariant requests are checkable. A rejection-sampled request (the default at T > 0) is
  distributed as the target's but its tokens depend on the drafter, so it is ``"sampled"``; a
  request under a lossy acceptance rule (typical acceptance) is ``"lossy"``. Both are skipped.
* :func:`plain_request` — the same request without speculation: drafter ``none``, γ 0, no tree,
  its own prefix-cache namespace (a shadow run never reads KV a live request cached, so a wrong
  cached prefix cannot hide), and the top :data:`ALTERNATIVES` log-probabilities of every token
  (processed: the scores argmax was taken over), so that a divergence can be explained.
* :func:`classify` — the first divergence between the two outputs, and whether it is a *near tie*:
  the plain run's best score and the speculative run's token's score at that position (greedy: the
  log-probabilities; drafter-invariant: log-probability + the position's Gumbel noise) differ by at
  most :func:`near_tie_tolerance` (:data:`NEAR_TIE_ULPS` units in the last place of the model's dtype
  at that magnitude). A speculative verify computes k positions in one forward where plain decoding
  computes one, with other kernels and reduction orders; on bf16 that legitimately flips an argmax
  between two nearly equal logits. The tolerance is a stated heuristic, not a proof: a divergence
  beyond it, or one whose speculative token is not among the plain run's alternatives, is a
  ``mismatch``.
* :class:`ShadowJob`, :func:`write_bundle`, :func:`load_bundle` — one request as checked and the
  JSON *repro bundle* a mismatch writes (prompt ids, sampling and generation settings, seed,
  drafter and policy, both outputs, the first divergence, versions, dtype, device, the replica's
  settings), which ``specserve replay BUNDLE`` re-runs in one process.

Does not: decide when to check (:mod:`specserve.serve.shadow` does, at low priority), run a model,
or check rejection-sampled requests statistically (the chi-square suites of tests/ do that offline).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import MAX_LOGPROBS, GrammarSpec, SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.core.verify.invariant import gumbel_noise
from specserve.core.verify.logprobs import TokenLogprob

SHADOW_NAMESPACE = "specserve-shadow"  # never a client's: theirs are "" or 32 hex digits (serve.schemas)
ALTERNATIVES = MAX_LOGPROBS  # the plain run's top log-probabilities per token, to price a divergence
NEAR_TIE_ULPS = 64
"""A divergence is a near tie when the two scores differ by at most this many units in the last place of the
model's dtype at their magnitude (at least 1): 0.5 for bf16 near 1, 7.6e-6 for float32, 1.4e-14 for float64."""
BUNDLE_VERSION = 1

Result = Literal["match", "mismatch", "near_tie"]
SkipReason = Literal["sampled", "lossy"]


def skip_reason(params: SamplingParams) -> SkipReason | None:
    """``None`` when plain decoding reproduces a request with these sampling settings token for token."""
    if params.lossy_acceptance:
        return "lossy"
    if not params.greedy and not params.drafter_invariant:
        return "sampled"
    return None


def plain_request(params: SamplingParams, config: GenerationConfig) -> tuple[SamplingParams, GenerationConfig]:
    """The request decoded plainly: no drafter, its own cache namespace, the top alternatives of every token."""
    plain_params = dataclasses.replace(params, logprobs=ALTERNATIVES, logprobs_mode="processed")
    plain_config = dataclasses.replace(
        config, drafter="none", gamma=0, tree=None, policy="fixed", cache_namespace=SHADOW_NAMESPACE
    )
    return plain_params, plain_config


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one is a prefix of the other);
    ``None`` when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def near_tie_tolerance(dtype: torch.dtype, magnitude: float) -> float:
    """:data:`NEAR_TIE_ULPS` units in the last place of ``dtype`` at ``magnitude`` (at least 1)."""
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * max(1.0, abs(magnitude))


@dataclass(frozen=True)
class Divergence:
    """Where the speculative output first differs from the plain one, and why that may be legitimate."""

    position: int  # index into the output
    speculative: int | None  # the speculative run's token there (None: it had ended)
    plain: int | None  # the plain run's token there (None: it had ended)
    gap: float | None  # plain's best score minus the speculative token's, at that position (None: unknown)
    tolerance: float
    near_tie: bool

    @property
    def result(self) -> Result:
        return "near_tie" if self.near_tie else "mismatch"


def classify(
    speculative: Sequence[int],
    plain: Sequence[int],
    plain_logprobs: Sequence[TokenLogprob],
    params: SamplingParams,
    prompt_len: int,
    vocab: int,
    dtype: torch.dtype,
) -> Divergence | None:
    """The first divergence of the two outputs, or ``None`` when they are equal. ``plain_logprobs``: the plain
    run's (processed, with alternatives) per token; ``prompt_len`` and ``vocab`` locate a drafter-invariant
    request's noise."""
    at = first_divergence(speculative, plain)
    if at is None:
        return None
    spec_token = speculative[at] if at < len(speculative) else None
    plain_token = plain[at] if at < len(plain) else None
    gap = None
    magnitude = 0.0
    if spec_token is not None and plain_token is not None and at < len(plain_logprobs):
        scores = dict(plain_logprobs[at].top)
        scores.setdefault(plain_token, plain_logprobs[at].logprob)
        if spec_token in scores:
            best, theirs = scores[plain_token], scores[spec_token]
            magnitude = max(abs(best), abs(theirs))
            if params.drafter_invariant and not params.greedy:
                noise = gumbel_noise(params.seed, [prompt_len + at], vocab)[0]
                best += float(noise[plain_token])
                theirs += float(noise[spec_token])
            gap = best - theirs
    tolerance = near_tie_tolerance(dtype, magnitude)
    near_tie = gap is not None and math.isfinite(gap) and abs(gap) <= tolerance
    return Divergence(at, spec_token, plain_token, gap, tolerance, near_tie)


# -----------------------------------------------------------------------------------------
# What is checked, and the bundle a mismatch leaves


@dataclass
class ShadowJob:
    """One finished request, as a shadow check needs it."""

    prompt_ids: list[int]
    params: SamplingParams
    config: GenerationConfig
    output_ids: list[int]
    finish_reason: str
    drafter: str  # the metrics' drafter tag: what drafted it (e.g. "draft_model", "ngram")
    finished_at: float = field(default_factory=time.time)


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    out["logit_bias"] = [list(pair) for pair in params.logit_bias]
    return out


def params_from_json(body: Mapping[str, Any]) -> SamplingParams:
    values = dict(body)
    grammar = values.pop("grammar", None)
    values["logit_bias"] = tuple((int(t), float(b)) for t, b in values.get("logit_bias", ()))
    return SamplingParams(**values, grammar=GrammarSpec(**grammar) if grammar else None)


def config_to_json(config: GenerationConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "tree"}
    out["stop"] = list(config.stop)
    tree = config.tree
    out["tree"] = (
        None
        if tree is None
        else {
            "kind": tree.kind,
            "paths": [list(p) for p in tree.topology.paths] if tree.topology is not None else None,
            "budget": dataclasses.asdict(tree.budget) if tree.budget is not None else None,
        }
    )
    return out


def config_from_json(body: Mapping[str, Any]) -> GenerationConfig:
    values = dict(body)
    tree = values.pop("tree", None)
    values["stop"] = tuple(values.get("stop", ()))
    spec = None
    if tree is not None:
        topology = TreeTopology(tuple(tuple(p) for p in tree["paths"])) if tree.get("paths") is not None else None
        budget = TreeBudget(**tree["budget"]) if tree.get("budget") is not None else None
        spec = TreeSpec(tree["kind"], topology, budget)
    return GenerationConfig(**values, tree=spec)


@dataclass(frozen=True)
class Bundle:
    """A repro bundle, as :func:`load_bundle` reads it back."""

    path: Path
    job: ShadowJob
    plain_ids: list[int]
    divergence: Divergence
    context: dict[str, Any]  # model, versions, dtype, device, the replica's settings

    @property
    def replica(self) -> dict[str, Any]:
        return dict(self.context.get("replica", {}))


def versions() -> dict[str, str]:
    """The versions a bundle records (a mismatch may be a library's)."""
    import transformers

    import specserve

    return {"specserve": specserve.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def write_bundle(
    directory: str | os.PathLike[str],
    job: ShadowJob,
    plain_ids: Sequence[int],
    divergence: Divergence,
    context: Mapping[str, Any],
    keep: int = 100,
) -> Path:
    """Write a JSON repro bundle under ``directory`` (made if missing) and return its path; at most ``keep`` bundles
    are kept there (the oldest go first)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(job.finished_at))
    path = root / f"shadow-{stamp}-{os.getpid()}-{time.monotonic_ns() % 10**9:09d}.json"
    body = {
        "bundle_version": BUNDLE_VERSION,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "result": divergence.result,
        "first_divergence": dataclasses.asdict(divergence),
        "prompt_ids": list(job.prompt_ids),
        "sampling": params_to_json(job.params),
        "seed": job.params.seed,
        "generation": config_to_json(job.config),
        "drafter": job.drafter,
        "policy": job.config.policy,
        "speculative_ids": list(job.output_ids),
        "speculative_finish_reason": job.finish_reason,
        "plain_ids": list(plain_ids),
        "versions": versions(),
        **dict(context),
    }
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(body, indent=1, default=str))
    temporary.replace(path)  # a reader never sees half a bundle
    old = sorted(root.glob("shadow-*.json"))
    for stale in old[: max(0, len(old) - keep)]:
        stale.unlink(missing_ok=True)
    return path


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    body = json.loads(Path(path).read_text())
    if body.get("bundle_version") != BUNDLE_VERSION:
        raise ValueError(
            f"{path}: bundle version {body.get('bundle_version')!r}, this specserve reads {BUNDLE_VERSION}"
        )
    job = ShadowJob(
        prompt_ids=[int(t) for t in body["prompt_ids"]],
        params=params_from_json(body["sampling"]),
        config=config_from_json(body["generation"]),
        output_ids=[int(t) for t in body["speculative_ids"]],
        finish_reason=body["speculative_finish_reason"],
        drafter=body["drafter"],
    )
    known = {
        "bundle_version", "result", "first_divergence", "prompt_ids", "sampling", "seed", "generation",
        "drafter", "policy", "speculative_ids", "speculative_finish_reason", "plain_ids",
    }  # fmt: skip
    context = {key: value for key, value in body.items() if key not in known}
    return Bundle(Path(path), job, [int(t) for t in body["plain_ids"]], Divergence(**body["first_divergence"]), context)
