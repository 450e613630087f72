"""EAGLE drafting: a small head drafts from the target's own hidden states.

A head (:class:`~specserve.drafters.eagle_head.FeatureHead`) works at the level of features. At head position t its
input is the target's feature of token t (EAGLE-1's single top feature, or EAGLE-3's fusion of a low, a middle and a
high layer) together with the embedding of token t + 1; its decoder layer turns them into a hidden state h_t that
stands for the target's feature of token t + 1, and an output head (the target's LM head, or EAGLE-3's own over a
reduced vocabulary) reads h_t as the distribution of token t + 2. Past the committed text the target's features are
unknown, so the head drafts on its own outputs: a draft node's input is its parent's h together with the node's
token. Training unrolls the head on its own outputs the same way (``specserve.training.eagle``, "training-time
test"), so it learns to draft from them.

:class:`EagleDrafter` is a :class:`~specserve.drafters.tree.TreeModelDrafter` whose model access
is an :class:`_EagleSession`: chains, static trees and EAGLE-2's dynamic trees (confidence
expansion + reranking), greedy, sampled (children without replacement, sent with q) and
drafter-invariant, exactly as for a small draft LM. It is a
:class:`~specserve.core.draft.drafter.FeatureDrafter`: the runtime hands it the target's features of the
prompt and of each verdict's root and accepted tokens, so before each proposal the head's KV
holds real inputs for every committed position but the last, and the session feeds the few new
ones first (causal), then the tree level by level with tree attention.

The head's keys and values live in a slot of a :class:`HeadSlots` (:mod:`specserve.core.static.slots`), shared by
every request's drafter over the same head: by default eager and unpadded, exactly the forwards a growing cache would
run; on the static-shape engine (:meth:`EagleDrafter.use_static_shapes`) each block pads to its bucket — a tree
level's reach back over the nodes forwarded before it too — and on a GPU replays as a CUDA graph.

:meth:`EagleDrafter.load` takes a head directory in any layout :mod:`specserve.drafters.eagle_layouts` reads
(specserve's own, or a published EAGLE-1/2/3 head) and checks it against the target. Does not train
(``specserve.training.eagle``) or verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from specserve.core.draft.drafter import ChainBatcher, Draft
from specserve.core.kv.prefix_store import PrefixStore
from specserve.core.model.buckets import NO_BUCKETS
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.graphs import GraphBackend
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import SlotBlock, SlotRows, StaticKVCache, StaticSlots
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeSpec
from specserve.drafters.eagle_batch import EagleChains
from specserve.drafters.eagle_head import FeatureHead, check_head_fits
from specserve.drafters.eagle_layouts import load_head
from specserve.drafters.tree import DraftSession, TreeModelDrafter

# Positions an EAGLE head's store keeps for prefix reuse: each one's fused feature (a hidden-size vector, 2 KiB in
# float32 for the shipped head) and the head's keys and values there (1 KiB), so 96 MiB in all
FEATURE_STORE_POSITIONS = 32768

# One stored position: its fused feature, and the head's keys and values there (a row of StaticKVCache.rows) when the
# head had run over it
StoredPosition = tuple[torch.Tensor, torch.Tensor | None]


class EagleDrafter(TreeModelDrafter):
    """Drafts chains and trees with a head over the target's features, embeddings and LM head."""

    name = "eagle"

    def __init__(
        self,
        head: FeatureHead,
        embeddings: torch.nn.Module,  # the target's input embeddings (frozen)
        lm_head: torch.nn.Module,  # the target's output embeddings (frozen)
        output_device: torch.device | str = "cpu",
        slots: HeadSlots | None = None,
        store: PrefixStore[StoredPosition] | None = None,
        batcher: EagleChains | None = None,
    ) -> None:
        """``slots``: where the head's keys and values live (shared with :meth:`fresh` drafters); by default eager
        and unpadded. ``store``: the fused features of ended (and prefilling) requests and the head's keys and
        values over them, for later requests served from the target's prefix cache (shared with :meth:`fresh`
        drafters; by default :data:`FEATURE_STORE_POSITIONS` positions). ``batcher``: what drafts the chains of
        several requests over this head together (:mod:`specserve.drafters.eagle_batch`; shared with :meth:`fresh`
        drafters)."""
        self.head = head.eval()
        self.target_embeddings, self.target_lm_head = embeddings, lm_head
        self.embeddings = head.input_embeddings(embeddings)  # what embeds the tokens the head reads
        self.lm_head = head.output_head(lm_head)  # what scores h over the target's vocabulary
        self.feature_layers = head.config.feature_layers
        self.vocab_size = head.config.vocab_size
        self._output_device = torch.device(output_device)
        self._device = next(head.parameters()).device
        self.context: list[int] = []
        self.params = SamplingParams()
        self._generator: torch.Generator | None = None
        self.slots = slots or HeadSlots(
            self.head, self.embeddings, self.lm_head, StaticOptions(NO_BUCKETS, cuda_graphs=False)
        )
        self._head_cache: StaticKVCache | None = None
        self._features: list[torch.Tensor] = []  # the head's input feature of each committed position, fused
        # the target's features of the positions after those, not fused yet: fused together when the head needs them
        # (a request that decodes plainly for a while is not charged a small fc product per position and step)
        self._raw: list[torch.Tensor] = []
        self._head_cached = 0  # head positions whose keys/values are in the cache (real inputs)
        self.store = store if store is not None else PrefixStore[StoredPosition](FEATURE_STORE_POSITIONS)
        self._namespace = ""  # the current request's prefix-cache namespace
        self.batcher: ChainBatcher = batcher if batcher is not None else EagleChains()

    @classmethod
    def for_target(
        cls, head: FeatureHead, target: CausalLM, output_device: torch.device | str | None = None
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
        """The head in ``directory`` (any layout :func:`~specserve.drafters.eagle_layouts.load_head` reads) for
        ``target``; given only its description (a drafter in another process), the target is loaded here for its
        embeddings and LM head."""
        model = target if isinstance(target, CausalLM) else CausalLM.load(target.info.path, dtype=dtype, device=device)
        head = load_head(directory, model)
        return cls.for_target(head, model, output_device=target.device)

    def fresh(self) -> EagleDrafter:
        """A drafter for another request over the same head, embeddings and LM head (shared, not copied), with
        none of this one's per-request state."""
        return type(self)(
            self.head,
            self.target_embeddings,
            self.target_lm_head,
            self._output_device,
            self.slots,
            self.store,
            self.batcher if isinstance(self.batcher, EagleChains) else None,
        )

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
        self._features, self._raw = [], []
        self._head_cached = 0

    def add_features(self, start: int, features: torch.Tensor) -> None:
        if features.numel() == 0:
            return
        if not 0 <= start <= self._known:
            raise ValueError(f"features from position {start} leave a gap after the {self._known} known")
        self._forget_from(start)
        self._raw.extend(features.unbind(0))
        self._head_cached = min(self._head_cached, start)  # a position whose input changed must be fed again

    @property
    def _known(self) -> int:
        """Positions whose features this request holds, fused or not."""
        return len(self._features) + len(self._raw)

    def _forget_from(self, position: int) -> None:
        if position < len(self._features):
            del self._features[position:]
            self._raw.clear()
        else:
            del self._raw[position - len(self._features) :]

    def _fuse(self) -> None:
        """Fuse the features not fused yet, in one product (each position's fusion is its own row's)."""
        if self._raw:
            with torch.inference_mode():
                fused = self.head.fuse_features(torch.stack(self._raw).to(self._device))
            self._features.extend(fused.unbind(0))
            self._raw.clear()

    def reuse_prefix(self, namespace: str, tokens: Sequence[int]) -> int:
        """Take the stored features of the longest prefix of ``tokens`` when they reach further than the features
        this request holds (after :meth:`start`, and again during its prefill), with the head's keys and values over
        them where stored; how many positions it knows now."""
        self._namespace = namespace
        stored = self.store.get(namespace, tokens)
        if len(stored) > self._known:
            self._head_cached = min(self._head_cached, self._known)
            self._features, self._raw = [feature for feature, _ in stored], []
            self._reuse_head_cache(stored)
        return self._known

    def _reuse_head_cache(self, stored: Sequence[StoredPosition]) -> None:
        """Load the stored keys and values of the head's positions that match: position t reads token t + 1, so of
        the ``len(stored)`` matching tokens' positions, all but the last."""
        rows: list[torch.Tensor] = []
        for _, row in stored[:-1]:
            if row is None:
                break
            rows.append(row)
        if len(rows) > self._head_cached and self._head_cache is not None:
            self._head_cache.load_rows(torch.stack(rows))
            self._head_cached = len(rows)

    def keep_prefix(self) -> None:
        """Store this request's features (every committed position's it was given so far) and the head's keys and
        values over those it ran on, for other requests: while it prefills, and when it ends."""
        self._fuse()
        cache = self._head_cache
        ran = min(self._head_cached, cache.length, len(self._features)) if cache is not None else 0
        rows = cache.rows(ran) if cache is not None and ran else None
        states = [
            (feature, rows[t] if rows is not None and t < ran else None) for t, feature in enumerate(self._features)
        ]
        self.store.put(self._namespace, self.context, states)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self.context):
            raise ValueError(f"cannot rewind {len(self.context)} committed tokens to {length}")
        del self.context[length:]
        self._forget_from(length)
        self._head_cached = min(self._head_cached, max(length - 1, 0))

    def propose(self, budget: int) -> Draft:
        return self.propose_chain(self.chain_budget(budget))

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        if not self.can_draft:
            return DraftTree(torch.empty(0, dtype=torch.long, device=self._output_device), ())
        return super().propose_tree(spec)

    @property
    def can_draft(self) -> bool:
        """The head needs the features of every committed position but the last (none for a 1-token prompt)."""
        return len(self.context) >= 2 and self._known >= len(self.context) - 1

    # -----------------------------------------------------------------------------------------
    # The head's forwards (a session's, or a batcher's for many requests: specserve.drafters.eagle_batch)

    def unfed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll the head's cache back to the committed positions it holds (feeding the root again at least): the
        tokens ``[k]`` and fused features ``[k, hidden]`` of the head positions still to feed before drafting."""
        if self._head_cache is None:
            raise RuntimeError("call start() before proposing")
        self._fuse()
        committed = len(self.context) - 1
        keep = min(self._head_cached, committed - 1, self._head_cache.length)
        self._head_cache.rollback(keep)
        positions = range(keep, committed)
        features = torch.stack([self._features[p] for p in positions])
        tokens = torch.tensor([self.context[p + 1] for p in positions], dtype=torch.long, device=self._device)
        return tokens, features

    def fed(self) -> None:
        """The head's cache now holds every committed position (and the drafts after them, until :meth:`drafted`)."""
        self._head_cached = len(self.context) - 1

    def drafted(self) -> None:
        """Drop the drafts from the head's cache: it holds the committed positions again."""
        assert self._head_cache is not None
        self._head_cache.rollback(min(len(self.context) - 1, self._head_cache.length))

    @property
    def head_cache(self) -> StaticKVCache | None:
        """The request's slot of the head's keys and values (``None`` before :meth:`start` and after
        :meth:`release`)."""
        return self._head_cache

    def chain_budget(self, budget: int) -> int:
        """What :meth:`propose` drafts of ``budget``: no further than the head's positions, none before it can."""
        return min(budget, self.head.config.max_position_embeddings - len(self.context)) if self.can_draft else 0

    def release(self) -> None:
        """Give the head's slot back (the request ended); :meth:`start` takes one again."""
        if self._head_cache is not None:
            self._head_cache.release()
            self._head_cache = None

    def _open_session(self) -> DraftSession:
        if self._head_cache is None:
            raise RuntimeError("call start() before proposing")
        return _EagleSession(self)


class HeadSlots(StaticSlots):
    """The head's static-shape forwards: its one layer's keys and values in slots; a step takes tokens and the head's
    input features (per-row inputs) and gives the draft logits and h."""

    def __init__(
        self,
        head: FeatureHead,
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

    @torch.inference_mode()
    def run_rows(
        self, caches: Sequence[StaticKVCache], tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager forward over several requests' slots, each fed its own causal block (``tokens[b]`` ``[k]`` with
        their input ``features[b]`` ``[k, hidden]``): per row, the logits and h at its block's last position
        (``[rows, vocab]``, ``[rows, hidden]``), as :meth:`run` of that block alone gives them, up to rounding."""
        sizes = [int(t.shape[0]) for t in tokens]
        rows = SlotRows(caches, sizes, self.dtype)
        width = max(sizes)
        ids = torch.zeros(len(sizes), width, dtype=torch.long, device=self.device)
        inputs = torch.zeros(len(sizes), width, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        for b, (k, row_tokens, row_features) in enumerate(zip(sizes, tokens, features, strict=True)):
            ids[b, :k] = row_tokens
            inputs[b, :k] = row_features
        h = self.head(inputs, self.embeddings(ids), rows, rows.attention_mask, rows.position_ids)
        rows.advance()
        last = h[torch.arange(len(sizes), device=h.device), torch.tensor(sizes, device=h.device) - 1]
        return self.lm_head(last), last


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
        tokens, features = drafter.unfed()
        block = SlotBlock(tokens, tuple(range(len(tokens))), rows=(features,))
        (logits, hidden), graphed = self.slots.run(self.cache.slot, block, last_only=True)
        drafter.fed()
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
        self.drafter.drafted()
