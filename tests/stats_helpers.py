"""Statistical helpers shared by the exactness tests (no fixtures, importable from any test module)."""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import scipy.stats
import torch

T = TypeVar("T")


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of integer draws ``tokens`` against the law ``probs`` [cells].

    Asserts that zero-probability symbols never occur, then pools symbols whose expected count is
    below 5 into one cell so the chi-square approximation holds.
    """
    probs = probs.double().flatten()  # a joint law [a, b] is tested as a law over a * b cells
    probs = probs / probs.sum()
    n = tokens.numel()
    assert n > 0
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    assert counts.numel() == probs.numel(), "a draw fell outside the vocabulary"
    impossible = probs == 0
    assert counts[impossible].sum() == 0, f"zero-probability symbols drawn: {counts.tolist()} vs {probs.tolist()}"
    expected = probs * n
    big = expected >= 5
    obs_cells = counts[big].tolist()
    exp_cells = expected[big].tolist()
    small = (~big) & (~impossible)
    if small.any():
        obs_cells.append(float(counts[small].sum()))
        exp_cells.append(float(expected[small].sum()))
    if len(obs_cells) < 2:
        return 1.0  # a point mass: the zero-probability check above is the whole test
    return float(scipy.stats.chisquare(obs_cells, exp_cells).pvalue)


def two_token_fit(
    pairs: Sequence[Sequence[int]],
    target: Any,
    prompt: list[int],
    params: Any,
    process: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Chi-square p-value of the token pairs ``pairs`` (two tokens emitted after ``prompt`` each) against the target's
    joint law of two tokens after ``prompt`` under the warp of ``params`` (a ``SamplingParams``), each position's
    logits processed by ``process`` first when given."""
    from specserve.core.sampling.warps import warp_probs

    def law(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        return warp_probs(process(ids, logits) if process is not None else logits, params)

    first = law(prompt)
    joint = torch.stack([first[a] * law([*prompt, a]) for a in range(first.numel())])
    return chi2_pvalue(torch.tensor([a * first.numel() + b for a, b in pairs]), joint)


def draws_over_seeds(draw: Callable[[int], T], trials: int) -> list[T]:
    """``[draw(seed) for seed in range(trials)]``, computed by two processes at once (:func:`split_seeds`)."""
    return split_seeds(lambda seeds: [draw(seed) for seed in seeds], trials)


def batched_runs(engine: Any, prompt: Sequence[int], params: Any, config: Any, trials: int) -> list[Any]:
    """The :class:`~specserve.core.request.GenerationResult` of one request per seed ``0 .. trials - 1`` (``params``,
    a ``SamplingParams``, with that seed; ``config`` a ``GenerationConfig``), run as requests of ``engine``, a
    :class:`~specserve.core.batch_engine.BatchedEngine`, in seed order: a statistical test's draws in batched
    forwards, ``engine.max_num_seqs`` requests at a time (a request's tokens do not depend on who shares its batch:
    ``tests/core/test_batch_engine.py``, and each test here checks a few seeds against the single-request engine),
    in two processes at once (:func:`split_seeds`), each with its copy of ``engine`` as it was."""

    def run(seeds: range) -> list[Any]:
        pending = iter(seeds)
        order: dict[int, int] = {}  # request id -> seed
        results: dict[int, Any] = {}  # seed -> result
        while True:
            while len(order) - len(results) < 2 * engine.max_num_seqs:  # a queue as deep as the batch, no deeper
                seed = next(pending, None)
                if seed is None:
                    break
                order[engine.submit(list(prompt), replace(params, seed=seed), config)] = seed
            if not engine.has_work:
                break
            for request_id, chunk in engine.step():
                if isinstance(chunk, Exception):
                    raise chunk
                if chunk.result is not None:
                    results[order[request_id]] = chunk.result
        return [results[seed] for seed in seeds]

    return split_seeds(run, trials)


def split_seeds(draw: Callable[[range], list[T]], trials: int) -> list[T]:
    """``draw(range(trials))``, computed by two processes at once: a forked copy of this one draws the first half of
    the seeds while this one draws the second (the seeds of a statistical test are fixed, so where each is drawn
    changes nothing but the time: a test sampling in process uses one core of a 2-core machine).

    Each process draws its seeds in order, from the state ``draw`` had at the fork; ``draw`` must be a function of
    its seeds and that state (side effects in the child are lost: return what the test needs). The split is fixed,
    not the machine's core count, so a run is reproducible anywhere. Without ``os.fork`` it draws in this process."""
    half = trials // 2
    if not hasattr(os, "fork") or half == 0:
        return draw(range(trials))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the first half, sent back pickled; it never returns into the test session
        try:
            os.close(read_end)
            try:
                message: tuple[str, Any] = ("ok", draw(range(half)))
            except BaseException:
                message = ("error", traceback.format_exc())
            with os.fdopen(write_end, "wb") as out:
                pickle.dump(message, out)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        second = draw(range(half, trials))
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        with os.fdopen(read_end, "rb") as received:
            data = received.read()
        os.waitpid(pid, 0)
    status, first = pickle.loads(data) if data else ("error", "the child process died")
    assert status == "ok", f"drawing seeds 0..{half - 1} in a forked process failed:\n{first}"
    return [*first, *second]


def check_single_engine_agrees(
    engine: Any, runs: Sequence[Any], prompt: Sequence[int], params: Any, config: Any, seeds: int = 12
) -> None:
    """The single-request engine ``engine`` emits, for the first ``seeds`` seeds, the tokens ``runs`` (from
    :func:`batched_runs`) hold: the law a batched test measured is the single-request engine's too."""
    for seed in range(seeds):
        single = engine.generate(list(prompt), replace(params, seed=seed), config).output_ids
        assert single == runs[seed].output_ids, f"seed {seed}: alone {single}, in a batch {runs[seed].output_ids}"
