"""The prefix-cache workloads in process: clients as ``bench-serve --workload prefix`` runs them, without HTTP.

    python bench/prefix_inprocess.py eagle conversations 16
    python bench/prefix_inprocess.py default system-prompt 8

A :class:`~specserve.core.batch_engine.BatchedEngine` over the shipped target on 1 torch thread (16 slots, defaults
otherwise), the drafter given (``none``, ``default`` = the shipped draft model, ``suffix``, or ``eagle`` = the shipped
EAGLE head), greedy, 48 tokens per answer (EOS ignored). Each client submits its session's next turn the moment its
last answer ends (the decoded answer appended, as an HTTP client would). Per setting (prefix cache off, then on):
wall time, steps, throughput, TTFT p50 (submission to first token), and the seconds spent in each part of the steps.
Measures only; changes no code path.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from specserve import defaults
from specserve.benchmarks.prefix_load import Session, Texts, agent_loop, conversations, system_prompt
from specserve.core import batch_engine
from specserve.core.batch_engine import BatchedEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import request_drafters

PHASES: dict[str, float] = collections.defaultdict(float)


def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            PHASES[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", choices=["none", "default", "suffix", "eagle"])
    parser.add_argument("workload", choices=["conversations", "system-prompt", "agent"])
    parser.add_argument("clients", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch_engine.propose_batch = timed("draft", batch_engine.propose_batch)
    batch_engine.verify_batch = timed("verify", batch_engine.verify_batch)
    BatchedEngine._prefill = timed("prefill", BatchedEngine._prefill)  # type: ignore[method-assign]
    target = CausalLM.load(str(defaults.DEFAULT_TARGET))
    build = {"conversations": conversations, "system-prompt": system_prompt, "agent": agent_loop}[args.workload]
    eagle = args.drafter == "eagle"
    spec = f"eagle:{defaults.MODELS_DIR / 'eagle'}" if eagle else str(defaults.DEFAULT_DRAFT)
    name = "default" if eagle else args.drafter
    config = GenerationConfig(max_new_tokens=48, gamma=0 if name == "none" else 4, drafter=name, ignore_eos=True)
    for caching in (False, True):
        PHASES.clear()
        wall, steps, tokens, ttft = run(target, spec, config, build, args.clients, caching)
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in sorted(PHASES.items()))
        print(
            f"{args.drafter} {args.workload} at {args.clients} clients, prefix cache {'on' if caching else 'off'}: "
            f"{wall:.1f} s, {steps} steps, {tokens / wall:.1f} tok/s, TTFT p50 {1000 * ttft[len(ttft) // 2]:.0f} ms "
            f"({phases})",
            flush=True,
        )


def run(
    target: CausalLM,
    spec: str,
    config: GenerationConfig,
    build: Callable[[Texts], list[Session]],
    clients: int,
    caching: bool,
) -> tuple[float, int, int, list[float]]:
    """One setting: wall seconds, steps, tokens, and every request's TTFT (sorted)."""
    tokenizer = target.tokenizer
    assert tokenizer is not None
    sessions = build(Texts(str(defaults.DEFAULT_TARGET)))
    engine = BatchedEngine(target, request_drafters(spec, target, max_num_seqs=16), prefix_caching=caching)
    queue = list(range(len(sessions)))
    live: dict[int, tuple[int, float, list[int]]] = {}
    ttft: list[float] = []
    tokens = steps = 0

    def send(index: int) -> None:
        prompt = sessions[index].turn(sessions[index].answers)
        if prompt is not None:
            live[engine.submit(prompt, SamplingParams(), config)] = (index, time.perf_counter(), [])

    for _ in range(clients):
        if queue:
            send(queue.pop(0))
    start = time.perf_counter()
    while engine.has_work:
        chunks = engine.step()
        steps += 1
        now = time.perf_counter()
        for request_id, chunk in chunks:
            if isinstance(chunk, Exception):
                raise chunk
            index, submitted, ids = live[request_id]
            if chunk.token_ids and not ids:
                ttft.append(now - submitted)
            ids += chunk.token_ids
            tokens += len(chunk.token_ids)
            if chunk.result is not None:
                del live[request_id]
                sessions[index].answers.append(tokenizer.decode(ids))
                if sessions[index].turn(sessions[index].answers) is not None:
                    send(index)
                elif queue:
                    send(queue.pop(0))
    return time.perf_counter() - start, steps, tokens, sorted(ttft)


if __name__ == "__main__":
    main()
