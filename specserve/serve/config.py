"""The serving configuration: one pydantic model whose fields are the Serve config YAML's ``args``, one to one.

Every field has a description (they are the documentation of ``deploy/*.yaml``). The replica
part maps onto :class:`~specserve.actors.replica.ReplicaConfig`; the API key may come from the
environment (``SPECSERVE_API_KEY``) instead of the file. Does not start anything.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve import defaults
from specserve.actors.replica import ReplicaConfig
from specserve.core.errors import UserError
from specserve.core.schedule import MAX_GAMMA

API_KEY_ENV = "SPECSERVE_API_KEY"


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("specserve-default", min_length=1, description="the name clients pass as `model`")
    target: str = Field(
        str(defaults.DEFAULT_TARGET),
        description="target model directory (a local HF checkpoint; relative paths are resolved where the config is "
        "first read, and must exist on every node)",
    )
    draft: str = Field(str(defaults.DEFAULT_DRAFT), description="draft model directory (as target), 'ngram' or 'none'")
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = Field("float32", description="weights dtype")
    device: str = Field("cpu", description="cpu or cuda")
    tp_degree: int = Field(1, ge=1, le=64, description="tensor-parallel shards per target replica")
    drafter_placement: Literal["colocated", "separate"] = Field(
        "colocated", description="drafter in the target's placement group, or on a node with the 'cheap' resource"
    )
    overlap: bool = Field(False, description="draft the next tree while the target verifies")
    gamma: int = Field(defaults.DEFAULT_GAMMA, ge=1, le=MAX_GAMMA, description="default draft tokens per cycle")
    default_max_tokens: int = Field(
        defaults.DEFAULT_MAX_NEW_TOKENS, ge=1, description="max_tokens of a request that does not set it"
    )
    max_ongoing_requests: int = Field(
        8, ge=1, description="requests one model replica holds at once: one generates, the rest wait in its queue"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies are refused with 413")
    api_key: str | None = Field(
        None, description=f"require `Authorization: Bearer <key>`; default: ${API_KEY_ENV} if set, else no key"
    )
    verifier_host: str = Field(
        "127.0.0.1",
        description="interface rank 0's gRPC verifier binds: loopback when drafters share the node; '0.0.0.0' "
        "(advertised as the node's IP) when drafters run on other nodes (drafter_placement: separate on a cluster)",
    )
    threads_per_shard: int = Field(1, ge=1, description="torch threads in each target shard actor")
    threads_per_drafter: int = Field(1, ge=1, description="torch threads in the drafter actor")

    @field_validator("target", "draft")
    @classmethod
    def _absolute(cls, value: str) -> str:
        """A relative model directory that exists here becomes absolute, so replicas started elsewhere find it."""
        if value in ("ngram", "none") or os.path.isabs(value) or not os.path.isdir(value):
            return value
        return os.path.abspath(value)

    @model_validator(mode="after")
    def _placeable(self) -> ServeConfig:
        """What only the replica's placement spec checks (tp_degree a power of two...), at the edge."""
        try:
            self.replica()
        except UserError as exc:
            raise ValueError(str(exc)) from exc
        return self

    def replica(self) -> ReplicaConfig:
        return ReplicaConfig(
            target=self.target,
            draft=self.draft,
            dtype=self.dtype,
            device=self.device,
            tp_degree=self.tp_degree,
            drafter_placement=self.drafter_placement,
            overlap=self.overlap,
            verifier_host=self.verifier_host,
            threads_per_shard=self.threads_per_shard,
            threads_per_drafter=self.threads_per_drafter,
        )

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None
