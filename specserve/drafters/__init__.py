"""Drafter implementations behind the contract in :mod:`specserve.core.draft.drafter`, and their registry."""

from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter
from specserve.drafters.registry import build_drafter, build_drafter_set
from specserve.drafters.vocabulary import VocabularyMismatch

__all__ = ["DraftModelDrafter", "NgramDrafter", "NoDrafter", "VocabularyMismatch", "build_drafter", "build_drafter_set"]
