"""What shadow checks cost live traffic, and how soon a broken verifier is caught (BENCHMARKS.md §20).

One batched replica in this process, as a Serve replica runs it (:class:`~specserve.serve.model_server.ModelServer`
over the in-process batched engine, ``max_num_seqs`` 8, the shipped pair, greedy, the draft model at γ 3, 64 tokens
per request, EOS ignored), and 16 asyncio clients calling it. Two load shapes:

* ``saturated``: closed loop, each client sends its next request as soon as the last one ends (the replica is never
  idle, so checks wait for the end of the round);
* ``gaps``: each client thinks for an exponential time (mean ``--think`` s) between requests, so the replica idles
  now and then and checks run in those gaps.

Per load, ``--rounds`` rounds; in each, every shadow fraction (0, 0.01, 0.1, 1) serves ``--requests`` requests, in an
order reversed every other round (the machine's speed drifts); between fractions the replica finishes its pending
checks (untimed). Per fraction: throughput (completion tokens / wall), TTFT p50/p99, ITL p50 (mean gap per token after
the first), and the checks that ran during the measured requests and after them.

Then the time from a flipped acceptance decision (one rejected draft token accepted, as tests/serve/test_shadow.py
does) to the mismatch being counted, at fraction 1: on an idle replica, and under the ``gaps`` load.

    python bench/shadow_cost.py --out bench/results/shadow_cost.json

torch runs ``--threads`` threads (1 by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import specserve.core.target as target_module
from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.verify.chain import ChainVerdict
from specserve.serve.config import ServeConfig
from specserve.serve.model_server import ModelServer, build_runner

FRACTIONS = (0.0, 0.01, 0.1, 1.0)
CLIENTS = 16
CONFIG = GenerationConfig(max_new_tokens=64, gamma=3, ignore_eos=True)


async def one(server: ModelServer, prompt: list[int]) -> dict[str, float]:
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async for chunk in server.generate(prompt, SamplingParams(), CONFIG):
        if chunk.token_ids:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            tokens += len(chunk.token_ids)
    assert first is not None and last is not None
    return {"ttft": first - sent, "itl": (last - first) / max(tokens - 1, 1), "tokens": tokens}


async def load(server: ModelServer, prompts: list[list[int]], count: int, think: float, seed: int) -> dict[str, Any]:
    pending = list(range(count))
    timings: list[dict[str, float]] = []
    rng = random.Random(seed)

    async def client() -> None:
        while pending:
            i = pending.pop()
            timings.append(await one(server, prompts[i % len(prompts)]))
            if think > 0:
                await asyncio.sleep(rng.expovariate(1 / think))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    wall = time.perf_counter() - start
    return {"timings": timings, "wall": wall}


def summary(rounds: list[dict[str, Any]], during: int, after: int) -> dict[str, Any]:
    timings = [t for r in rounds for t in r["timings"]]
    wall = sum(r["wall"] for r in rounds)
    ttft = [t["ttft"] for t in timings]
    return {
        "requests": len(timings),
        "throughput_tok_s": sum(t["tokens"] for t in timings) / wall,
        "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1000 * float(np.percentile(ttft, 99)),
        "itl_p50_ms": 1000 * statistics.median(t["itl"] for t in timings),
        "checks_during": during,
        "checks_after": after,
    }


def checks(server: ModelServer) -> int:
    assert server.shadow is not None
    return sum(v for k, v in server.shadow.counts.items() if k in ("match", "mismatch", "near_tie"))


async def measure(server: ModelServer, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    shadow = server.shadow
    assert shadow is not None
    out: dict[str, Any] = {}
    for shape, think in (("saturated", 0.0), ("gaps", args.think)):
        rounds: dict[float, list[dict[str, Any]]] = {f: [] for f in FRACTIONS}
        during = dict.fromkeys(FRACTIONS, 0)
        after = dict.fromkeys(FRACTIONS, 0)
        for round_ in range(args.rounds):
            order = FRACTIONS if round_ % 2 == 0 else tuple(reversed(FRACTIONS))
            for fraction in order:
                shadow.fraction = fraction
                before = checks(server)
                rounds[fraction].append(await load(server, prompts, args.requests, think, seed=round_))
                during[fraction] += checks(server) - before
                shadow.fraction = 0.0
                before = checks(server)
                await shadow.drained()
                after[fraction] += checks(server) - before
                print(f"{shape} round {round_} fraction {fraction}: {rounds[fraction][-1]['wall']:.1f} s", flush=True)
        out[shape] = {str(f): summary(rounds[f], during[f], after[f]) for f in FRACTIONS}
        assert not shadow.counts.get("mismatch"), dict(shadow.counts)
    return out


class FlipOnce:
    """The first chain verdict that rejects a draft token accepts it instead (``chain_verdict``, which reads every
    chain's verdict on the host, alone or in a batched step); records when."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.original = target_module.chain_verdict

    def flipped(self, count: int, next_by_row: Sequence[int], gamma: int) -> ChainVerdict:
        if self.at is not None or count >= gamma:
            return self.original(count, next_by_row, gamma)
        self.at = time.perf_counter()
        return self.original(count + 1, next_by_row, gamma)  # the next token comes from the target after it

    def install(self) -> None:
        target_module.chain_verdict = self.flipped  # type: ignore[assignment]

    def remove(self) -> None:
        target_module.chain_verdict = self.original


async def time_to_catch(server: ModelServer, prompts: list[list[int]], think: float | None) -> dict[str, Any]:
    """Seconds from a flipped decision to the mismatch count, at fraction 1: alone, or under the gaps load."""
    shadow = server.shadow
    assert shadow is not None
    shadow.fraction = 1.0
    flip = FlipOnce()
    mismatches = shadow.counts.get("mismatch", 0)
    background = None
    if think is not None:
        background = asyncio.ensure_future(load(server, prompts, 64, think, seed=99))
        await asyncio.sleep(2.0)  # the load is running
    flip.install()
    try:
        await one(server, prompts[0])
        while shadow.counts.get("mismatch", 0) == mismatches:
            await asyncio.sleep(0.001)
        caught = time.perf_counter()
    finally:
        flip.remove()
    if background is not None:
        await background
    await shadow.drained()
    assert flip.at is not None
    return {"seconds": caught - flip.at, "bundle": str(shadow.bundles[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64, help="requests per fraction per round")
    parser.add_argument("--think", type=float, default=6.0, help="gaps load: mean think time per client (s)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/shadow_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ServeConfig(
        target=str(defaults.DEFAULT_TARGET), draft=str(defaults.DEFAULT_DRAFT), gamma=3, max_queue=CLIENTS,
        threads_per_shard=args.threads, shadow_fraction=1.0, shadow_dir="/tmp/specserve-shadow-bench",
    )  # fmt: skip
    server = ModelServer(config, build_runner)
    codec = server.describe()
    prompts = [codec.encode(text) for text in heldout_prompts(16)]

    async def run() -> dict[str, Any]:
        await load(server, prompts, 64, 0.0, seed=0)  # warm-up
        await server.shadow.drained()  # type: ignore[union-attr]
        report: dict[str, Any] = {"loads": await measure(server, prompts, args)}
        report["time_to_catch"] = {
            "idle": await time_to_catch(server, prompts, None),
            "gaps": await time_to_catch(server, prompts, args.think),
        }
        return report

    report = asyncio.run(run())
    server.shutdown()
    report["settings"] = {**vars(args), "out": str(args.out), "clients": CLIENTS, "max_num_seqs": config.max_num_seqs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for shape, rows in report["loads"].items():
        print(f"\n{shape}: fraction | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | checks during | after")
        for fraction, row in rows.items():
            print(
                f"  {fraction} | {row['throughput_tok_s']:.1f} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} "
                f"| {row['itl_p50_ms']:.2f} | {row['checks_during']} | {row['checks_after']}"
            )
    print("time to catch:", {k: round(v["seconds"], 3) for k, v in report["time_to_catch"].items()})


if __name__ == "__main__":
    main()
