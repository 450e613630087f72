"""Resuming a request from what its client already has, after the replica generating it was lost.

When a replica is lost mid-request (a target shard died or froze, or the model replica itself died),
the front end sends the request again — to a healthy replica — with a :class:`Resume`: the output
tokens and the characters of text its client already received. The replica then generates the
*continuation* (:func:`continuation`): the prompt extended by those tokens, ``max_new_tokens``
reduced by their number, and no stop strings of its own, because :class:`ResumedOutput` maps the
continuation's chunks back onto the original request: text is detokenised over the whole output
and streamed from the character the client has, a stop string is searched in the whole text (one
that spans the break cuts too, where token-by-token decoding would have cut it), and the result
covers the whole output. The client's stream goes on with no token lost or repeated.

What the continuation reproduces:

* **greedy** — the same tokens as an undisturbed run (the target's argmax of the same prefix);
* **drafter-invariant sampling** — the same tokens: the noise of each position is keyed by the
  request seed and the token's absolute position (:mod:`specserve.core.verify.invariant`), which the
  continuation keeps;
* **other sampling** — a continuation distributed exactly as the target's given the prefix, but not
  the tokens an undisturbed run would have drawn: the request's random stream depends on the drafts
  it verified. It is drawn with a seed derived from the request seed and the break position
  (:func:`resumed_seed`), so it never reuses the random numbers that drew the prefix (a reused
  stream would correlate the continuation with the prefix).

Penalties count the tokens already out as output (``SamplingParams.prior_output_tokens``), as the undisturbed run
did, and the logprobs the client already has come back with the result.

Pure: no model, no transport. The front end decides when to resume (``specserve.serve.ingress``);
a replica builds the continuation and maps its chunks (``specserve.serve.model_server``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specserve.core.detokenize import Decode, TextStream
from specserve.core.request import GenerationConfig, RequestOutput, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats
from specserve.core.target import FinishReason
from specserve.core.verify.invariant import noise_key
from specserve.core.verify.logprobs import TokenLogprob


@dataclass(frozen=True)
class Resume:
    """What the client of an interrupted request already has."""

    output_ids: tuple[int, ...]  # the tokens streamed to it
    text_chars: int  # the characters of text streamed to it
    logprobs: tuple[TokenLogprob, ...] = ()  # theirs, when the request asked for logprobs

    @classmethod
    def of(cls, output_ids: Sequence[int], text: str, logprobs: Sequence[TokenLogprob] = ()) -> Resume:
        return cls(tuple(output_ids), len(text), tuple(logprobs))


def resumed_seed(seed: int, position: int) -> int:
    """The seed of a sampled continuation that starts at absolute ``position``: a hash of both, in [0, 2**63)."""
    return noise_key(seed, position)


def continuation(
    prompt_ids: Sequence[int], params: SamplingParams, config: GenerationConfig, resume: Resume
) -> tuple[list[int], SamplingParams, GenerationConfig]:
    """The request a replica generates to continue ``resume``: prompt + the output so far, the tokens still allowed,
    no stop strings (:class:`ResumedOutput` searches the whole text), and for a sampled request that does not key its
    noise by position a fresh seed. ``config.max_new_tokens`` must exceed the tokens already out."""
    prefix = [*prompt_ids, *resume.output_ids]
    remaining = config.max_new_tokens - len(resume.output_ids)
    if remaining < 1:
        raise ValueError(f"nothing to resume: {len(resume.output_ids)} of {config.max_new_tokens} tokens are out")
    if not (params.greedy or params.invariant_sampling):
        params = replace(params, seed=resumed_seed(params.seed, len(prefix)))
    params = replace(params, prior_output_tokens=params.prior_output_tokens + len(resume.output_ids))
    return prefix, params, replace(config, max_new_tokens=remaining, stop=())


class ResumedOutput:
    """The original request's chunks, from a continuation's: :meth:`map` each continuation chunk in order."""

    def __init__(
        self, prompt_ids: Sequence[int], resume: Resume, decode: Decode, stop: Sequence[str], logprobs: bool = False
    ) -> None:
        """``logprobs``: the request asked for them (``resume`` then holds those of the tokens already out)."""
        self.out = RequestOutput(prompt_ids, TextStream(decode, stop), RequestStats(), time.perf_counter(), logprobs)
        self.out.text.push(resume.output_ids)  # the client has these: neither tokens nor text go out again
        self.out.text.emitted_up_to(resume.text_chars)
        self.out.tokens.extend(resume.output_ids)
        if self.out.logprobs is not None:
            self.out.logprobs.extend(resume.logprobs)

    @property
    def finished(self) -> bool:
        """The original request has ended (a stop string in the whole text may end it before the continuation)."""
        return self.out.finish is not None

    def map(self, chunk: StreamChunk) -> StreamChunk:
        """One continuation chunk as the original request's: text from the whole output, stop strings over it; the
        last carries the whole output's result (the continuation's stats, counting every output token)."""
        finish = chunk.result.finish_reason if chunk.result is not None else None
        if chunk.result is not None:
            self.out.stats = chunk.result.stats
        return self.out.push(list(chunk.token_ids), finish, chunk.logprobs)

    def finish(self, reason: FinishReason) -> StreamChunk:
        """End the original request with no further tokens (its last chunk)."""
        return self.out.push([], reason)
