"""Time to first token in process, with the prefix cache off and on: newcomers that share a 600-token system prompt.

    python bench/prefix_ttft.py

The shipped target on 1 thread, a :class:`~specserve.core.batch_engine.BatchedEngine` (16 slots, no drafter, the
default prefill budget of 256 positions per step). 8 requests of a 600-token system prompt and their own ~60-token
question arrive together, then 8 more arrive one every 4 steps while the first decode (48 tokens each, EOS ignored).
Prints every request's TTFT (submission to its first token, in seconds) and the median step time, per setting.
Measures only; changes no code path.
"""

from __future__ import annotations

import statistics
import time

import torch

from specserve import defaults
from specserve.benchmarks.prefix_load import Texts
from specserve.core.batch_engine import BatchedEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import request_drafters


def main() -> None:
    torch.set_num_threads(1)
    target = CausalLM.load(str(defaults.DEFAULT_TARGET))
    texts = Texts(str(defaults.DEFAULT_TARGET))
    system = texts.take(600)
    prompts = [f"{system}\nQuestion: {texts.take(60)}\nAnswer:" for _ in range(16)]
    config = GenerationConfig(max_new_tokens=48, gamma=0, drafter="none", ignore_eos=True)
    for caching in (False, True):
        drafters = request_drafters("none", target, max_num_seqs=16)
        engine = BatchedEngine(target, drafters, max_num_seqs=16, prefix_caching=caching)
        submitted = {engine.submit(p, SamplingParams(), config): time.perf_counter() for p in prompts[:8]}
        first: dict[int, float] = {}
        steps: list[float] = []
        waiting = prompts[8:]
        while engine.has_work:
            start = time.perf_counter()
            chunks = engine.step()
            steps.append(time.perf_counter() - start)
            now = time.perf_counter()
            for request_id, chunk in chunks:
                if request_id not in first and not isinstance(chunk, Exception) and chunk.token_ids:
                    first[request_id] = now - submitted[request_id]
            if waiting and len(steps) % 4 == 0:
                submitted[engine.submit(waiting.pop(0), SamplingParams(), config)] = time.perf_counter()
        ttft = [round(first[r], 2) for r in sorted(first)]
        print(f"prefix cache {'on' if caching else 'off'}: together {ttft[:8]}, arriving later {ttft[8:]}, "
              f"median step {1000 * statistics.median(steps):.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
