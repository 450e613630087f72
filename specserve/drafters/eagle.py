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
from transformers import DynamicCache, LlamaConfig, LlamaModel, PreTrainedModel

from specserve.core.draft import Draft
from specserve.core.errors import UserError
from specserve.core.model import CausalLM, TargetDescription
from specserve.core.sampling import SamplingParams
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
        cache: DynamicCache | None = None,
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
    ) -> None:
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
        self._cache: Any = None
        self._features: list[torch.Tensor] = []  # the head's input feature of each committed position, fused
        self._cached = 0  # head positions whose keys/values are in the cache (real inputs)

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
        return type(self)(self.head, self.embeddings, self.lm_head, self._output_device)

    # -----------------------------------------------------------------------------------------
    # The drafter contract

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:  # type: ignore[override]
        self.context = list(prompt_ids)
        self.params, self._generator = params, generator
        self._cache = DynamicCache(config=self.head.body.config)
        self._features = []
        self._cached = 0

    def add_features(self, start: int, features: torch.Tensor) -> None:
        if features.numel() == 0:
            return
        if not 0 <= start <= len(self._features):
            raise ValueError(f"features from position {start} leave a gap after the {len(self._features)} known")
        with torch.inference_mode():
            fused = self.head.fuse_features(features.to(self._device))
        del self._features[start:]
        self._features.extend(fused.unbind(0))
        self._cached = min(self._cached, start)  # a position whose input changed must be fed again

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self.context):
            raise ValueError(f"cannot rewind {len(self.context)} committed tokens to {length}")
        del self.context[length:]
        del self._features[length:]
        self._cached = min(self._cached, max(length - 1, 0))

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
        if self._cache is None:
            raise RuntimeError("call start() before proposing")
        return _EagleSession(self)


class _EagleSession:
    """One proposal's head forwards. Head position t holds (feature of t, token t + 1); the committed text
    x_0 .. x_n fills positions 0 .. n - 1 with real features, and the root of the tree is position n - 1 (whose
    output drafts x_{n+1}). Draft nodes sit at n + depth with their parent's output as their feature."""

    @torch.inference_mode()
    def __init__(self, drafter: EagleDrafter) -> None:
        self.drafter = drafter
        self.cache = drafter._cache
        self.committed = len(drafter.context) - 1  # real head positions: 0 .. committed - 1
        keep = min(drafter._cached, self.committed - 1)  # feed at least the root again: its output is needed
        _crop(self.cache, keep)
        positions = range(keep, self.committed)
        features = torch.stack([drafter._features[p] for p in positions])[None]
        tokens = torch.tensor([drafter.context[p + 1] for p in positions], dtype=torch.long, device=drafter._device)
        hidden = drafter.head(features, drafter.embeddings(tokens)[None], cache=self.cache)[0]
        drafter._cached = self.committed
        self.root_hidden = hidden[-1]
        self.root_logits = drafter.lm_head(self.root_hidden)
        self._tokens: list[int] = []  # forwarded nodes, in order
        self._parents: list[int] = []  # their parents, as indices into the forwarded nodes
        self._index: dict[int, int] = {}  # tree node -> forwarded index
        self._hidden: list[torch.Tensor] = []  # head output of each forwarded node

    @torch.inference_mode()
    def expand(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        drafter = self.drafter
        start = len(self._tokens)
        features = []
        for node in nodes:
            parent = parents[node]
            self._parents.append(ROOT if parent == ROOT else self._index[parent])
            features.append(self.root_hidden if parent == ROOT else self._hidden[self._index[parent]])
            self._index[node] = len(self._tokens)
            self._tokens.append(int(tokens[node]))
        forwarded = DraftTree(torch.tensor(self._tokens, dtype=torch.long), tuple(self._parents))
        prefix = self.committed - 1  # the cache holds prefix + root + the nodes forwarded before
        dtype = next(drafter.head.parameters()).dtype
        mask = forwarded.attention_mask(prefix, dtype, drafter._device)[:, :, 1 + start :]
        positions = forwarded.position_ids(prefix, drafter._device)[:, 1 + start :]
        new_tokens = torch.tensor(self._tokens[start:], dtype=torch.long, device=drafter._device)
        hidden = drafter.head(
            torch.stack(features)[None], drafter.embeddings(new_tokens)[None], self.cache, mask, positions
        )[0]
        self._hidden.extend(hidden.unbind(0))
        return drafter.lm_head(hidden)

    def close(self) -> None:
        _crop(self.cache, self.committed)


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions (transformers 5.x's ``crop`` takes a negative count to drop)."""
    current = cache.get_seq_length()
    if current > length:
        cache.crop(length - current)
