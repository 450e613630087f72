"""The serving configuration: one pydantic model whose fields are the Serve config YAML's ``args``, one to one.

:class:`ServeConfig` is the replica configuration
(:class:`~specserve.cluster.replica_config.ReplicaConfig`: every replica setting, inherited under
the same names) plus what only serving needs (the model's name, request defaults and limits, the
API key, whether the API docs are served). Left out of the YAML, ``target`` and ``draft`` mean the
shipped default pair. Every field has a description (they are the documentation of
``deploy/*.yaml``). The API key may come from the environment (``SPECSERVE_API_KEY``) instead of
the file. Does not start anything.
"""

from __future__ import annotations

import os
from typing import Literal, Self

from pydantic import Field, model_validator

from specserve import defaults
from specserve.cluster.replica_config import InvalidSetting, ReplicaConfig, with_edge_default
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.draft.spec_strings import suggested_gamma

API_KEY_ENV = "SPECSERVE_API_KEY"
# A served replica batches by default (the library's ReplicaConfig keeps 1: one request at a time; BENCHMARKS.md §15
# measures the two).
SERVE_MAX_NUM_SEQS = 8
# Requests beyond a replica's bound (max_num_seqs + max_queue) that Serve may send it at once by default: each is
# refused with 429 in about a millisecond, so a few slots turn any overload into prompt refusals.
REFUSING = 8


class ServeConfig(ReplicaConfig):
    """Every replica setting (inherited) and the serving settings below."""

    target: str = with_edge_default("target")
    draft: str = with_edge_default("draft")

    model_name: str = Field("specserve-default", min_length=1, description="the name clients pass as `model`")
    gamma: int = Field(
        defaults.DEFAULT_GAMMA,
        ge=1,
        le=MAX_GAMMA,
        description="draft tokens per cycle of a request that sets none; left out, a speculators-format head's own "
        "suggestion (speculative_tokens)",
    )
    policy: Literal["fixed", "heuristic", "adaptive"] = Field(
        "fixed",
        description="how much a request that names no policy drafts each cycle: gamma every cycle (fixed), "
        "transformers' +2/-1 schedule from gamma (heuristic), or the gamma that maximises predicted tokens/s from "
        "online estimates, 0 = plain decoding (adaptive). fixed stays the default: adaptive measured 0.82-1.10x the "
        "best fixed gamma on the shipped pair (BENCHMARKS.md §8 and §15)",
    )
    default_max_tokens: int = Field(
        defaults.DEFAULT_MAX_NEW_TOKENS, ge=1, description="max_tokens of a request that does not set it"
    )
    max_num_seqs: int = Field(
        SERVE_MAX_NUM_SEQS,
        ge=1,
        description="requests one replica generates at once: batched (one target forward per step for all its "
        "running requests) by default; 1 = one at a time, the baseline every setting supports. A batched replica runs "
        "the in-process batched engine in its own process when it needs nothing only the distributed runtime does "
        "(tp_degree 1, no overlap, drafter colocated, gpus_per_drafter 0), the distributed runtime otherwise",
    )
    max_ongoing_requests: int = Field(
        0,
        ge=0,
        description="requests Serve sends one model replica at once (max_num_seqs generate, the rest wait there; "
        "more wait in Serve's router); at least max_num_seqs; above max_num_seqs + max_queue the replica answers "
        f"the excess with 429. 0 (the default) = max_num_seqs + max_queue + {REFUSING}, so that a request past the "
        "replica's bound reaches it and is refused at once instead of waiting unseen in Serve's router",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies are refused with 413")
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a request body may take to arrive whole (a body shorter than its Content-Length, or "
        "trickled in); past it the request is refused with 408 and the connection closed",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds a request may take from its arrival to its last token; past it the generation is "
        "stopped (its KV freed) and the client gets 504, or an error event when it streams",
    )
    resume_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long a request whose replica was lost (a shard or the replica died) waits for a healthy "
        "replica to resume it from its streamed tokens; past it the client gets an error",
    )
    drafter_invariant: bool = Field(
        False,
        description="sample every request at temperature > 0 that does not say otherwise "
        "(speculation.drafter_invariant) drafter-invariantly: its output is then a function of its seed and the "
        "target alone, so shadow checks can check it too (rejection-sampled requests are skipped); it accepts fewer "
        "drafts than rejection sampling (BENCHMARKS.md). Requests under typical acceptance keep their lossy rule",
    )
    shadow_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="the share of finished requests a replica decodes again without speculation, when it holds no "
        "live request, to check token for token that speculation changed nothing (greedy and drafter_invariant "
        "requests; others are counted skipped: see drafter_invariant); 0 = off. A mismatch is counted "
        '(specserve_shadow_checks{result="mismatch"}), logged and written as a repro bundle for `specserve replay`',
    )
    shadow_dir: str = Field(
        "",
        description="where a replica writes shadow-check repro bundles (the newest 100 are kept); empty: "
        "<the system's temporary directory>/specserve-shadow on the replica's node",
    )
    api_key: str | None = Field(
        None, description=f"require `Authorization: Bearer <key>`; default: ${API_KEY_ENV} if set, else no key"
    )
    api_docs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="serve /docs, /redoc and /openapi.json: `on` (behind the API key when one is set), `off` (404), "
        "or `auto`: only when no API key is set",
    )

    @property
    def ongoing_requests(self) -> int:
        """Serve's ``max_ongoing_requests`` for the model deployment: the setting, or (0) derived from the replica's
        bound so that its 429 applies."""
        return self.max_ongoing_requests or self.max_num_seqs + self.max_queue + REFUSING

    @model_validator(mode="after")
    def _fills_its_batch(self) -> Self:
        if self.max_ongoing_requests and self.max_ongoing_requests < self.max_num_seqs:
            raise InvalidSetting(
                f"max_ongoing_requests {self.max_ongoing_requests} < max_num_seqs {self.max_num_seqs}: Serve would "
                "never send a replica enough requests to fill its batch; raise max_ongoing_requests"
            )
        return self

    def with_suggested_gamma(self, gamma_given: bool) -> ServeConfig:
        """This configuration, with ``gamma`` the γ its drafter's publisher suggests (a speculators-format head's
        ``speculative_tokens``, capped at ``MAX_GAMMA``) when the ``gamma`` setting was not given."""
        suggested = None if gamma_given else suggested_gamma(self.draft)
        return self if suggested is None else self.model_copy(update={"gamma": suggested})

    def replica(self) -> ReplicaConfig:
        """The replica part alone (what :meth:`Coordinator.spawn` takes)."""
        return ReplicaConfig(**self.model_dump(include=set(ReplicaConfig.model_fields)))

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None
