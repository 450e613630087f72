"""The measured ceiling (specserve.policies.ceiling): long drafts that lose are cut to the depth that pays, every
band that loses to plain decoding, tried again after a back-off that doubles, per batch size, and the bound it states.
Then through the controller and in the engine: budgets are clipped, reported, and the output stays the target's.

Observations are built by hand (exact, deterministic: what the ceiling does on given numbers) and from the synthetic
streams of tests/policies/synthetic_streams.py (seeded Bernoulli acceptance, the development CPU's T_verify(k)).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import pytest
from conftest import REF_TOKENS, TinyPair
from synthetic_streams import chain_observation, cpu_verify_seconds, draw_accepted, observe_stream

from specserve.core.draft.schedule import Budget, CycleObservation
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import merge_policy_reports
from specserve.drafters.registry import build_drafter_set
from specserve.policies.ceiling import BANDS, CeilingSettings, ReplicaCeiling, band_of, bucket_of, charged_depth
from specserve.policies.controller import SpeculationController
from specserve.policies.policies import FixedPolicy, build_policy
from specserve.policies.schedules import schedules

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
PLAIN = 0.015  # seconds of a plain step in the hand-built observations


def cycle(depth: int, accepted: int, plain_steps: float, batch_size: int = 1) -> CycleObservation:
    """A chain cycle of ``depth`` drafts, ``accepted`` of them, taking ``plain_steps`` plain steps."""
    seconds = plain_steps * PLAIN
    return CycleObservation(Budget(depth), depth, depth, accepted, 0.2 * seconds, 0.8 * seconds, batch_size=batch_size)


def plain(ceiling: ReplicaCeiling, steps: int, batch_size: int = 1) -> None:
    """``steps`` plain steps of ``batch_size`` requests: the ceiling's clock runs, nothing is measured."""
    for _ in range(steps * batch_size):
        ceiling.observe(CycleObservation(Budget(0), 0, 0, 0, 0.0, PLAIN, batch_size=batch_size), PLAIN)


def test_bands_and_buckets() -> None:
    assert [band_of(d) for d in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert [bucket_of(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 64)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError):
        band_of(0)
    with pytest.raises(ValueError):
        CeilingSettings(first_backoff=100, max_backoff=10)


def test_long_drafts_that_lose_are_cut_to_the_depth_that_pays() -> None:
    """The n-gram case measured on the shipped pair: drafts of 9+ and of 5-8 tokens commit less than plain decoding
    would in their time, drafts of 3-4 commit more. The ceiling comes down band by band to 4 and stays there."""
    ceiling = ReplicaCeiling()
    assert ceiling.cap() is None
    for accepted, steps in [(1, 2.5), (0, 2.4)] * 8:  # 9+: 1.25 tokens in 2.45 steps, ~0.51x
        ceiling.observe(cycle(12, accepted, steps), PLAIN)
    assert ceiling.cap() == 8
    for accepted, steps in [(1, 2.0), (0, 1.9)] * 8:  # 5-8: ~0.64x
        ceiling.observe(cycle(6, accepted, steps), PLAIN)
    assert ceiling.cap() == 4
    for accepted, steps in [(3, 1.6), (1, 1.7)] * 20:  # 3-4: 3 tokens in 1.65 steps, ~1.8x: never closed
        ceiling.observe(cycle(4, accepted, steps), PLAIN)
        assert ceiling.cap() == 4
    events = ceiling.take_events()
    assert [e.split(":")[0] for e in events] == ["closed", "closed"]
    assert events[1].startswith("closed: drafts of 5-8 tokens measured 0.") and ceiling.take_events() == []
    assert [ceiling.allowed(d) for d in (1, 3, 4, 6, 12)] == [1, 3, 4, 4, 4]


def test_a_band_is_closed_against_what_is_open_below_it_not_only_against_plain() -> None:
    """Drafts of 3-4 at 1.0x plain are worth less than drafts of 2 at 1.6x: they are cut to 2, though plain decoding is
    no better than the longer drafts. The deeper bands, never measured, stay open: each band is judged on its own."""
    ceiling = ReplicaCeiling()
    for _ in range(16):
        ceiling.observe(cycle(2, 2, 1.875), PLAIN)  # 3 tokens in 1.875 steps: 1.6x
    for accepted, steps in [(2, 2.4), (1, 2.6)] * 8:  # 2.5 tokens in 2.5 steps: 1.0x
        ceiling.observe(cycle(4, accepted, steps), PLAIN)
    assert ceiling.allowed(4) == 2 and ceiling.allowed(3) == 2 and ceiling.allowed(6) == 6
    assert ceiling.open_bands() == ["1", "2", "5-8", "9+"] and ceiling.cap() is None


def test_noise_does_not_close_a_band_that_pays() -> None:
    """A band whose cycles vary from 1 to 5 tokens, at 1.3x plain on average, is not closed in 2,000 cycles of 50
    seeds (the confidence rule: two standard errors of the measured speedup, judged from 16 cycles on). Measured
    over 400 seeds: closed in 2 (0.5 %), both within the first 20 cycles, where a window's standard error is
    itself noisy: the false-closing rate of a band at 1.3x plain is about 0.5 % per 2,000 cycles, and a false closing
    costs the back-off's plain cycles until the trial that reopens it."""
    closed = 0
    for seed in range(50):
        rng, ceiling = random.Random(seed), ReplicaCeiling()
        for _ in range(2000):
            accepted = draw_accepted(rng, (0.6,), 4)  # E[tokens] = 1 + .6 + .36 + .216 + .13 = 2.31
            ceiling.observe(cycle(4, accepted, 1.75 * rng.uniform(0.95, 1.05)), PLAIN)
        closed += any(e.startswith("closed") for e in ceiling.take_events())
    assert closed == 1  # seed 22 closes at its 16th cycle: 16 cycles made 1.31 tokens each where 2.31 is the mean


def test_drafting_that_never_pays_ends_in_plain_decoding_and_is_tried_again_after_doubling_backoffs() -> None:
    """Every band loses, one after the other: plain decoding. Then closed bands are tried one at a time once the
    replica has run a back-off since the last move — the least recently tried first, then the shortest —, a failed
    trial doubles that band's back-off, a trial that pays reopens its band, and a trial the policy never drafts for
    is given up."""
    settings = CeilingSettings(min_cycles=4, trial_cycles=4, first_backoff=16, max_backoff=64)
    ceiling = ReplicaCeiling(settings)
    for depth in (12, 6, 4, 2, 1):  # each band in turn: 1 token in 2 steps, 0.5x plain
        assert ceiling.cap() == (None if depth == 12 else BANDS[band_of(depth)][1])
        for _ in range(4):
            ceiling.observe(cycle(depth, 0, 2.0), PLAIN)
    assert ceiling.cap() == 0 and ceiling.allowed(12) == 0 and ceiling.open_bands() == []  # plain decoding
    assert [e.split(":")[0] for e in ceiling.take_events()] == ["closed"] * 4 + ["fell back"]
    plain(ceiling, 15)
    assert ceiling.cap() == 0
    plain(ceiling, 1)
    assert ceiling.cap() == 1 and ceiling.allowed(4) == 1  # the back-off ran out: the shortest drafts on trial
    assert ceiling.take_events() == ["trial: drafts of 1 token again"]
    for _ in range(4):  # the trial fails: closed again, for twice as long
        ceiling.observe(cycle(1, 0, 1.5), PLAIN)
    assert ceiling.cap() == 0
    assert ceiling.take_events()[-1].endswith("on trial, against 1.00x; tried again after 32 steps")
    plain(ceiling, 15)
    assert ceiling.cap() == 0
    plain(ceiling, 1)  # 16 steps: not the one-token band's turn (32), the two-token one's (never tried)
    assert ceiling.cap() == 2 and ceiling.allowed(1) == 0 and ceiling.allowed(4) == 2
    for _ in range(4):  # this trial pays: the band stays open, its back-off reset
        ceiling.observe(cycle(2, 2, 1.5), PLAIN)
    assert ceiling.allowed(2) == 2 and ceiling.allowed(1) == 0 and ceiling.open_bands() == ["2"]
    assert ceiling.take_events()[-1].startswith("returned: drafts of 2 tokens measured 2.00x plain decoding on trial")
    plain(ceiling, 15)  # the next trial waits a back-off from then on
    assert ceiling.cap() == 2
    plain(ceiling, 1)
    assert ceiling.allowed(4) == 4 and ceiling.take_events() == ["trial: drafts of 3-4 tokens again"]
    plain(ceiling, 16)  # no draft of 3-4 tokens came in a back-off: given up, nothing learned, waits twice as long
    assert ceiling.allowed(4) == 2
    assert ceiling.take_events() == ["trial: drafts of 3-4 tokens too rare on trial; tried again after 32 steps"]
    plain(ceiling, 16)
    assert ceiling.cap() == 8  # then the next never tried: 5-8 (the one-token band's 32 steps are not yet up)
    plain(ceiling, 16)  # given up too
    assert ceiling.cap() == 2
    plain(ceiling, 16)
    assert ceiling.cap() is None and ceiling.allowed(1) == 0  # 9+, never tried
    plain(ceiling, 16)
    assert ceiling.cap() == 2
    plain(ceiling, 31)
    assert ceiling.cap() == 2
    plain(ceiling, 1)  # 32 steps: the one-token band, least recently tried of those due
    assert ceiling.allowed(1) == 1


def test_each_batch_size_has_its_own_ceiling_and_its_clock_counts_steps() -> None:
    settings = CeilingSettings(min_cycles=4, first_backoff=10)
    ceiling = ReplicaCeiling(settings)
    for depth in (12, 6, 4, 2, 1):  # at 8 requests no draft pays: closed at 20 observations, 2.5 steps
        for _ in range(4):
            ceiling.observe(cycle(depth, 0, 2.0, batch_size=8), PLAIN)
    assert ceiling.cap(8) == 0 and ceiling.cap(12) == 0  # 8-15 requests share a bucket
    assert ceiling.cap(1) is None and ceiling.cap(4) is None and ceiling.cap(16) is None
    plain(ceiling, 9, batch_size=8)  # 72 observations of 8-request steps: 9 steps, 11.5 in all
    assert ceiling.cap(8) == 0
    plain(ceiling, 1, batch_size=8)
    assert ceiling.cap(8) == 1


def test_a_batched_step_is_measured_on_every_row_it_widened() -> None:
    """16 requests: half draft one token (1.5 tokens a cycle), half draft nothing, and every row is padded to the
    step's 2 positions, which cost 1.5 plain steps. The drafting rows alone measure 1.0x plain decoding; with the plain
    rows the step widened (1 token in 1.5 steps) it is 0.83x (0.82 in the window, which weighs the last rows most),
    and one-token drafts are closed at 16 requests — only there: a request alone has its own bucket."""

    def row(drafted: int, accepted: int, width: int = 2) -> CycleObservation:
        seconds = 1.5 * PLAIN
        draft = 0.1 * seconds if drafted else 0.0
        return CycleObservation(
            Budget(drafted),
            drafted,
            drafted,
            accepted,
            draft,
            seconds - draft,
            batch_size=16,
            step_positions=16 * width,
        )

    assert [charged_depth(o) for o in (row(1, 0), row(0, 0), row(1, 0, width=4), row(0, 0, width=1))] == [1, 1, 3, 0]
    assert charged_depth(cycle(3, 1, 1.0)) == 3 and charged_depth(CycleObservation(Budget(2), 0, 0, 0, 0.0, 1.0)) == 0
    ceiling = ReplicaCeiling()
    for _ in range(2):  # two steps of 16 rows
        for i in range(16):
            ceiling.observe(row(1, i % 2) if i < 8 else row(0, 0), PLAIN)
    assert ceiling.allowed(1, batch_size=16) == 0 and ceiling.allowed(2, batch_size=16) == 2
    assert ceiling.allowed(1, batch_size=1) == 1
    assert ceiling.take_events(16)[0].startswith("closed: drafts of 1 token measured 0.8")


def test_a_batched_row_is_charged_its_whole_step_against_a_whole_plain_step() -> None:
    """EAGLE-3 at 16 requests, in the shape measured on the shipped pair: a plain step took 54 ms whole (its forward
    45 ms here); a step in which 14 rows drafted one token took 120 ms whole (its forward 60 ms, head forwards 36 ms
    shared by the 14, the rest planning and verdicts) and committed 1.7 tokens a row. Charged its share of the drafting
    against a plain step's forward, a row measures 1.2x plain decoding; charged the step it waited against a whole
    plain step, 0.76x: one-token drafts are closed at 16 requests, and the replica decodes plainly. The controller
    learns the whole plain step from the replica's plain steps."""
    forward_plain, whole_plain, forward, whole, heads = 0.045, 0.054, 0.060, 0.120, 0.036

    def rows(drafting: bool) -> list[CycleObservation]:
        out = []
        for i in range(16):
            drafted = 1 if drafting and i < 14 else 0
            accepted = drafted if i % 10 < 7 else 0  # 1.7 tokens a row on the drafting rows
            out.append(
                CycleObservation(
                    Budget(drafted),
                    drafted,
                    drafted,
                    accepted,
                    heads / 14 if drafted else 0.0,
                    forward if drafting else forward_plain,
                    batch_size=16,
                    step_positions=16 * (2 if drafting else 1),
                    step_seconds=whole if drafting else whole_plain,
                )
            )
        return out

    shared = schedules()
    controllers = [shared("adaptive", Budget(3)) for _ in range(16)]
    for step in (False, True, True):  # a plain step, then two drafting steps
        for controller, observation in zip(controllers, rows(step), strict=True):
            assert isinstance(controller, SpeculationController)
            controller.observe(observation)
    first = controllers[0]
    assert isinstance(first, SpeculationController) and first.ceiling is not None
    assert first.step_costs.t_plain_step(16) == pytest.approx(whole_plain)
    assert first.ceiling.allowed(1, batch_size=16) == 0
    (event,) = first.ceiling.take_events(16)
    measured = float(event.split("measured ")[1].split("x")[0])
    assert measured == pytest.approx(sum(o.accepted + 1 for o in rows(True)) / 16 * whole_plain / whole, abs=0.01)
    # charged a share of the drafting, against the plain forward, the same rows measured 1.2x plain decoding
    tokens = sum(o.accepted + 1 for o in rows(True))
    assert tokens / sum((o.draft_seconds + o.verify_seconds) / forward_plain for o in rows(True)) > 1.15
    # a cycle of its own (no step_seconds) is charged its draft, verify and transit, against T_step
    alone = cycle(2, 2, 1.5)
    assert alone.cycle_seconds == pytest.approx(alone.draft_seconds + alone.verify_seconds)


def test_the_bound_the_ceiling_states() -> None:
    settings = CeilingSettings()
    assert settings.rate_floor(0.5, 3.0) == pytest.approx(1 - 24 * 0.5 / (2048 + 24))
    assert round(settings.rate_floor(0.5, 3.0), 3) == 0.994
    assert settings.rate_floor(1.0, 3.0) == 1.0
    with pytest.raises(ValueError):
        settings.rate_floor(1.5, 3.0)


def test_a_synthetic_stream_whose_deep_drafts_do_not_pay_keeps_the_depth_that_does() -> None:
    """Acceptance 0.9 at the first depth and 0.1 beyond it, the CPU's verify costs: a fixed γ 8 behind the ceiling
    ends cut to 4 drafted tokens or fewer (drafts of 1-4 all commit about 2 tokens at about 1.2x plain), and the
    last 200 cycles run faster than the same policy without it."""
    alphas = (0.9, 0.1)

    def run(ceiling: ReplicaCeiling | None, seed: int) -> float:
        rng = random.Random(seed)
        controller = SpeculationController(FixedPolicy(8), ceiling=ceiling)
        tokens = seconds = 0.0
        for i in range(400):
            budget = controller.next_budget(10_000)
            obs = chain_observation(budget, draw_accepted(rng, alphas, budget.gamma), cpu_verify_seconds, rng)
            controller.observe(obs)
            if i >= 200:
                tokens += obs.accepted + 1
                seconds += obs.draft_seconds + obs.verify_seconds
        return tokens / seconds

    for seed in range(5):
        ceiling = ReplicaCeiling()
        capped, free = run(ceiling, seed), run(None, seed)
        assert ceiling.allowed(8) in (1, 2, 4)
        assert capped > 1.1 * free


# ---------------------------------------------------------------------------------------------
# Through the controller and the engine


def test_the_adaptive_schedules_of_a_replica_share_one_ceiling_and_the_baselines_have_none() -> None:
    make = schedules()
    a, b, heuristic = make("adaptive", Budget(4)), make("adaptive", Budget(4)), make("heuristic", Budget(4))
    assert isinstance(a, SpeculationController) and isinstance(b, SpeculationController)
    assert a.ceiling is not None and a.ceiling is b.ceiling
    assert isinstance(heuristic, SpeculationController) and heuristic.ceiling is None
    assert make("adaptive", Budget(4)).ceiling is not schedules()("adaptive", Budget(4)).ceiling


def test_the_controller_clips_to_the_ceiling_and_reports_it() -> None:
    ceiling = ReplicaCeiling(CeilingSettings(min_cycles=2, trial_cycles=2))
    controller = SpeculationController(FixedPolicy(6), ceiling=ceiling)
    rng = random.Random(0)
    for _ in range(2):  # 6 drafts, none accepted: 5-8 closed
        budget = controller.next_budget(100)
        assert budget == Budget(6)
        controller.observe(chain_observation(budget, 0, cpu_verify_seconds, rng))
    assert controller.next_budget(100) == Budget(4)
    assert controller.history[-1]["ceiling"] == 4
    report = controller.report()
    assert report["capped"] == 1 and report["open_bands"] == ["1", "2", "3-4", "9+"]
    assert report["events"] and report["events"][0].startswith("closed: drafts of 5-8 tokens")
    assert set(report["measured_speedup"]) == {"5-8"} and report["closed"] == 1 and report["fallbacks"] == 0


def test_a_batched_engine_may_not_align_a_chain_into_a_vetoed_band() -> None:
    """What the engine asks before it sets a row's chain to the step's width (``BatchPlanned.allowed_chain``): at 16
    requests, with one-token drafts closed there, a chain of 1 becomes plain decoding and one of 2 stays; alone, a
    chain of 1 is allowed."""
    ceiling = ReplicaCeiling(CeilingSettings(min_cycles=2))
    for _ in range(2):
        ceiling.observe(cycle(1, 0, 2.0, batch_size=16), PLAIN)
    controller = SpeculationController(FixedPolicy(0), ceiling=ceiling)
    controller.next_budget(100, batch_size=16)
    assert [controller.allowed_chain(g) for g in (0, 1, 2, 99)] == [0, 0, 2, 16]
    controller.next_budget(100, batch_size=1)
    assert controller.allowed_chain(1) == 1
    assert SpeculationController(FixedPolicy(0)).allowed_chain(3) == 3  # no ceiling: only the replica's cap


class Swinging(ReplicaCeiling):
    """A ceiling that, for six verdicts, believes plain decoding costs nothing (every band it judges loses), then for
    24 that every draft was accepted in one plain step (deeper drafts pay more), and so on: bands close and reopen on
    trial at every depth, deterministically, whatever this machine's timings. Only its own view changes: the engine's
    verdicts are the verifier's."""

    calls = 0

    def observe(self, obs: CycleObservation, plain_seconds: float) -> None:
        self.calls += 1
        if self.calls % 30 < 6:
            super().observe(obs, plain_seconds=1e-9)
        else:
            seconds = obs.draft_seconds + obs.verify_seconds + obs.wire_seconds
            super().observe(dataclasses.replace(obs, accepted=obs.depth), plain_seconds=seconds)


def test_greedy_stays_exact_while_the_ceiling_cuts_drafts(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    """Bands close after one cycle, come back on trial after two steps and pass or fail: drafts are cut from 8 to 2,
    1 and 0 and raised to 8 again, and the output is transformers' greedy decoding token for token, with the
    draft model and with n-gram lookup."""
    for spec in (pair.draft, "ngram"):
        ceiling = Swinging(CeilingSettings(min_cycles=1, trial_cycles=1, first_backoff=2, max_backoff=2))

        def make(policy: str, budget: Budget, ceiling: ReplicaCeiling = ceiling) -> SpeculationController:
            return SpeculationController(FixedPolicy(8), ceiling=ceiling)

        engine = SpeculativeEngine(pair.target, build_drafter_set(spec, pair.target), schedules=make)
        depths: list[int] = []
        for prompt in pair.prompts[:4]:
            result = engine.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=REF_TOKENS))
            assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS)
            depths += [o.budget.gamma for o in result.stats.observations]
        assert {0, 1, 2, 8} <= set(depths), depths
        assert 8 in depths[depths.index(0) :], "raised again after plain decoding"
        assert sum(o.drafted > 0 for o in result.stats.observations) > 0


# ---------------------------------------------------------------------------------------------
# Synthetic streams through the controller: the scenarios


SEEDS = range(20)
PLAIN_SECONDS = cpu_verify_seconds(1)
DROP_AT = 200
PLAIN_WITHIN = 120  # cycles after the drop until the request decodes plainly


def capped(settings: CeilingSettings | None = None, gamma: int = 4) -> SpeculationController:
    """``FixedPolicy(gamma)`` under a ceiling: a policy that never adapts, so that what is tested is the ceiling."""
    return SpeculationController(FixedPolicy(gamma), ceiling=ReplicaCeiling(settings))


def run(controller: SpeculationController, alphas: Sequence[float], seed: int) -> list[CycleObservation]:
    """One long request: cycle i accepts each depth with probability ``alphas[i]``."""
    return observe_stream(controller, lambda cycle: (alphas[cycle],), len(alphas), cpu_verify_seconds, seed)


def speedup(observations: Sequence[CycleObservation]) -> float:
    """Tokens per second of a stretch of cycles over plain decoding's (the synthetic T_verify(1))."""
    tokens = sum(o.accepted + 1 for o in observations)
    seconds = sum(o.draft_seconds + o.verify_seconds for o in observations)
    return tokens / seconds * PLAIN_SECONDS


def first_plain(controller: SpeculationController) -> int | None:
    return next((e["cycle"] for e in controller.history if e.get("ceiling") == 0), None)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_drafter_that_stops_paying_falls_back_within_a_stated_number_of_cycles(seed: int) -> None:
    """α 0.8 then 0.05 at γ 4: about 1.6x plain decoding, then about 0.56x. The ceiling closes the bands the request's
    drafts are cut into — 3-4 tokens, then 2, then 1 — and the request decodes plainly within PLAIN_WITHIN cycles of
    the drop (measured 99-118), never before it: the first band waits for its 32-cycle window to turn confidently
    below 0.97x, each band below it needs 16 cycles of its own. The deeper bands, never drafted, stay open."""
    controller = capped()
    observations = run(controller, [0.8] * DROP_AT + [0.05] * 300, seed)
    assert speedup(observations[:DROP_AT]) > 1.4 and speedup(observations[DROP_AT : DROP_AT + 20]) < 0.7
    plain_at = first_plain(controller)
    assert plain_at is not None and DROP_AT < plain_at <= DROP_AT + PLAIN_WITHIN, plain_at
    moves = [m.split(" measured")[0] for m in controller.report()["events"]]
    assert moves[:3] == ["closed: drafts of 3-4 tokens", "closed: drafts of 2 tokens", "closed: drafts of 1 token"]
    assert moves[3:] == ["trial: drafts of 1 token again", "closed: drafts of 1 token"]  # 128 steps later: fails too
    assert controller.report()["fallbacks"] == 0 and controller.report()["open_bands"] == ["5-8", "9+"]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_drafter_that_recovers_is_tried_again_and_used_again(seed: int) -> None:
    """α 0.05 for 1,500 cycles (the bands of 1-4 tokens closed, their trials failing, the back-offs doubling), then
    0.8: a trial finds drafts paying within one back-off (measured 260-272 cycles), the bands come back one per
    back-off, and the request drafts faster than plain decoding from then on (1.48-1.75x). Drafts of 3-4 tokens, the
    policy's γ, were open again at the end in 18 of 20 seeds: their 8-cycle trial against the reopened 2-token band
    (about 1.7x) fails now and then, and the back-off doubles."""
    controller = capped()
    recover = 1500
    observations = run(controller, [0.05] * recover + [0.8] * 1500, seed)
    report = controller.report()
    assert report["reopened"] >= 2 and report["returns"] == 0  # never without an open band: 5-8 and 9+ were not drafted
    assert controller.ceiling is not None and controller.ceiling.allowed(4) in (2, 4)
    returned = next(
        e["cycle"] for e in controller.history if e["cycle"] > recover and e.get("ceiling") != 0 and e["gamma"] > 0
    )
    assert recover < returned <= recover + 300
    assert speedup(observations[returned + 600 :]) > 1.4


def test_a_drafter_that_never_pays_keeps_the_rate_the_bound_states() -> None:
    """α 0 at γ 4: drafts of every depth make one token, the drafting cycles together at 0.64x plain decoding's rate.
    The three bands the request's drafts are cut into (3-4, 2, 1) close and are tried in turn, each back-off doubling
    from 128 to its cap of 2,048 steps after four failed trials: 3 x (128 + 256 + 512 + 1024) = 5,760 steps. From
    then on the request keeps at least the stated floor of plain decoding's rate (0.9975; measured 0.998), and at
    least 0.98x over the whole stream of 14,000 cycles (measured 0.993)."""
    for seed in SEEDS[:3]:
        controller = capped()
        observations = run(controller, [0.0] * 14_000, seed)
        drafting = [o for o in observations if o.drafted]
        worst = speedup(drafting)
        longest = max(o.draft_seconds + o.verify_seconds for o in drafting) / PLAIN_SECONDS
        floor = CeilingSettings().rate_floor(min(1.0, worst), max(1.0, longest))
        assert worst < 0.75 and floor > 0.99
        assert speedup(observations[6000:]) >= floor
        assert speedup(observations) >= 0.98


def test_a_request_reports_what_its_policy_decided(pair: TinyPair) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target), schedules=schedules())
    adaptive = engine.generate(
        pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=24, policy="adaptive")
    )
    report = adaptive.stats.policy
    assert report["policy"] == "adaptive" and report["decisions"] == adaptive.stats.cycles
    assert report["budget_sum"] == sum(adaptive.stats.budgets)
    assert {"capped", "open_bands", "measured_speedup", "closed", "reopened", "fallbacks", "returns", "events"} <= set(
        report
    )
    assert adaptive.stats.to_dict()["policy"] == report
    fixed = engine.generate(pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=8))
    assert fixed.stats.policy == {}


def test_reports_pool_over_requests() -> None:
    a = {"policy": "adaptive", "decisions": 10, "plain_decisions": 4, "capped": 3, "budget_sum": 18, "fallbacks": 1}
    b = {"policy": "adaptive", "decisions": 5, "plain_decisions": 0, "capped": 0, "budget_sum": 15, "returns": 1}
    merged = merge_policy_reports(a, b)
    assert merged == {
        "policy": "adaptive",
        "decisions": 15,
        "plain_decisions": 4,
        "capped": 3,
        "budget_sum": 33,
        "fallbacks": 1,
        "returns": 1,
    }
    assert merge_policy_reports({}, b) == b and merge_policy_reports(a, {}) == a
    assert "policy" not in merge_policy_reports(a, {**b, "policy": "heuristic"})


def test_each_drafter_of_a_replica_has_its_own_ceiling(pair: TinyPair) -> None:
    """A replica serves its configured drafter and the built-ins a request may name: each is measured apart."""
    make = schedules()
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target), schedules=make)
    seen: dict[str, ReplicaCeiling] = {}

    for drafter in ("default", "ngram", "default"):
        config = GenerationConfig(max_new_tokens=8, policy="adaptive", drafter=drafter)
        captured: list[SpeculationController] = []

        def spy(policy: str, budget: Budget, captured: list[SpeculationController] = captured) -> SpeculationController:
            schedule = make(policy, budget)
            assert isinstance(schedule, SpeculationController)
            captured.append(schedule)
            return schedule

        engine.schedules = spy
        engine.generate(pair.prompts[0], SamplingParams(), config)
        ceiling = captured[-1].ceiling
        assert ceiling is not None
        assert seen.setdefault(drafter, ceiling) is ceiling
    assert seen["default"] is not seen["ngram"]


def test_short_drafts_that_lose_are_closed_alone_and_deeper_ones_that_pay_stay_open() -> None:
    """The suffix drafter on held-out code: the policy drafts one token where it expects little, and those cycles
    measured 0.86x plain while its drafts of 3-4 tokens measured 2.3x. The one-token band is closed alone (those
    contexts decode plainly), the deep drafts go on, and are closed in their turn once they stop paying."""
    ceiling = ReplicaCeiling()
    for _ in range(16):
        ceiling.observe(cycle(4, 4, 2.2), PLAIN)  # 5 tokens in 2.2 steps: 2.3x
    for accepted, steps in [(0, 1.6), (1, 1.6)] * 16:  # one-token drafts: 1.5 tokens in 1.76 steps, 0.85x
        ceiling.observe(cycle(1, accepted, steps * 1.1), PLAIN)
    assert [ceiling.allowed(d) for d in (1, 2, 4, 12)] == [0, 2, 4, 12] and ceiling.cap() is None
    assert [e.split(" measured")[0] for e in ceiling.take_events()] == ["closed: drafts of 1 token"]
    for _ in range(64):  # the deep drafts stop paying: 1 token in 2.2 steps
        ceiling.observe(cycle(4, 0, 2.2), PLAIN)
    assert ceiling.allowed(4) == 2 and ceiling.open_bands() == ["2", "5-8", "9+"]


def test_rare_drafts_of_every_depth_that_lose_together_end_in_plain_decoding() -> None:
    """n-gram lookup at T = 1.5: a match now and then, of any length, never accepted. No band gets 16 cycles of its own
    before their pool is confidently slower than plain decoding: the ceiling falls to 0 on the pool."""
    ceiling = ReplicaCeiling()
    depths = [1, 2, 3, 5, 9, 4, 6, 12, 2, 1, 3, 7, 10, 1, 2, 4] * 2
    caps = []
    for depth in depths:
        ceiling.observe(cycle(depth, 0, 1.3 + 0.05 * depth), PLAIN)
        caps.append(ceiling.cap())
    assert caps.index(0) == 15 and caps[15:] == [0] * 17  # at the pool's 16th cycle, and plain from then on
    assert ceiling.take_events()[-1].startswith("fell back: drafts of every depth open together measured 0.")


def test_the_adaptive_policy_chooses_among_the_depths_the_ceiling_leaves_open() -> None:
    """Drafts of 1 and 2 tokens closed (the draft model on greedy code: γ 1 and 2 measured 0.89x and 0.98x plain,
    γ 3 1.11x). At α 0.5 an adaptive request chooses 2 drafts (66 of 79 decisions, every one cut to plain decoding,
    before the vetoed depths were given to the policy); now it drafts 3 where that pays: no decision is cut, and it
    keeps drafting."""
    ceiling = ReplicaCeiling(CeilingSettings(min_cycles=2))
    for depth in (1, 2):
        for _ in range(4):
            ceiling.observe(cycle(depth, 0, 1.6), PLAIN)
    assert ceiling.open_bands() == ["3-4", "5-8", "9+"] and ceiling.vetoed(6) == frozenset({1, 2})
    controller = SpeculationController(build_policy("adaptive", max_gamma=6), ceiling=ceiling, max_gamma_cap=6)
    observations = run(controller, [0.5] * 80, seed=0)
    decisions = [e for e in controller.history if not e["calibration"]]
    assert all(e["gamma"] == 0 or e["gamma"] >= 3 for e in decisions)
    assert not any("ceiling" in e for e in decisions)  # chosen among the open depths: nothing to cut
    assert sum(1 for o in observations if o.depth >= 3) > 0.8 * len(observations)
