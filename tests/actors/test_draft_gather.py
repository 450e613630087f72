"""The drafter actor's gathering of its request loops' chains (specserve.actors.draft_gather), without Ray.

Three loops on threads of their own, each a request's :class:`~specserve.core.draft_side.DraftSide` over a
draft-model drafter in one shared KV pool, ask the gatherer for their proposals cycle after cycle, committing
a verdict of their own in between. Every proposal equals what the same request's side drafts alone (a drafter
of its own, identically seeded generators: greedy and sampled), the loops really drafted together, a loop
that leaves never holds a round up, and a failure in a round reaches every loop of that round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TinyPair

from specserve.actors.draft_gather import DraftGatherer
from specserve.core.draft.drafter import Draft, Drafter
from specserve.core.draft.schedule import Budget, FixedSchedule
from specserve.core.draft_side import DraftSide
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.batched_model import BatchedDraftModel
from specserve.drafters.model import DraftModelDrafter

PARAMS = (SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, top_k=9, seed=2))
GAMMA, MAX_NEW, CYCLES = 3, 60, 6


@pytest.fixture(scope="module")
def llama(tiny_pairs: dict[str, TinyPair]) -> TinyPair:
    return tiny_pairs["llama"]


def side_for(drafter: Drafter, prompt: list[int], params: SamplingParams) -> DraftSide:
    side = DraftSide(drafter, FixedSchedule(Budget(GAMMA)), Budget(GAMMA), len(prompt), MAX_NEW, "cpu", "default")
    side.start(prompt, params, torch.Generator().manual_seed(1000 + params.seed))
    return side


def serialised() -> Callable[..., Any]:
    """What the actor's compute thread gives: one torch call at a time."""
    lock = threading.Lock()

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with lock:
            return fn(*args, **kwargs)

    return run


def commit(side: DraftSide, draft: Draft, cycle: int, i: int) -> None:
    """A verdict of this test's own: some of the chain and one more token, told to the drafter."""
    accepted = (cycle + i) % (draft.gamma + 1)
    side.drafter.accept([*draft.tokens[:accepted].tolist(), 3 + (7 * cycle + 5 * i) % 50])


def test_gathered_proposals_equal_each_request_drafting_alone(llama: TinyPair) -> None:
    prompts = [list(llama.prompts[i]) for i in range(3)]
    batcher = BatchedDraftModel(llama.draft, llama.target, max_num_seqs=3, max_seq_len=128)
    gathered = [side_for(batcher.new_drafter(), p, params) for p, params in zip(prompts, PARAMS, strict=True)]
    alone = [side_for(DraftModelDrafter(llama.draft, llama.target), p, s) for p, s in zip(prompts, PARAMS, strict=True)]
    gatherer = DraftGatherer(serialised(), wait_s=5.0)  # long: every round waits for all three loops
    got: dict[int, list[Draft]] = {i: [] for i in range(3)}
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            with gatherer.member():
                start.wait()
                for cycle in range(CYCLES):
                    draft = gatherer.propose(gathered[i], 1)
                    assert isinstance(draft, Draft)
                    got[i].append(draft)
                    commit(gathered[i], draft, cycle, i)
                    if i == 2 and cycle == 2:
                        return  # leaves early: the others' rounds go on without waiting for it
        except BaseException as exc:
            errors.append(exc)

    start = threading.Barrier(3)
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    for i, side in enumerate(alone):
        for cycle, draft in enumerate(got[i]):
            want = side.propose(1)
            assert isinstance(want, Draft)
            assert draft.tokens.tolist() == want.tokens.tolist(), f"request {i}, cycle {cycle}"
            if want.draft_probs is not None:
                assert draft.draft_probs is not None
                torch.testing.assert_close(draft.draft_probs, want.draft_probs, rtol=1e-9, atol=1e-12)
            commit(side, want, cycle, i)
    assert [len(got[i]) for i in range(3)] == [CYCLES, CYCLES, 3]
    assert gatherer.rounds[3] >= 1 and sum(n * rounds for n, rounds in gatherer.rounds.items()) == 2 * CYCLES + 3


def test_a_failed_round_fails_every_loop_in_it(llama: TinyPair) -> None:
    def broken(fn: Callable[..., Any], *args: Any) -> Any:
        raise RuntimeError("the draft model fell over")

    gatherer = DraftGatherer(broken, wait_s=0.0)
    side = side_for(DraftModelDrafter(llama.draft, llama.target), list(llama.prompts[0]), PARAMS[0])
    with gatherer.member(), pytest.raises(RuntimeError, match="fell over"):
        gatherer.propose(side, 1)
    with pytest.raises(ValueError, match="wait_s"):
        DraftGatherer(broken, wait_s=-1)
