"""Medusa heads: extra decoding heads on the target's final hidden state draft the next K tokens at once.

Implements Medusa-1 (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"). Head k (k = 1 .. K) reads the target's feature of position t — its last
hidden state, after the final norm (``hidden_states[num_layers]``, see
:class:`~specserve.core.draft.drafter.FeatureDrafter`) — passes it through ``num_layers_per_head`` residual
blocks ``h + SiLU(W h + b)`` and then through the target's own frozen LM head, and predicts the
token at position t + k + 1 (the LM head itself predicts t + 1). ``W`` and ``b`` start at zero, so
an untrained head predicts what the LM head predicts.

:class:`MedusaHeads` holds only the heads' weights: the LM head is an argument of every call, so
``state_dict()``, checkpoints and the saved directory (``config.json`` + ``model.safetensors``) never
carry a copy of the target. :class:`MedusaDrafter` drafts with them: before each proposal it knows
the features of every committed token but the last, and the heads read the feature of the token
*before* the last committed one, whose head 1 predicts the first draft token (the target's own
next-token prediction there is the last committed token, already known). Every head runs on that
one feature, so a proposal costs one small forward whatever the draft's size:

* chains — the top-1 token of heads 1 .. min(K, budget);
* trees — the node at index path ``(r_0, ..., r_d)`` is head d + 1's rank-``r_d`` candidate (its
  tokens depend on the depth and rank only, not on the parent, as in Medusa); static topologies
  lose the levels beyond K, and a dynamic budget becomes the static topology
  :meth:`~specserve.core.tree.draft_tree.TreeTopology.best_first` builds from ``rank_probs`` — head 1's
  top-r hit rates measured by the trainer on held-out text and stored in ``config.json``
  (:data:`DEFAULT_RANK_PROBS` when a directory has none), ranks below the budget's ``width``, depth
  ``min(depth, K)``. ``expand`` does not apply: the children cost no forward.

Published heads load unchanged too (:meth:`MedusaDrafter.load`, the ``medusa:DIR`` flag): FasterDecoding/Medusa's and
vLLM's layouts, read and checked by :mod:`specserve.drafters.medusa_layouts`. Their residual blocks become
:class:`MedusaHeads` (vLLM's bias-free blocks with a zero bias) and each head decodes with its own LM head
(:class:`~specserve.drafters.medusa_layouts.OwnLMHeads`: full or truncated vocabulary) instead of the target's; they
read the same feature and draft the same way.

Every draft is deterministic (no q: a point mass for verification), so decoding stays exact at any
temperature. Does not verify, sample, train (``specserve.training.medusa``) or know the target
beyond its LM head, hidden size and depth.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.core.draft.drafter import Draft
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.head_files import CONFIG_FILE, WEIGHTS_FILE, read_config_json, read_head_config
from specserve.drafters.medusa_layouts import TRAIN_HINT, InvalidMedusaHeads, OwnLMHeads, is_published, read_published

DRAFTER_KIND = "medusa"  # config.json's "specserve_drafter"
FORMAT_VERSION = 1
LOAD_HINT = f"{TRAIN_HINT}, or pass FasterDecoding/Medusa or vLLM Medusa heads as published"

# How often the target's greedy token is head 1's rank-r candidate, for dynamic trees of heads saved without
# their own measurement: a cautious profile (the trainer stores the measured one in config.json).
DEFAULT_RANK_PROBS = (0.6, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)


# ---------------------------------------------------------------------------------------------
# Configuration and weights


@dataclass(frozen=True)
class MedusaConfig:
    """What ``config.json`` records: the heads' shape and the target they were trained for."""

    num_heads: int  # K
    hidden_size: int  # the target's hidden size (the width of a feature)
    vocab_size: int  # the target's LM head rows
    target_num_layers: int  # the feature is hidden_states[target_num_layers] (after the final norm)
    num_layers_per_head: int = 1
    target_architecture: str = ""
    rank_probs: tuple[float, ...] = DEFAULT_RANK_PROBS  # head 1's top-r hit rates: shapes dynamic trees

    def __post_init__(self) -> None:
        sizes = (self.num_heads, self.hidden_size, self.vocab_size, self.target_num_layers, self.num_layers_per_head)
        if any(not isinstance(n, int) or n < 1 for n in sizes):
            raise InvalidMedusaHeads(f"Medusa sizes must be integers >= 1, got {self}")
        probs = tuple(float(p) for p in self.rank_probs)
        if not probs or any(not 0.0 < p <= 1.0 for p in probs):
            raise InvalidMedusaHeads(f"rank_probs must be a non-empty list of numbers in (0, 1], got {self.rank_probs}")
        object.__setattr__(self, "rank_probs", probs)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.target_num_layers,)

    def to_json(self) -> dict[str, Any]:
        return {"specserve_drafter": DRAFTER_KIND, "format_version": FORMAT_VERSION, **asdict(self)}

    @staticmethod
    def from_json(data: Any, where: Path) -> MedusaConfig:
        """The config in ``data`` (a parsed ``config.json``); :class:`InvalidMedusaHeads` saying what is wrong."""
        known = dataclasses.fields(MedusaConfig)
        missing = [f.name for f in known if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise InvalidMedusaHeads(f"{where} lacks {', '.join(missing)}; re-save the heads or {TRAIN_HINT}")
        values: dict[str, Any] = {f.name: data[f.name] for f in known if f.name in data}
        if "rank_probs" in values:
            values["rank_probs"] = tuple(values["rank_probs"])
        return MedusaConfig(**values)


class ResidualBlock(torch.nn.Module):
    """``h + SiLU(W h + b)``, with ``W`` and ``b`` zero at first (the block starts as the identity)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return hidden + torch.nn.functional.silu(self.linear(hidden))


class MedusaHeads(torch.nn.Module):
    """K heads of residual blocks; the target's LM head, passed to each call, turns their output into logits.

    No target module is registered here: ``state_dict()`` holds the heads' own weights only.
    """

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = torch.nn.ModuleList(
            torch.nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(config.num_layers_per_head)))
            for _ in range(config.num_heads)
        )

    def hidden(self, features: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., K, hidden]
        """Each head's final hidden state, before the LM head."""
        return torch.stack([head(features) for head in self.heads], dim=-2)

    def forward(self, features: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        """``features`` [..., hidden] -> logits [..., K, vocab]: row k - 1 predicts the token k + 1 positions ahead."""
        return lm_head(self.hidden(features))

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (head weights only) into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        weights = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> MedusaHeads:
        """The heads saved in ``directory`` (float32, on the CPU); :class:`InvalidMedusaHeads` when it holds none."""
        where = Path(directory)
        config = MedusaConfig.from_json(_read_config(where), where)
        heads = cls(config)
        weights_path = where / WEIGHTS_FILE
        if not weights_path.is_file():
            raise InvalidMedusaHeads(f"{where} has no {WEIGHTS_FILE}; re-save the heads or {TRAIN_HINT}")
        try:
            weights = load_file(str(weights_path))
        except (SafetensorError, OSError) as exc:
            raise InvalidMedusaHeads(f"{weights_path} is not a readable safetensors file: {exc}") from exc
        try:
            heads.load_state_dict({name: tensor.float() for name, tensor in weights.items()})
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise InvalidMedusaHeads(f"{weights_path} does not match {where / CONFIG_FILE}: {first}") from exc
        return heads.eval()


def _read_config(where: Path) -> Any:
    return read_head_config(where, DRAFTER_KIND, "a Medusa heads", InvalidMedusaHeads, TRAIN_HINT)


def lm_head_of(target: CausalLM) -> torch.nn.Module:
    """The target's LM head (its output embeddings): final hidden state -> logits."""
    head = target.model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        raise InvalidMedusaHeads(f"{target.info.architecture} has no output embeddings (LM head) to decode heads with")
    return head


def lm_weight(lm_head: torch.nn.Module, target_name: str = "the target") -> torch.Tensor:
    """The LM head's weight ``[vocab, hidden]``; :class:`InvalidMedusaHeads` when it has none."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InvalidMedusaHeads(f"the LM head of {target_name} has no [vocab, hidden] weight")
    return weight


def check_lm_head(config: MedusaConfig, lm_head: torch.nn.Module, target_name: str = "the target") -> torch.Tensor:
    """The LM head's weight ``[vocab, hidden]``; :class:`InvalidMedusaHeads` unless it fits heads of ``config``."""
    weight = lm_weight(lm_head, target_name)
    vocab, hidden = int(weight.shape[0]), int(weight.shape[1])
    if (vocab, hidden) != (config.vocab_size, config.hidden_size):
        raise InvalidMedusaHeads(
            f"these Medusa heads were trained for a target with hidden size {config.hidden_size} and "
            f"{config.vocab_size} tokens, but {target_name} has hidden size {hidden} and {vocab} tokens; "
            f"use heads trained for this target ({TRAIN_HINT})"
        )
    return weight


def check_target(config: MedusaConfig, target: CausalLM) -> None:
    """:class:`InvalidMedusaHeads` unless heads of ``config`` were trained for a target shaped like ``target``."""
    check_lm_head(config, lm_head_of(target), f"target {target.info.path}")
    layers = getattr(target.model.config, "num_hidden_layers", None)
    if layers is not None and int(layers) != config.target_num_layers:
        raise InvalidMedusaHeads(
            f"these Medusa heads read the output of layer {config.target_num_layers} of their target, but target "
            f"{target.info.path} has {layers} layers; use heads trained for this target ({TRAIN_HINT})"
        )


# ---------------------------------------------------------------------------------------------
# The drafter


@dataclass
class _FeatureStore:
    """The target's features of committed positions ``first .. known - 1`` in a buffer that grows by doubling.

    An empty store takes features from any position: a request served from the prefix cache is handed none before
    its cache hit (:meth:`MedusaDrafter.reuse_prefix`). Once it holds some, a later block must continue them."""

    dtype: torch.dtype
    device: torch.device
    width: int
    rows: torch.Tensor = field(init=False)  # [capacity, width]: row i is position first + i
    first: int = 0
    known: int = 0

    def __post_init__(self) -> None:
        self.rows = torch.empty(0, self.width, dtype=self.dtype, device=self.device)

    def clear(self) -> None:
        self.first = self.known = 0

    def forget_from(self, position: int) -> None:
        """Drop the features of positions ``position ..``."""
        self.known = max(min(self.known, position), self.first)

    def add(self, start: int, features: torch.Tensor) -> None:  # features: [k, width]
        count = int(features.shape[0])
        if count == 0:
            return
        if features.dim() != 2 or int(features.shape[1]) != self.width:
            raise ValueError(f"features must be [k, {self.width}], got {tuple(features.shape)}")
        if self.known == self.first:  # empty: start anywhere
            self.first = self.known = start
        if not self.first <= start <= self.known:
            raise ValueError(
                f"features from position {start} leave a gap: only positions {self.first} .. {self.known - 1} are known"
            )
        begin, end = start - self.first, start - self.first + count
        if end > self.rows.shape[0]:
            grown = torch.empty(max(end, 2 * self.rows.shape[0], 64), self.width, dtype=self.dtype, device=self.device)
            grown[:begin] = self.rows[:begin]
            self.rows = grown
        self.rows[begin:end] = features.to(self.device, self.dtype)
        self.known = max(self.known, start + count)

    def get(self, position: int) -> torch.Tensor | None:  # [width], or None when unknown
        return self.rows[position - self.first] if self.first <= position < self.known else None


class MedusaDrafter:
    """Drafts chains and trees from Medusa heads over the target's features (deterministic: no q).

    ``lm_head`` is the target's own (shared, never copied), or published heads' own
    (:class:`~specserve.drafters.medusa_layouts.OwnLMHeads`); the heads are copied onto its device and dtype, so the
    caller's module is left as it was.
    """

    name = "medusa"

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head: torch.nn.Module,
        output_device: torch.device | str,
        *,
        copy_heads: bool = True,
    ) -> None:
        weight: torch.Tensor
        if isinstance(lm_head, OwnLMHeads):
            if not lm_head.fits(heads.config.num_heads, heads.config.hidden_size, heads.config.vocab_size):
                raise InvalidMedusaHeads(f"these {lm_head.layout} LM heads do not fit heads of {heads.config}")
            weight = lm_head.weight
        else:
            weight = check_lm_head(heads.config, lm_head)
        self.config = heads.config
        if copy_heads:
            heads = copy.deepcopy(heads).to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
        self.heads = heads
        self.lm_head = lm_head
        self.layout = lm_head.layout if isinstance(lm_head, OwnLMHeads) else "specserve"
        self._draft_vocab = lm_head.draft_vocab if isinstance(lm_head, OwnLMHeads) else heads.config.vocab_size
        self.feature_layers = heads.config.feature_layers
        self._output_device = torch.device(output_device)
        self._context: list[int] = []  # committed tokens of the current request
        self._features = _FeatureStore(weight.dtype, weight.device, heads.config.hidden_size)
        self._topologies: dict[TreeBudget, TreeTopology] = {}  # dynamic budgets -> their best-first topology

    @classmethod
    def for_target(cls, heads: MedusaHeads, target: CausalLM) -> MedusaDrafter:
        """Heads over an in-process target (checked against it), drafting onto the target's device."""
        check_target(heads.config, target)
        return cls(heads, lm_head_of(target), target.device)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        target: CausalLM | TargetDescription,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> MedusaDrafter:
        """The heads saved in ``directory`` for ``target``: specserve's own, or published ones
        (:mod:`~specserve.drafters.medusa_layouts`). Given only a description (a drafter process of its own), the
        target is loaded from ``target.info.path`` in ``dtype`` on ``device`` and only its LM head kept (none of it
        for published heads)."""
        config = read_config_json(directory, "a Medusa heads", InvalidMedusaHeads, LOAD_HINT)
        if is_published(config):
            model = (
                target if isinstance(target, CausalLM) else CausalLM.load(target.info.path, dtype=dtype, device=device)
            )
            return cls.published(directory, config, model, target.device)
        if "specserve_drafter" not in config:  # neither: the reader says what the directory looks like instead
            read_head_config(directory, DRAFTER_KIND, "a Medusa heads", InvalidMedusaHeads, LOAD_HINT)
        heads = MedusaHeads.load(directory)
        if heads.config.vocab_size != target.info.vocab_size:
            raise InvalidMedusaHeads(
                f"Medusa heads in {directory} were trained for a target with {heads.config.vocab_size} tokens, but "
                f"{target.info.path} has {target.info.vocab_size}; use heads trained for this target ({TRAIN_HINT})"
            )
        if isinstance(target, CausalLM):
            return cls.for_target(heads, target)
        model = CausalLM.load(target.info.path, dtype=dtype, device=device)
        check_target(heads.config, model)
        return cls(heads, lm_head_of(model), target.device)

    @classmethod
    def published(
        cls, directory: str | Path, config: dict[str, Any], target: CausalLM, output_device: torch.device | str
    ) -> MedusaDrafter:
        """Published heads in ``directory`` (``config``: its parsed ``config.json``), checked against ``target`` and
        placed on its LM head's device and dtype; they read the target's last feature (after its final norm)."""
        name = f"target {target.info.path}"
        weight = lm_weight(lm_head_of(target), name)
        found = read_published(directory, config, int(weight.shape[1]), int(weight.shape[0]), name)
        heads_config = MedusaConfig(
            num_heads=found.num_heads,
            hidden_size=int(weight.shape[1]),
            vocab_size=int(weight.shape[0]),
            target_num_layers=int(target.model.config.num_hidden_layers),
            num_layers_per_head=found.layers_per_head,
        )
        heads = MedusaHeads(heads_config).to(device=weight.device, dtype=weight.dtype)
        heads.load_state_dict(found.blocks)
        lm_heads = found.lm_heads.to(device=weight.device, dtype=weight.dtype)
        return cls(heads.eval().requires_grad_(False), lm_heads, output_device, copy_heads=False)

    def fresh(self) -> MedusaDrafter:
        """A drafter for another request over the same heads and LM head (shared, not copied), with none of this
        one's per-request state."""
        return type(self)(self.heads, self.lm_head, self._output_device, copy_heads=False)

    # Drafter ---------------------------------------------------------------------------------

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self._context = list(prompt_ids)
        self._features.clear()

    def add_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features ``[k, hidden]`` of committed positions ``start ..`` (known rows are replaced)."""
        self._features.add(start, features)

    def accept(self, committed: Sequence[int]) -> None:
        self._context.extend(committed)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self._context):
            raise ValueError(f"cannot rewind {len(self._context)} committed tokens to {length}")
        del self._context[length:]
        self._features.forget_from(length)

    def reuse_prefix(self, namespace: str, tokens: Sequence[int]) -> int:
        """How much of the prompt's cacheable positions ``tokens`` a request may take from the target's prefix cache:
        all but the last, whose feature the heads read first (the feature of the token before the last committed
        one). Medusa keeps nothing across requests, so the target's cache is all it needs
        (:class:`~specserve.core.draft.drafter.PrefixReusing`)."""
        return max(len(tokens) - 1, 0)

    def keep_prefix(self) -> None:
        """Nothing to keep: the heads read one feature, which the target computes for each request."""

    def propose(self, budget: int) -> Draft:
        """Heads 1 .. min(K, budget)'s top-1 tokens; empty while the feature they read is unknown."""
        count = min(budget, self.config.num_heads)
        ranked = self._ranked(1) if count > 0 else None
        if ranked is None:
            return Draft.empty(self._output_device)
        return Draft(ranked[:count, 0].to(self._output_device), None)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """The static topology of ``spec`` (or of its dynamic budget) filled with each head's ranked candidates."""
        topology = spec.topology if spec.kind == "static" else self.topology_for(spec.budget)
        assert topology is not None
        paths = [path for path in topology.paths if len(path) <= self.config.num_heads]
        ranked = self._ranked(1 + max(rank for path in paths for rank in path)) if paths else None
        if ranked is None:
            return DraftTree.empty(self._output_device)
        tokens, parents = tree_from_candidates(ranked.tolist(), topology)
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._output_device), parents)

    def topology_for(self, budget: TreeBudget | None) -> TreeTopology:
        """The static shape a dynamic budget stands for: the best-first topology of ``rank_probs`` (cached)."""
        assert budget is not None, "a dynamic tree spec carries a budget"
        if budget not in self._topologies:
            depth = min(budget.depth, self.config.num_heads)
            probs = self.config.rank_probs[: budget.width]
            self._topologies[budget] = TreeTopology.best_first(budget.nodes, probs, depth)
        return self._topologies[budget]

    def _ranked(self, width: int) -> torch.Tensor | None:  # [K, width] int64: each head's best tokens, best first
        """The heads' top ``width`` tokens on the feature of the token before the last committed one."""
        feature = self._features.get(len(self._context) - 2)
        if feature is None:
            return None
        with torch.inference_mode():
            logits = self.heads(feature, self.lm_head)  # [K, vocab]
        return logits.topk(min(width, self._draft_vocab), dim=-1).indices


def tree_from_candidates(
    candidates: Sequence[Sequence[int]], topology: TreeTopology
) -> tuple[list[int], tuple[int, ...]]:
    """Tokens and parents of the tree that fills ``topology`` with ``candidates[d]`` (head d + 1's tokens, best
    first): the node at ``(r_0, ..., r_d)`` gets ``candidates[d][r_d]``. Paths deeper than ``len(candidates)``
    or of ranks beyond a head's list are left out (with their descendants); parents stay before children."""
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for path in topology.paths:  # breadth-first: a parent path comes first
        depth, rank = len(path) - 1, path[-1]
        parent = index.get(path[:-1]) if depth else ROOT
        if parent is None or depth >= len(candidates) or rank >= len(candidates[depth]):
            continue
        index[path] = len(tokens)
        tokens.append(int(candidates[depth][rank]))
        parents.append(parent)
    return tokens, tuple(parents)
