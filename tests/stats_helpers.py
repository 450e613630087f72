"""Statistical helpers shared by the exactness tests (no fixtures, importable from any test module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import scipy.stats
import torch


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


def two_token_pvalue(
    generate: Callable[[int], list[int]],
    target: Any,
    prompt: list[int],
    params: Any,
    trials: int,
    process: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Chi-square p-value of the first two tokens ``generate(seed)`` emits, over seeds ``0 .. trials - 1``, against
    the target's joint law of two tokens after ``prompt`` under the warp of ``params`` (a ``SamplingParams``);
    ``process(ids, logits)``, when given, processes each position's logits (penalties) before the warp."""
    from specserve.core.sampling import warp_probs

    def law(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        return warp_probs(process(ids, logits) if process is not None else logits, params)

    first = law(prompt)
    joint = torch.stack([first[a] * law([*prompt, a]) for a in range(first.numel())])
    pairs = [generate(seed) for seed in range(trials)]
    return chi2_pvalue(torch.tensor([a * first.numel() + b for a, b in pairs]), joint)
