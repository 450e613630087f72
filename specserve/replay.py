"""``specserve replay BUNDLE``: re-run a shadow check's repro bundle in one process, to confirm or clear it.

A replica whose shadow check found speculation changing a request's output
(:mod:`specserve.serve.shadow`) wrote a JSON bundle: the prompt ids, sampling and generation settings
(seed included), drafter, policy, both outputs, versions and the replica's settings
(:func:`~specserve.core.shadow.write_bundle`). This command loads the replica's target and drafter
here (the bundle's paths, or ``--target`` / ``--draft``), generates the request twice — as the replica
did (its drafter, γ, tree and policy) and plainly — and compares them as the replica did
(:func:`~specserve.core.shadow.classify`):

* **confirmed** (exit 1): the speculative run differs from the plain one here too, beyond a near tie.
  It says whether the speculative output equals the replica's (a deterministic bug, reproduced) and
  where the two runs diverge.
* **near tie** (exit 3): they differ where the target's two best scores are within its dtype's rounding.
* **cleared** (exit 0): here the speculative run equals plain decoding. The replica's divergence came from
  something one process does not have (another device or dtype, a batch's composition, a fault since
  fixed, a library version: the bundle records them).

By default it runs the engine the replica ran: the in-process batched engine for a ``batched`` replica (the
request alone in its batch), else the single-request engine (which is what the distributed runtime computes).
``--json`` prints the report as JSON. Does not: contact a cluster, or replay a batch's other requests.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.core.errors import UserError

if TYPE_CHECKING:
    from specserve.core.request import GenerationConfig, GenerationResult
    from specserve.core.sampling.params import SamplingParams
    from specserve.core.shadow import Bundle, Divergence

EXIT = {"cleared": 0, "confirmed": 1, "near_tie": 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="a shadow-check bundle (shadow-*.json) a replica wrote")
    parser.add_argument("--target", help="the target's directory, when it is not where the replica had it")
    parser.add_argument("--draft", help="the drafter spec, when it is not what the replica had")
    parser.add_argument(
        "--engine",
        choices=("auto", "single", "batched"),
        default="auto",
        help="the engine to replay on: auto = the replica's (batched for a batched replica, else single)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), help="where to compute; default: the replica's")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


@dataclass(frozen=True)
class ReplayReport:
    verdict: str  # confirmed, near_tie or cleared
    engine: str
    reproduces_replica: bool  # the speculative output here equals the replica's
    # the plain output here agrees with the replica's shadow run (which stopped at the first divergence)
    plain_agrees: bool
    divergence: Divergence | None  # between the speculative and the plain run here
    speculative_ids: list[int]
    plain_ids: list[int]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["divergence"] = asdict(self.divergence) if self.divergence is not None else None
        return out


def run_command(args: argparse.Namespace) -> int:
    from specserve.core.shadow import load_bundle

    path = Path(args.bundle)
    if not path.is_file():
        raise UserError(f"no bundle at {path}: give the path of a shadow-*.json file a replica wrote")
    try:
        bundle = load_bundle(path)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a shadow-check bundle this specserve reads: {exc}") from exc
    report = replay(bundle, args.engine, target=args.target, draft=args.draft, device=args.device)
    print(json.dumps(report.to_dict()) if args.json else describe(bundle, report))
    return EXIT[report.verdict]


def replay(
    bundle: Bundle, engine: str = "auto", target: str | None = None, draft: str | None = None, device: str | None = None
) -> ReplayReport:
    """Generate the bundle's request speculatively and plainly here, and compare."""
    import torch

    from specserve.core.shadow import classify, plain_request
    from specserve.serve.config import ServeConfig

    overrides = {key: value for key, value in (("target", target), ("draft", draft), ("device", device)) if value}
    settings = {**bundle.replica, **overrides}
    kind = engine if engine != "auto" else ("batched" if bundle.context.get("path") == "batched" else "single")
    job = bundle.job
    params = replace(job.params, logprobs=None)
    plain_params, plain_config = plain_request(job.params, job.config)
    if kind == "batched":
        from specserve.serve.model_server import load_batched_engine

        batched = load_batched_engine(ServeConfig(**{**settings, "max_num_seqs": 1}))
        speculative = _run_batched(batched, job.prompt_ids, params, job.config)
        plain = _run_batched(batched, job.prompt_ids, plain_params, plain_config)
        vocab = batched.prompts.info.vocab_size
    else:
        from specserve.cluster.replica_config import ReplicaConfig
        from specserve.generate import build_engine

        single = build_engine(ReplicaConfig(**settings))
        speculative = single.generate(job.prompt_ids, params, job.config)
        plain = single.generate(job.prompt_ids, plain_params, plain_config)
        vocab = single.prompts.info.vocab_size
    dtype = getattr(torch, settings.get("dtype", "float32"))
    divergence = classify(
        speculative.output_ids, plain.output_ids, plain.logprobs or [], job.params, len(job.prompt_ids), vocab, dtype
    )
    verdict = "cleared" if divergence is None else ("near_tie" if divergence.near_tie else "confirmed")
    return ReplayReport(
        verdict,
        kind,
        speculative.output_ids == job.output_ids,
        plain.output_ids[: len(bundle.plain_ids)] == bundle.plain_ids,
        divergence,
        speculative.output_ids,
        plain.output_ids,
    )


def _run_batched(engine: Any, prompt: list[int], params: SamplingParams, config: GenerationConfig) -> GenerationResult:
    """One request alone through a batched engine, to its end."""
    request = engine.submit(prompt, params, config)
    while True:
        for request_id, chunk in engine.step():
            if request_id != request:
                continue
            if isinstance(chunk, Exception):
                raise chunk
            if chunk.result is not None:
                return chunk.result


def describe(bundle: Bundle, report: ReplayReport) -> str:
    job = bundle.job
    lines = [
        f"bundle: {bundle.path} (written {bundle.context.get('written', '?')}; the replica found a "
        f"{bundle.divergence.result} at output token {bundle.divergence.position})",
        f"request: {len(job.prompt_ids)} prompt tokens, drafter {job.drafter}, policy {job.config.policy}, "
        f"gamma {job.config.gamma}, tree {job.config.tree.kind if job.config.tree else 'none'}, "
        f"{'greedy' if job.params.greedy else f'temperature {job.params.temperature}, seed {job.params.seed}'}",
        f"replayed on the {report.engine} engine here:",
        f"  speculative output equals the replica's: {'yes' if report.reproduces_replica else 'no'}",
        f"  plain output agrees with the replica's plain run: {'yes' if report.plain_agrees else 'no'}",
    ]
    d = report.divergence
    if d is None:
        lines.append("CLEARED: here the speculative run equals plain decoding token for token")
    else:
        gap = (
            "unknown (the speculative token is not among the plain run's alternatives)"
            if d.gap is None
            else f"{d.gap:.6g}"
        )
        lines.append(
            f"{'NEAR TIE' if d.near_tie else 'CONFIRMED'}: the runs diverge at output token {d.position} "
            f"(speculative {d.speculative}, plain {d.plain}); score gap {gap}, near-tie tolerance {d.tolerance:.3g}"
        )
    return "\n".join(lines)
