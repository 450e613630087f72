"""EAGLE drafting: a one-layer head that drafts from the target's own hidden states, through its own LM head.

The head (:class:`EagleHead`) works at the level of features. At head position t its input is the
target's feature of token t — EAGLE-3's fusion of a low, a middle and a high layer
(``feature_layers``, concatenated and projected by ``fuse``), or EAGLE-1's single top feature —
together with the embedding of token t + 1 (the target's own, frozen); one Llama decoder layer
turns them into a hidden state h_t that stands for the target's feature of token t + 1, and the
target's frozen LM head reads h_t as the distribution of token t + 2. Past the committed text the
target's features are unknown, so the head drafts on its own outputs: a draft node's input is
its parent's h together with the node's token. Training unrolls the head on its own outputs the
same way (``specserve.training.eagle``, "training-time test"), so it learns to draft from them.

:class:`EagleDrafter` is a :class:`~specserve.drafters.tree.TreeModelDrafter` whose model access
is an :class:`_EagleSession`: chains, static trees and EAGLE-2's dynamic trees (confidence
expansion + reranking), greedy, sampled (children without replacement, sent with q) and
drafter-invariant, exactly as for a small draft LM. It is a
:class:`~specserve.core.draft.FeatureDrafter`: the runtime hands it the target's features of the
prompt and of each verdict's root and accepted tokens, so before each proposal the head's KV
holds real inputs for every committed position but the last, and the session feeds the few new
ones first (causal), then the tree level by level with tree attention.

The head's keys and values live in a slot of a :class:`HeadSlots` (:mod:`specserve.core.static_cache`), shared by
every request's drafter over the same head: by default eager and unpadded, exactly the forwards a growing cache would
run; on the static-shape engine (:meth:`EagleDrafter.use_static_shapes`) each block pads to its bucket — a tree
level's reach back over the nodes forwarded before it too — and on a GPU replays as a CUDA graph.

A trained head is an HF-style directory (``config.json`` naming ``"specserve_drafter": "eagle"``,
``model.safetensors`` with the head's weights only, a ``README.md`` card); :meth:`EagleDrafter.load`
checks it against the target. Does not train (``specserve.training.eagle``) or verify.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaModel, PreTrainedModel
from transformers.cache_utils import Cache

from specserve.core.buckets import NO_BUCKETS
from specserve.core.draft import Draft
from specserve.core.errors import UserError
from specserve.core.graphs import GraphBackend
from specserve.core.model import CausalLM, TargetDescription
from specserve.core.sampling import SamplingParams
from specserve.core.static_cache import SlotBlock, StaticKVCache, StaticOptions, StaticSlots
from specserve.core.tree import ROOT, DraftTree, TreeSpec
from specserve.drafters.head_files import CONFIG_FILE, WEIGHTS_FILE, read_head_config
from specserve.drafters.tree import DraftSession, TreeModelDrafter

KIND = "eagle"
TRAIN_HINT = "train one with `specserve train eagle --target DIR`"


class EagleLoadError(UserError):
    """An EAGLE head directory is missing, malformed, or was trained for another target."""


@dataclass(frozen=True)
class EagleConfig:
    feature_layers: tuple[int, ...]  # indices into the target's hidden_states (select_features)
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_num_layers: int = 0
    target_architecture: str = ""

    @staticmethod
    def for_target(target: PreTrainedModel, feature_layers: Sequence[int] | None = None) -> EagleConfig:
        """A head shaped like one of ``target``'s layers; default features: EAGLE-3's low, middle and high layer."""
        config = target.config
        layers = int(config.num_hidden_layers)
        chosen = tuple(feature_layers) if feature_layers is not None else default_feature_layers(layers)
        if not chosen or any(not 0 < layer <= layers for layer in chosen):
            raise UserError(f"EAGLE feature layers must be in 1..{layers} (the target's layers), got {list(chosen)}")
        rope = getattr(config, "rope_parameters", None) or {}
        return EagleConfig(
            feature_layers=chosen,
            hidden_size=int(config.hidden_size),
            vocab_size=int(target.get_output_embeddings().weight.shape[0]),
            intermediate_size=int(config.intermediate_size),
            num_attention_heads=int(config.num_attention_heads),
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            max_position_embeddings=int(config.max_position_embeddings),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            target_num_layers=layers,
            target_architecture=type(target).__name__,
        )

    def body_config(self) -> LlamaConfig:
        """The one decoder layer (with rotary embeddings and a final norm) as a 1-layer Llama model; it never
        sees token ids (inputs_embeds only), so its own vocabulary is a single row."""
        return LlamaConfig(
            vocab_size=1,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's fused features: a low, a middle and the top layer (the top one is after the final norm)."""
    if num_layers < 3:
        return (num_layers,)
    return (2, num_layers // 2, num_layers)


class EagleHead(torch.nn.Module):
    """The trainable part: feature fusion, the input projection and one decoder layer (nothing of the target's)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        width = config.hidden_size
        fused = len(config.feature_layers) * width
        self.fuse: torch.nn.Module = (
            torch.nn.Linear(fused, width, bias=False) if fused != width else torch.nn.Identity()
        )
        self.fc = torch.nn.Linear(2 * width, width, bias=False)
        self.body = LlamaModel(config.body_config())

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's raw features ``[..., len(layers) * hidden]`` -> the head's input features ``[..., hidden]``."""
        return self.fuse(features.to(self.fc.weight.dtype))

    def forward(
        self,
        features: torch.Tensor,  # [batch, k, hidden]: fused target features, or the head's own outputs
        token_embeds: torch.Tensor,  # [batch, k, hidden]: the target's embeddings of the next tokens
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [batch, k, hidden]: h, standing for the next token's feature; LM head -> the token after
        inputs = self.fc(torch.cat([token_embeds.to(self.fc.weight.dtype), features], dim=-1))
        out = self.body(
            inputs_embeds=inputs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    # -----------------------------------------------------------------------------------------

    def save(self, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
        """``config.json`` + ``model.safetensors`` (the head's weights only)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = {"specserve_drafter": KIND, **asdict(self.config), **(extra or {})}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE))

    @staticmethod
    def read_config(directory: str | Path) -> dict[str, Any]:
        return read_head_config(directory, KIND, "an EAGLE head", EagleLoadError, TRAIN_HINT)

    @classmethod
    def load(cls, directory: str | Path) -> EagleHead:
        """The head saved in ``directory``, in the dtype it was saved in."""
        data = cls.read_config(directory)
        fields = {name: data[name] for name in EagleConfig.__dataclass_fields__ if name in data}
        try:
            config = EagleConfig(**{**fields, "feature_layers": tuple(fields["feature_layers"])})
        except (KeyError, TypeError) as exc:
            raise EagleLoadError(f"{directory}/{CONFIG_FILE} is incomplete: {exc}") from exc
        head = cls(config)
        weights = Path(directory) / WEIGHTS_FILE
        if not weights.is_file():
            raise EagleLoadError(f"{directory} has no {WEIGHTS_FILE}")
        try:
            state = load_file(str(weights))
            head = head.to(next(iter(state.values())).dtype)
            head.load_state_dict(state)
        except (RuntimeError, OSError, StopIteration) as exc:
            raise EagleLoadError(f"could not load the EAGLE head weights in {weights}: {exc}") from exc
        return head.eval()


def check_head_fits(head: EagleHead, target: CausalLM | TargetDescription, hidden_size: int, num_layers: int) -> None:
    """Raise :class:`EagleLoadError` unless ``head`` reads this target's features and scores its vocabulary."""
    config = head.config
    problems = []
    if config.vocab_size != target.info.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} vs the target's {target.info.vocab_size}")
    if config.hidden_size != hidden_size:
        problems.append(f"hidden size {config.hidden_size} vs the target's {hidden_size}")
    if max(config.feature_layers) > num_layers or (config.target_num_layers and config.target_num_layers != num_layers):
        problems.append(f"features of a {config.target_num_layers}-layer target vs this {num_layers}-layer one")
    if problems:
        raise EagleLoadError(
            f"this EAGLE head was trained for another target ({'; '.join(problems)}); "
            f"train one for {target.info.path} with `specserve train eagle --target {target.info.path}`"
        )


class EagleDrafter(TreeModelDrafter):
    """Drafts chains and trees with an :class:`EagleHead` over the target's features, embeddings and LM head."""

    name = "eagle"

    def __init__(
        self,
        head: EagleHead,
        embeddings: torch.nn.Module,  # the target's input embeddings (frozen)
        lm_head: torch.nn.Module,  # the target's output embeddings (frozen)
        output_device: torch.device | str = "cpu",
        slots: HeadSlots | None = None,
    ) -> None:
        """``slots``: where the head's keys and values live (shared with :meth:`fresh` drafters); by default eager
        and unpadded."""
        self.head = head.eval()
        self.embeddings = embeddings
        self.lm_head = lm_head
        self.feature_layers = head.config.feature_layers
        self.vocab_size = head.config.vocab_size
        self._output_device = torch.device(output_device)
        self._device = next(head.parameters()).device
        self.context: list[int] = []
        self.params = SamplingParams()
        self._generator: torch.Generator | None = None
        self.slots = slots or HeadSlots(self.head, embeddings, lm_head, StaticOptions(NO_BUCKETS, cuda_graphs=False))
        self._head_cache: StaticKVCache | None = None
        self._features: list[torch.Tensor] = []  # the head's input feature of each committed position, fused
        self._head_cached = 0  # head positions whose keys/values are in the cache (real inputs)

    @classmethod
    def for_target(
        cls, head: EagleHead, target: CausalLM, output_device: torch.device | str | None = None
    ) -> EagleDrafter:
        model = target.model
        check_head_fits(head, target, int(model.config.hidden_size), int(model.config.num_hidden_layers))
        embeddings, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(embeddings, torch.nn.Module) and isinstance(lm_head, torch.nn.Module)
        head = head.to(device=target.device, dtype=target.dtype)
        return cls(head, embeddings, lm_head, output_device or target.device)

    @classmethod
    def load(
        cls, directory: str | Path, target: CausalLM | TargetDescription, dtype: str = "float32", device: str = "cpu"
    ) -> EagleDrafter:
        """A trained head for ``target``; given only its description (a drafter in another process), the target
        is loaded here for its embeddings and LM head."""
        head = EagleHead.load(directory)
        if isinstance(target, TargetDescription):
            loaded = CausalLM.load(target.info.path, dtype=dtype, device=device)
            return cls.for_target(head, loaded, output_device=target.device)
        return cls.for_target(head, target)

    def fresh(self) -> EagleDrafter:
        """A drafter for another request over the same head, embeddings and LM head (shared, not copied), with
        none of this one's per-request state."""
        return type(self)(self.head, self.embeddings, self.lm_head, self._output_device, self.slots)

    def use_static_shapes(self, options: StaticOptions, backend: GraphBackend | None = None) -> None:
        """Draft on the static-shape engine: the head's blocks padded to the buckets and, on a GPU (or with
        ``backend``), replayed as graphs; the catch-up blocks and the one-node chain steps are captured now."""
        self.slots = HeadSlots(self.head, self.embeddings, self.lm_head, options, backend)
        self.slots.capture(last_only=(True, False))

    # -----------------------------------------------------------------------------------------
    # The drafter contract

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:  # type: ignore[override]
        self.context = list(prompt_ids)
        self.params, self._generator = params, generator
        if self._head_cache is not None:
            self._head_cache.release()
        self._head_cache = self.slots.new_cache()
        self._features = []
        self._head_cached = 0

    def add_features(self, start: int, features: torch.Tensor) -> None:
        if features.numel() == 0:
            return
        if not 0 <= start <= len(self._features):
            raise ValueError(f"features from position {start} leave a gap after the {len(self._features)} known")
        with torch.inference_mode():
            fused = self.head.fuse_features(features.to(self._device))
        del self._features[start:]
        self._features.extend(fused.unbind(0))
        self._head_cached = min(self._head_cached, start)  # a position whose input changed must be fed again

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self.context):
            raise ValueError(f"cannot rewind {len(self.context)} committed tokens to {length}")
        del self.context[length:]
        del self._features[length:]
        self._head_cached = min(self._head_cached, max(length - 1, 0))

    def propose(self, budget: int) -> Draft:
        budget = min(budget, self.head.config.max_position_embeddings - len(self.context))
        if not self.can_draft:
            budget = 0
        return self.propose_chain(budget)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        if not self.can_draft:
            return DraftTree(torch.empty(0, dtype=torch.long, device=self._output_device), ())
        return super().propose_tree(spec)

    @property
    def can_draft(self) -> bool:
        """The head needs the features of every committed position but the last (none for a 1-token prompt)."""
        return len(self.context) >= 2 and len(self._features) >= len(self.context) - 1

    def _open_session(self) -> DraftSession:
        if self._head_cache is None:
            raise RuntimeError("call start() before proposing")
        return _EagleSession(self)


class HeadSlots(StaticSlots):
    """The head's static-shape forwards: its one layer's keys and values in slots; a step takes tokens and the head's
    input features (per-row inputs) and gives the draft logits and h."""

    def __init__(
        self,
        head: EagleHead,
        embeddings: torch.nn.Module,
        lm_head: torch.nn.Module,
        options: StaticOptions,
        backend: GraphBackend | None = None,
    ) -> None:
        weight = next(head.parameters())
        config = head.body.config
        super().__init__(config, weight.dtype, weight.device, head.config.max_position_embeddings, options, backend)
        self.head, self.embeddings, self.lm_head = head, embeddings, lm_head

    def _blank_rows(self, width: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(width, self.head.config.hidden_size, dtype=self.dtype, device=self.device),)

    def _call(
        self,
        cache: Cache,
        ids: torch.Tensor,
        rows: Sequence[torch.Tensor],
        shape: dict[str, torch.Tensor],
        last: torch.Tensor,
        last_only: bool,
        hidden: bool,
    ) -> tuple[torch.Tensor, ...]:
        mask, positions = shape.get("attention_mask"), shape.get("position_ids")
        h = self.head(rows[0][None], self.embeddings(ids)[None], cache, mask, positions)[0]
        if last_only:
            h = h.index_select(0, last) if shape else h[-1:]
        return self.lm_head(h), h


class _EagleSession:
    """One proposal's head forwards. Head position t holds (feature of t, token t + 1); the committed text
    x_0 .. x_n fills positions 0 .. n - 1 with real features, and the root of the tree is position n - 1 (whose
    output drafts x_{n+1}). Draft nodes sit at n + depth with their parent's output as their feature; each level's
    block reaches back over the nodes forwarded before it, seeing only its ancestors among them."""

    @torch.inference_mode()
    def __init__(self, drafter: EagleDrafter) -> None:
        assert drafter._head_cache is not None
        self.drafter = drafter
        self.slots = drafter.slots
        self.cache = drafter._head_cache
        self.committed = len(drafter.context) - 1  # real head positions: 0 .. committed - 1
        keep = min(drafter._head_cached, self.committed - 1, self.cache.length)  # feed at least the root again
        self.cache.rollback(keep)
        positions = range(keep, self.committed)
        features = torch.stack([drafter._features[p] for p in positions])
        tokens = torch.tensor([drafter.context[p + 1] for p in positions], dtype=torch.long, device=drafter._device)
        block = SlotBlock(tokens, tuple(range(len(positions))), rows=(features,))
        (logits, hidden), graphed = self.slots.run(self.cache.slot, block, last_only=True)
        drafter._head_cached = self.committed
        self.root_hidden = hidden[0].clone() if graphed else hidden[0]
        self.root_logits = logits[0].clone() if graphed else logits[0]
        self._tokens: list[int] = []  # forwarded nodes, in order
        self._parents: list[int] = []  # their parents, as indices into the forwarded nodes
        self._depths: list[int] = []  # their depths (0: the root's children)
        self._index: dict[int, int] = {}  # tree node -> forwarded index
        self._hidden: list[torch.Tensor] = []  # head output of each forwarded node

    @torch.inference_mode()
    def expand(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        drafter = self.drafter
        start = len(self._tokens)
        features = []
        for node in nodes:
            parent = parents[node]
            forwarded_parent = ROOT if parent == ROOT else self._index[parent]
            self._parents.append(forwarded_parent)
            self._depths.append(0 if parent == ROOT else self._depths[forwarded_parent] + 1)
            features.append(self.root_hidden if parent == ROOT else self._hidden[forwarded_parent])
            self._index[node] = len(self._tokens)
            self._tokens.append(int(tokens[node]))
        k = len(nodes)
        # the cache holds the committed text and the `start` nodes forwarded before; a node sits at committed + depth
        offsets = tuple(depth - start for depth in self._depths[start:])
        chain = k == 1 and self._depths[start] == start  # one node below all forwarded before: a causal step
        sees = None
        if not chain:
            forwarded = DraftTree(torch.tensor(self._tokens, dtype=torch.long), tuple(self._parents))
            sees = forwarded.ancestry()[1 + start :, 1:]  # [k, start + k]: its ancestors among the forwarded nodes
        new_tokens = torch.tensor(self._tokens[start:], dtype=torch.long, device=drafter._device)
        block = SlotBlock(new_tokens, offsets, sees, rows=(torch.stack(features),))
        (logits, hidden), graphed = self.slots.run(self.cache.slot, block)
        logits, hidden = logits[:k], hidden[:k]
        if graphed:
            logits, hidden = logits.clone(), hidden.clone()
        self._hidden.extend(hidden.unbind(0))
        return logits

    def close(self) -> None:
        self.cache.rollback(min(self.committed, self.cache.length))
