"""Shadow checks: a replica re-decodes its finished requests plainly when idle and compares token for token.

In process (a :class:`ModelServer` over the real batched engine, and over the single-request engine as the
runner path, on the tiny llama pair saved to disk, float64):

* a mixed workload at ``shadow_fraction`` 1 (greedy chains and trees, drafter-invariant T = 1 with and without
  a client seed, n-gram) matches on every check; rejection-sampled and lossy requests are counted skipped;
* a shadow run is closed when a live request arrives and runs again later (the live request is not held);
* a verifier broken on purpose (one acceptance decision flipped: a test-only monkeypatch) is caught: the
  mismatch is counted (metric and status), a bundle is written, and ``specserve replay`` confirms it with the
  same fault and clears it without;
* the pieces alone: :func:`classify` (mismatch, near tie, drafter-invariant noise, an output that ends early),
  the bundle's JSON round trip, :func:`skip_reason`, the bounded queue.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import randomise_
from metric_helpers import record_metrics

import specserve.core.target as target_module
from specserve.cli import main as cli_main
from specserve.core.batch_engine import BatchedEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.shadow import (
    ShadowJob,
    classify,
    config_from_json,
    config_to_json,
    load_bundle,
    near_tie_tolerance,
    params_from_json,
    params_to_json,
    skip_reason,
)
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.core.verify.chain import ChainVerdict
from specserve.core.verify.invariant import gumbel_noise
from specserve.core.verify.logprobs import TokenLogprob
from specserve.drafters.registry import request_drafters
from specserve.generate import build_engine
from specserve.policies.drift import WARMUP
from specserve.policies.schedules import schedules
from specserve.replay import replay
from specserve.serve.config import ServeConfig
from specserve.serve.model_server import ModelServer, build_runner
from specserve.serve.shadow import ShadowChecks

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams()
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))


def settings(dirs: dict[str, Path], tmp_path: Path, **extra: Any) -> ServeConfig:
    return ServeConfig(
        target=str(dirs["target"]),
        draft=str(dirs["draft"]),
        dtype="float64",
        model_name="tiny",
        gamma=3,
        shadow_fraction=1.0,
        shadow_dir=str(tmp_path / "bundles"),
        **extra,
    )


@pytest.fixture(scope="module")
def batched(saved_pair_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServer]:
    server = ModelServer(
        settings(saved_pair_dirs, tmp_path_factory.mktemp("shadow"), max_num_seqs=4, max_queue=32), build_runner
    )
    yield server
    server.shutdown()


async def run(server: ModelServer, prompt: list[int], params: SamplingParams, config: GenerationConfig) -> list[int]:
    tokens: list[int] = []
    async for chunk in server.generate(prompt, params, config):
        tokens.extend(chunk.token_ids)
    return tokens


def workload() -> list[tuple[SamplingParams, GenerationConfig]]:
    chain = GenerationConfig(max_new_tokens=24, gamma=3, ignore_eos=True)
    invariant = SamplingParams(temperature=1.0, drafter_invariant=True, seed=7)
    return [
        (GREEDY, chain),
        (GREEDY, dataclasses.replace(chain, tree=DYNAMIC)),
        (GREEDY, dataclasses.replace(chain, drafter="ngram")),
        (GREEDY, dataclasses.replace(chain, policy="adaptive")),
        (invariant, chain),
        (dataclasses.replace(invariant, seed=123456789, top_k=20), dataclasses.replace(chain, tree=DYNAMIC)),
        (SamplingParams(temperature=0.8, seed=3), chain),  # rejection sampling: skipped, "sampled"
    ]


def test_a_mixed_workload_matches_on_every_check(batched: ModelServer) -> None:
    shadow = batched.shadow
    assert shadow is not None
    before = dict(shadow.counts)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 11, 12, 11, 12], [30], [40, 41, 42, 43]]
    jobs = [(p, params, config) for p in prompts for params, config in workload()]

    async def main() -> None:
        await asyncio.gather(*(run(batched, *job) for job in jobs))  # at once: batched, 4 at a time
        await shadow.drained()

    asyncio.run(main())
    counts = {key: shadow.counts[key] - before.get(key, 0) for key in shadow.counts}
    checkable = sum(skip_reason(params) is None for _, params, _ in jobs)
    assert counts.get("match", 0) == checkable == 24
    assert counts.get("skipped:sampled", 0) == len(jobs) - checkable
    assert not counts.get("mismatch") and not counts.get("near_tie") and not shadow.bundles
    assert batched.status()["shadow"]["waiting"] == 0


def test_a_live_request_preempts_a_shadow_run(batched: ModelServer) -> None:
    shadow = batched.shadow
    assert shadow is not None
    long = GenerationConfig(max_new_tokens=120, gamma=3, ignore_eos=True)
    before_preempted, before_match = shadow.counts["preempted"], shadow.counts["match"]

    async def main() -> list[int]:
        await run(batched, [5, 6, 7], GREEDY, long)  # finishes; its check starts as the replica is idle
        while batched.status()["active_requests"] == []:  # the shadow run is in the engine
            await asyncio.sleep(0.001)
        live = await run(batched, [9, 8, 7], GREEDY, GenerationConfig(max_new_tokens=8, gamma=3))
        await shadow.drained()
        return live

    assert len(asyncio.run(main())) == 8
    assert shadow.counts["preempted"] > before_preempted  # closed for the live request, then run again
    assert shadow.counts["match"] == before_match + 2


def test_the_runner_path_checks_too(saved_pair_dirs: dict[str, Path], tmp_path: Path) -> None:
    runner = build_engine(settings(saved_pair_dirs, tmp_path).replica())  # the single-request engine, in process
    server = ModelServer(settings(saved_pair_dirs, tmp_path, max_num_seqs=1), lambda config: runner)
    try:
        assert server.path == "one_at_a_time" and server.shadow is not None

        async def main() -> None:
            for params, config in workload()[:5]:
                await run(server, [5, 6, 7, 8], params, config)
            await server.shadow.drained()  # type: ignore[union-attr]

        asyncio.run(main())
        assert server.shadow.counts["match"] == 5 and server.status()["running"] == 0
    finally:
        server.shutdown()


# -----------------------------------------------------------------------------------------
# A broken verifier is caught


class FlipOnce:
    """A broken verifier (test only): the first chain verdict that rejects a draft token accepts it instead
    (``chain_verdict``, which reads every chain's verdict on the host, alone or in a batched step). Installed with
    :meth:`install`."""

    def __init__(self) -> None:
        self.flipped = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FlipOnce:
        def flipped(count: int, next_by_row: Sequence[int], gamma: int) -> ChainVerdict:
            if self.flipped or count >= gamma:
                return ORIGINAL_CHAIN_VERDICT(count, next_by_row, gamma)
            self.flipped += 1  # the rejected token is taken; the next comes from the target after it
            return ORIGINAL_CHAIN_VERDICT(count + 1, next_by_row, gamma)

        monkeypatch.setattr(target_module, "chain_verdict", flipped)
        return self


ORIGINAL_CHAIN_VERDICT = target_module.chain_verdict


def test_a_flipped_acceptance_is_caught_and_replayed(
    saved_pair_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    record_metrics(monkeypatch)
    flip = FlipOnce().install(monkeypatch)
    server = ModelServer(settings(saved_pair_dirs, tmp_path, max_num_seqs=4), build_runner, record_metrics=True)
    try:
        config = GenerationConfig(max_new_tokens=32, gamma=4, ignore_eos=True)

        async def main() -> list[int]:
            out = await run(server, [21, 22, 23, 24], GREEDY, config)
            await server.shadow.drained()  # type: ignore[union-attr]
            return out

        output = asyncio.run(main())
    finally:
        server.shutdown()
    shadow = server.shadow
    assert shadow is not None and flip.flipped == 1
    assert shadow.counts["mismatch"] == 1 and not shadow.counts.get("match")
    metric: Any = server.metrics.shadow_checks  # type: ignore[union-attr]
    assert [tags["result"] for _, tags in metric.updates] == ["mismatch"]
    assert metric.updates[0][1]["drafter"] == "draft_model"

    [path] = shadow.bundles
    bundle = load_bundle(path)
    assert bundle.job.output_ids == output and bundle.job.prompt_ids == [21, 22, 23, 24]
    assert (
        bundle.divergence.result == "mismatch" and bundle.divergence.speculative == output[bundle.divergence.position]
    )
    body = json.loads(path.read_text())
    assert {"versions", "dtype", "device", "seed", "replica", "plain_ids"} <= set(body) and body["dtype"] == "float64"

    # replay, with the same fault: confirmed, and the replica's speculative output reproduced
    FlipOnce().install(monkeypatch)
    report = replay(bundle)
    assert report.engine == "batched" and report.verdict == "confirmed"
    assert report.reproduces_replica and report.plain_agrees
    FlipOnce().install(monkeypatch)
    assert cli_main(["replay", str(path)]) == 1
    assert "CONFIRMED" in capsys.readouterr().out
    # and without it: cleared (the fault, not the model, made the difference)
    monkeypatch.setattr(target_module, "chain_verdict", ORIGINAL_CHAIN_VERDICT)
    assert cli_main(["replay", str(path), "--engine", "single", "--json"]) == 0
    cleared = json.loads(capsys.readouterr().out)
    assert cleared["verdict"] == "cleared" and cleared["speculative_ids"][: len(bundle.plain_ids)] == bundle.plain_ids


def test_replay_refuses_what_is_not_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["replay", str(tmp_path / "missing.json")]) == 2
    assert "no bundle at" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"bundle_version": 99}')
    assert cli_main(["replay", str(tmp_path / "bad.json")]) == 2
    assert "not a shadow-check bundle" in capsys.readouterr().err


# -----------------------------------------------------------------------------------------
# The pieces


def test_classify_tells_a_near_tie_from_a_mismatch() -> None:
    f32 = torch.float32
    tie = [TokenLogprob(4, -0.6931, ((4, -0.6931), (9, -0.6931 - 1e-6)))]
    far = [TokenLogprob(4, -0.1, ((4, -0.1), (9, -2.5)))]
    assert classify([1, 9], [1, 4], [TokenLogprob(1, 0.0), *tie], GREEDY, 3, 96, f32) is not None
    near = classify([9], [4], tie, GREEDY, 3, 96, f32)
    assert near is not None and near.near_tie and near.result == "near_tie" and near.position == 0
    mismatch = classify([9], [4], far, GREEDY, 3, 96, f32)
    assert mismatch is not None and mismatch.result == "mismatch" and mismatch.gap == pytest.approx(2.4)
    unknown = classify([50], [4], far, GREEDY, 3, 96, f32)  # not among the alternatives: no gap, a mismatch
    assert unknown is not None and unknown.gap is None and unknown.result == "mismatch"
    assert classify([4, 5], [4, 5], far * 2, GREEDY, 3, 96, f32) is None
    ended = classify([4], [4, 5], far * 2, GREEDY, 3, 96, f32)  # the speculative run stopped early
    assert ended is not None and (ended.position, ended.speculative, ended.plain) == (1, None, 5)
    # bf16's rounding is coarser: the same gap of 0.05 is a near tie there and a mismatch in float32
    close = [TokenLogprob(4, -1.0, ((4, -1.0), (9, -1.05)))]
    assert classify([9], [4], close, GREEDY, 3, 96, torch.bfloat16).near_tie  # type: ignore[union-attr]
    assert not classify([9], [4], close, GREEDY, 3, 96, f32).near_tie  # type: ignore[union-attr]
    assert near_tie_tolerance(torch.float32, 0.1) == near_tie_tolerance(torch.float32, 1.0)


def test_a_drafter_invariant_divergence_is_priced_with_its_noise() -> None:
    params = SamplingParams(temperature=1.0, drafter_invariant=True, seed=11)
    noise = gumbel_noise(11, [5], 96)[0]
    # choose log-probabilities so that the noisy scores of tokens 4 and 9 tie exactly
    lp4 = -1.0
    lp9 = lp4 + float(noise[4]) - float(noise[9])
    logprobs = [TokenLogprob(4, lp4, ((4, lp4), (9, lp9)))]
    d = classify([9], [4], logprobs, params, 5, 96, torch.float32)
    assert d is not None and d.gap == pytest.approx(0.0, abs=1e-9) and d.near_tie
    shifted = classify([9], [4], logprobs, params, 4, 96, torch.float32)  # another position's noise: no tie
    assert shifted is not None and not shifted.near_tie


def test_settings_survive_the_bundle_round_trip() -> None:
    params = SamplingParams(
        temperature=0.7, top_k=5, seed=99, drafter_invariant=True, logit_bias=((3, -1.5),), logprobs=2,
        grammar=GrammarSpec("regex", "[a-z]+"), repetition_penalty=1.1,
    )  # fmt: skip
    assert params_from_json(json.loads(json.dumps(params_to_json(params)))) == params
    static = TreeSpec("static", topology=TreeTopology(((0,), (1,), (0, 0))))
    for tree in (None, DYNAMIC, static):
        config = GenerationConfig(max_new_tokens=9, gamma=2, stop=("x", "yz"), tree=tree, policy="adaptive")
        assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config


def test_what_plain_decoding_reproduces() -> None:
    assert skip_reason(GREEDY) is None
    assert skip_reason(SamplingParams(temperature=1.0, drafter_invariant=True)) is None
    assert skip_reason(SamplingParams(temperature=1.0)) == "sampled"
    typical = SamplingParams(temperature=1.0, acceptance="typical", lossy=True)
    assert skip_reason(typical) == "lossy"


def test_the_queue_is_bounded_and_sampled_systematically(tmp_path: Path) -> None:
    busy = True

    async def never(*args: Any) -> Any:  # never reached: the replica stays busy
        raise AssertionError("ran while busy")
        yield

    checks = ShadowChecks(0.25, never, lambda: busy, tmp_path, {}, 96, torch.float32, max_jobs=3)
    job = ShadowJob([1, 2], GREEDY, GenerationConfig(max_new_tokens=2), [3, 4], "length", "ngram")

    async def main() -> None:
        for _ in range(20):
            checks.offer(job)
        assert checks.waiting == 3  # 20 offers at 1/4: 5 kept, 2 dropped for room
        checks._task.cancel()  # type: ignore[union-attr]

    asyncio.run(main())
    assert checks.counts["skipped:dropped"] == 2
    with pytest.raises(ValueError, match="between 0 and 1"):
        ShadowChecks(1.5, never, lambda: busy, tmp_path, {}, 96, torch.float32)


# -----------------------------------------------------------------------------------------
# Acceptance drift, on a live replica


def drift_server(tiny_pairs: dict[str, Any], policy: str) -> tuple[ModelServer, Any]:
    llama = tiny_pairs["llama"]
    # a good drafter: the target, slightly perturbed (acceptance ~0.7 at position 0); its weights are replaced mid-run
    draft = CausalLM(copy.deepcopy(llama.target.model), llama.target.tokenizer)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in draft.model.parameters():
            weight.add_(0.01 * torch.randn(weight.shape, generator=noise, dtype=weight.dtype))
    drafters = request_drafters(draft, llama.target, max_num_seqs=4, max_seq_len=128)
    engine = BatchedEngine(llama.target, drafters, schedules=schedules(), max_num_seqs=4, max_seq_len=128)
    config = ServeConfig(model_name="tiny", gamma=3, max_num_seqs=4, policy=policy, shadow_fraction=0)
    return ModelServer(config, lambda c: engine, record_metrics=True), draft


def serve_rounds(server: ModelServer, rounds: int, policy: str) -> None:
    config = GenerationConfig(max_new_tokens=32, gamma=3, ignore_eos=True, policy=policy)
    prompts = [[5, 6, 7, 8], [11, 12, 11, 12], [30, 31], [40, 41, 42]]

    async def main() -> None:
        for _ in range(rounds):
            await asyncio.gather(*(run(server, p, GREEDY, config) for p in prompts))

    asyncio.run(main())


def test_a_drafter_gone_bad_raises_a_drift_event_and_a_steady_one_does_not(
    tiny_pairs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    record_metrics(monkeypatch)
    steady, _ = drift_server(tiny_pairs, "fixed")
    switched, draft = drift_server(tiny_pairs, "fixed")
    try:
        serve_rounds(steady, 28, "fixed")  # 112 requests: two warm-ups' worth and more
        serve_rounds(switched, 14, "fixed")  # past the warm-up (50 requests)
        before = switched.drift.view("draft_model")
        cycles, tested = switched.drift.cycles("draft_model"), switched.drift.tested("draft_model", 0)
        randomise_(draft.model, seed=99)  # the drafter now proposes noise
        serve_rounds(switched, 10, "fixed")
    finally:
        steady.shutdown()
        switched.shutdown()
    assert steady.drift.tested("draft_model", 0) >= 2 * WARMUP  # the steady run was long enough to test
    assert tested >= WARMUP  # the switch came after the reference was set
    event = next(e for e in switched.drift.events if e.position == 0)
    assert event.direction == "down" and event.total > tested  # after the switch, not before
    assert event.total - tested <= 10  # requests from the switch to the event (simulated bound: 9)
    print(f"drift: caught {event.total - tested} requests, {event.cycles - cycles} cycles after the switch")
    events: Any = switched.metrics.drift_events  # type: ignore[union-attr]
    downs = [tags for _, tags in events.updates if tags["direction"] == "down"]
    assert downs and downs[0]["position"] == "0" and downs[0]["drafter"] == "draft_model"
    assert not steady.metrics.drift_events.updates  # type: ignore[union-attr]
    after = switched.drift.view("draft_model")
    assert after.rates[0] < before.rates[0]  # type: ignore[operator]
    # The speedup gauge is measured (cycle seconds against T_step): on a loaded machine its clock factor moves with
    # the load, so the live test asserts its count factor, tokens per cycle, and that the gauge is exported; that
    # the speedup falls with acceptance at steady costs is asserted in tests/policies/test_drift.py.
    assert after.tokens_per_cycle < before.tokens_per_cycle  # type: ignore[operator]
    assert after.speedup is not None and before.speedup is not None


def test_the_policy_drafts_less_when_its_drafter_goes_bad_and_the_gauge_shows_it(
    tiny_pairs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' schedule (heuristic: +2 after a fully accepted draft, -1 otherwise) reacts to acceptance alone,
    so its reaction does not depend on this machine's timings (the adaptive policy's also weighs measured costs:
    tests/policies cover it with costs under control); the smoothed budget gauge follows it down."""
    record_metrics(monkeypatch)
    server, draft = drift_server(tiny_pairs, "heuristic")
    try:
        serve_rounds(server, 6, "heuristic")
        before = server.drift.view("draft_model")
        randomise_(draft.model, seed=99)
        serve_rounds(server, 6, "heuristic")
    finally:
        server.shutdown()
    after = server.drift.view("draft_model")
    assert before.budget is not None and after.budget is not None and after.budget < before.budget - 0.5
    gauge: Any = server.metrics.draft_budget  # type: ignore[union-attr]
    budgets = [value for value, _ in gauge.updates]
    assert budgets[-1] == pytest.approx(after.budget) and budgets[-1] < max(budgets)  # the metric shows it
