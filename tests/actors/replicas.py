"""Replica configurations shared by the actor tests, and the greedy reference they compare with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import EOS_ID, TinyPair, hf_greedy_ids

from specserve.actors.replica import ReplicaConfig


@dataclass(frozen=True)
class Case:
    family: str
    tp: int
    draft: str  # "ngram" or "model"
    placement: str
    overlap: bool


def config_for(case: Case, models: Path, **overrides: Any) -> ReplicaConfig:
    draft = str(models / "draft") if case.draft == "model" else case.draft
    return ReplicaConfig(
        target=str(models / "target"),
        draft=draft,
        dtype="float64",
        tp_degree=case.tp,
        drafter_placement=case.placement,  # type: ignore[arg-type]
        overlap=case.overlap,
        **overrides,
    )


def greedy_reference(pair: TinyPair, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    ref = hf_greedy_ids(pair.target.model, prompt, max_new_tokens)
    return ref[: ref.index(EOS_ID) + 1] if EOS_ID in ref else ref
