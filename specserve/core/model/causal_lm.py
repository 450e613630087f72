"""Adapter over a local Hugging Face causal LM: load, forward a block of tokens with a KV cache, roll back.

One sequence's cache is a :class:`~specserve.core.kv.cache.KVCache` (rollback by cropping), or for a hybrid model with
recurrent layers a :class:`~specserve.core.kv.recurrent.RecurrentKVCache` (rollback by checkpoint and recompute).
Positions of a new block follow from the cache length, so a block of k tokens after a rollback
is positioned exactly as a fresh forward over the kept prefix would be.

A draft *tree* is verified in one forward by giving the model a 4-D additive attention mask and
explicit position ids (:meth:`CausalLM.forward_tree`; a recurrent model's path by path), and the rejected branches are
dropped from the cache afterwards (:meth:`KVCache.compact`). No modeling code is forked: the model is
whatever ``AutoModelForCausalLM`` builds from the directory's ``config.json``. Does not know
about drafting, verification or sampling.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import SafetensorError

from specserve.core.attention.flex import batch_attention
from specserve.core.attention.sdpa import RaggedBatch, ragged_batch, register_attention, use_grouped_attention
from specserve.core.attention.windows import LayerWindows, layer_windows
from specserve.core.errors import UserError
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import KVPool
from specserve.core.kv.recurrent import RecurrentKVCache
from specserve.core.model.buckets import VerifyBuckets
from specserve.core.model.checkpoint_dir import ModelLoadError, check_checkpoint_dir
from specserve.core.tree.draft_tree import DraftTree

if TYPE_CHECKING:  # transformers' modelling code is imported where a model is loaded, not by every importer
    from transformers import PreTrainedModel

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# Any of these marks a directory as carrying a tokenizer; a draft checkpoint may come without one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was requested but no CUDA device is available; use --device cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {name!r}; use cpu or cuda")
    return torch.device(name)


class BlockCache(Protocol):
    """A cache that runs its own forwards over a block (:class:`~specserve.core.static.slots.StaticKVCache`: padded
    to a bucket, perhaps replayed as a CUDA graph); :meth:`CausalLM.forward` and :meth:`CausalLM.forward_tree` hand
    it their blocks."""

    @property
    def length(self) -> int: ...

    def forward_block(
        self, block: BatchBlock, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def compact(self, keep: Sequence[int]) -> None: ...


def select_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The features a hidden-state drafter reads (:class:`~specserve.core.draft.drafter.FeatureDrafter`): the
    ``hidden_states`` transformers returns (0 = embeddings, i = after layer i, the last after the final
    norm) at ``layers``, concatenated on the last axis. Serving and training both use this one definition."""
    count = len(hidden_states)
    if not layers or any(not 0 <= layer < count for layer in layers):
        raise ValueError(f"feature layers must be in 0..{count - 1}, got {list(layers)}")
    return torch.cat([hidden_states[layer] for layer in layers], dim=-1)


class FeatureCapture:
    """Asks one forward for the target's features at ``layers``; :attr:`value` holds them afterwards
    (``[k, len(layers) * hidden]``, one row per token of the block).

    A batched forward (:meth:`CausalLM.forward_batch`) takes one capture per block (or ``None`` for a block
    whose features nobody reads), each filled with its own block's features, as a forward of that block alone
    fills it."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = tuple(int(layer) for layer in layers)
        self.value: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        """The captured features (once), for the forward that was just run."""
        if self.value is None:
            raise RuntimeError("no forward has captured features yet")
        value, self.value = self.value, None
        return value


@dataclass(frozen=True)
class ModelInfo:
    path: str
    vocab_size: int  # width of the logits
    max_positions: int
    eos_token_ids: tuple[int, ...]
    architecture: str


class CausalLM:
    """A loaded causal LM plus its tokenizer (``None`` when the directory has none)."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any | None = None, path: str = "<in-memory>") -> None:
        self.model = model.eval()
        use_grouped_attention(model)  # masked verify blocks without a copy of the KV per query head
        self.tokenizer = tokenizer
        config = model.config
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        if eos is None:
            eos = config.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.info = ModelInfo(
            path=path,
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            max_positions=int(max_positions or 2048),
            eos_token_ids=eos_ids,
            architecture=type(model).__name__,
        )
        self.windows = _attention_windows(model, self.info)
        # transformers 5.x renamed ``past_key_values`` to ``cache``; older models keep the old name.
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled in another process (an argument of a Ray actor): that process registers the grouped attention
        its model runs, which :mod:`specserve.core.attention.sdpa` does on first use rather than at import."""
        register_attention()
        self.__dict__.update(state)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @classmethod
    def load(cls, path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> CausalLM:
        """Load a local checkpoint directory (config + weights + tokenizer) with ``local_files_only``."""
        directory = Path(path)
        torch_dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
        torch_device = resolve_device(device)
        check_checkpoint_dir(directory)
        from transformers import AutoModelForCausalLM

        try:
            # torch's grouped expert matmul takes no float64: mixtures of experts run their experts one by one then
            options = {"experts_implementation": "eager"} if torch_dtype == torch.float64 else {}
            model = AutoModelForCausalLM.from_pretrained(
                str(directory), local_files_only=True, dtype=torch_dtype, **options
            )
        # SafetensorError / UnpicklingError: a truncated or corrupt weights file (neither is an OSError).
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError, pickle.UnpicklingError) as exc:
            raise ModelLoadError(f"could not load a causal LM from {directory}: {_first_line(exc)}") from exc
        model = model.to(torch_device)  # type: ignore[arg-type]  # transformers wraps .to
        return cls(model, load_tokenizer(directory), path=str(directory))

    def describe(self) -> TargetDescription:
        return TargetDescription(self.info, self.tokenizer, self.device)

    def new_cache(self) -> KVCache:
        """A cache for one sequence: a hybrid model's (recurrent layers: :mod:`specserve.core.kv.recurrent`) also rolls
        back its recurrent states."""
        if self.windows.recurrent:
            return RecurrentKVCache(self.model, self._run_rows)
        return KVCache(self.model)

    @torch.inference_mode()
    def _run_rows(self, cache: Any, input_ids: torch.Tensor, positions: torch.Tensor, outputs: str) -> Any:
        """One plain model call for :class:`~specserve.core.kv.recurrent.RecurrentKVCache` (``outputs``: "feed",
        "logits" or "hidden")."""
        kwargs = {self._cache_kwarg: cache, "position_ids": positions.to(self.device), "use_cache": True}
        if outputs == "feed":
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=input_ids.to(self.device), output_hidden_states=outputs == "hidden", **kwargs)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache | BlockCache,
        input_ids: torch.Tensor,  # [k] int64, the tokens at positions cache.length .. cache.length + k - 1
        last_only: bool = False,
        capture: FeatureCapture | None = None,
    ) -> torch.Tensor:  # [k, vocab] (or [1, vocab] when last_only) logits, in the model's dtype
        """Append ``input_ids`` to the cache and return their next-token logits (and, with ``capture``, keep
        every token's features there)."""
        if isinstance(cache, RecurrentKVCache):
            cache.before_chain()
            positions = cache.length + torch.arange(input_ids.shape[0], device=self.device)[None]
            kwargs = {
                self._cache_kwarg: cache.inner,
                "logits_to_keep": 1 if last_only else 0,
                "position_ids": positions,
            }
            logits = self._call(input_ids.to(self.device)[None], [input_ids.shape[0]], [capture], kwargs)[0]
            cache.after_chain(input_ids)
            return logits
        if not isinstance(cache, KVCache):  # a static-shape cache: padded to its bucket, perhaps replayed as a graph
            return cache.forward_block(BatchBlock.chain(0, input_ids), last_only=last_only, capture=capture)
        kwargs = {self._cache_kwarg: cache.inner, "logits_to_keep": 1 if last_only else 0}
        return self._call(input_ids.to(self.device)[None], [input_ids.shape[0]], [capture], kwargs)[0]

    def _call(
        self,
        input_ids: torch.Tensor,  # [rows, width]
        sizes: Sequence[int],  # per row, its real (unpadded) tokens: the first ``sizes[row]`` columns
        captures: Sequence[FeatureCapture | None],  # per row
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One model call; the logits ``[rows, ..., vocab]``, and each row's features (of its real tokens) into its
        capture when it has one."""
        wanted = any(capture is not None for capture in captures)
        if wanted:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=input_ids, use_cache=True, **kwargs)
        if wanted:
            for row, (capture, k) in enumerate(zip(captures, sizes, strict=True)):
                if capture is not None:
                    capture.value = select_features([hidden[row, :k] for hidden in out.hidden_states], capture.layers)
        return out.logits

    @torch.inference_mode()
    def forward_tree(
        self,
        cache: KVCache | BlockCache,
        root: int,
        tree: DraftTree,
        capture: FeatureCapture | None = None,
    ) -> torch.Tensor:
        """Append the block ``[root] + tree nodes`` to the cache in one forward with tree attention.

        Returns ``[n + 1, vocab]`` logits: row 0 is the next-token distribution after the root,
        row ``i + 1`` after node ``i`` — each equal to a plain forward over the node's root-to-node
        path. The cache then holds the whole block; :meth:`KVCache.compact` keeps the accepted path.
        """
        if isinstance(cache, RecurrentKVCache):  # recurrent layers read a block in order: the tree path by path
            logits, hidden = cache.forward_tree(root, tree, hidden=capture is not None)
            if capture is not None:
                capture.value = select_features(hidden, capture.layers)
            return logits
        if not isinstance(cache, KVCache):
            return cache.forward_block(BatchBlock.tree(0, root, tree), capture=capture)
        prefix = cache.length
        ids = torch.cat([torch.tensor([root], dtype=torch.long), tree.tokens.to("cpu", torch.long)])
        positions = tree.position_ids(prefix, self.device)
        mask = tree.attention_mask(prefix, self.dtype, self.device)
        kwargs = {
            self._cache_kwarg: cache.inner,
            "attention_mask": self.windows.mask_argument(mask, positions[0]),
            "position_ids": positions,
        }
        return self._call(ids.to(self.device)[None], [ids.shape[0]], [capture], kwargs)[0]

    @torch.inference_mode()
    def extend_tree(self, cache: KVCache, tree: DraftTree, start: int) -> torch.Tensor:
        """Append nodes ``start ..`` of ``tree`` when the cache already holds ``[root] + nodes[:start]``
        (``start`` may be 0: only the root is cached).

        For drafting a tree level by level: each level costs a forward over its new nodes only.
        Returns ``[n - start, vocab]`` logits, each equal to a plain forward over the node's path.
        """
        if not 0 <= start < tree.size:
            raise ValueError(f"start must be in 0..{tree.size - 1} (nodes already cached), got {start}")
        if isinstance(cache, RecurrentKVCache):
            return cache.extend_tree(tree, start)
        prefix = cache.length - 1 - start  # the cache holds prefix + root + nodes[:start]
        if prefix < 0:
            raise ValueError(f"the cache ({cache.length}) cannot hold the root and {start} nodes")
        mask = tree.attention_mask(prefix, self.dtype, self.device)[:, :, 1 + start :]
        block = tree.position_ids(prefix, self.device)  # [1, n + 1]: the root's and every node's
        positions = block[:, 1 + start :]
        ids = tree.tokens[start:].to(self.device, torch.long)[None]
        keys = torch.cat([torch.arange(prefix, device=self.device), block[0]])  # the cache's, then the new nodes'
        kwargs = {
            self._cache_kwarg: cache.inner,
            "attention_mask": self.windows.mask_argument(mask, positions[0], keys),
            "position_ids": positions,
        }
        return self.model(input_ids=ids, use_cache=True, **kwargs).logits[0]

    @torch.inference_mode()
    def forward_batch(
        self,
        pool: KVPool,
        blocks: Sequence[BatchBlock],
        last_only: bool = False,
        capture: Sequence[FeatureCapture | None] | None = None,
        buckets: VerifyBuckets | None = None,
        graphs: CapturedSteps | None = None,
    ) -> list[torch.Tensor]:
        """Append every block to its own sequence in ``pool`` in one forward; per block, its ``[k, vocab]`` logits
        (``[1, vocab]``, its last token's, with ``last_only``: the head then runs on one token per row).

        Each row sees its own cached prefix and its own block (causally, or by the block's tree ancestry),
        never another row's: block b's logits equal :meth:`forward` (a chain) or :meth:`forward_tree` (a tree)
        on that sequence alone. The pool's sequences then hold the whole blocks; the caller rolls back or compacts.

        ``capture``: one :class:`FeatureCapture` (or ``None``) per block; block b's is filled with the ``[k,
        width]`` features of its k real tokens at its own layers, what a forward of that sequence alone captures.

        ``buckets``: the step runs at the bucket of its widest block (:mod:`specserve.core.model.buckets`); the extra
        columns are padding queries, as a shorter block's are, which attend to nothing and write to scratch.

        ``graphs``: a step that fits its buckets runs as a captured step of this pool instead
        (:mod:`specserve.core.static.batch_graphs`), with the same results up to rounding.
        """
        if not blocks:
            raise ValueError("a batched forward needs at least one block")
        captures: list[FeatureCapture | None] = [None] * len(blocks) if capture is None else list(capture)
        if len(captures) != len(blocks):
            raise ValueError(f"{len(captures)} feature captures for {len(blocks)} blocks: give one per block")
        if graphs is not None and graphs.pool is pool and graphs.fits(blocks):
            return graphs.forward(blocks, last_only, captures)
        given = blocks
        reread = [0] * len(blocks)  # per row, tokens read again before its block (a hybrid's recurrent checkpoint)
        if pool.states is not None:
            blocks, reread = _after_checkpoints(pool, blocks)
        sizes = [block.size for block in blocks]
        width = max(sizes) if buckets is None else buckets.width(max(sizes))
        view = pool.view([block.seq_id for block in blocks], sizes, width)
        rows, low = len(blocks), torch.finfo(self.dtype).min
        ids = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        masks: list[torch.Tensor | None] = []
        for row, (block, prefix) in enumerate(zip(blocks, view.lengths, strict=True)):
            k = block.size
            ids[row, :k] = block.tokens.to("cpu", torch.long)
            positions[row, :k] = prefix + torch.tensor(block.offsets)
            positions[row, k:] = prefix
            if k == 1:
                masks.append(None)  # one query sees its whole span: its prefix and itself
                continue
            mask = torch.zeros(k, prefix + k, dtype=self.dtype)  # its own cached prefix, and its block by ancestry
            mask[:, prefix:].masked_fill_(~block.attends(), low)
            masks.append(mask.to(self.device))
        kwargs: dict[str, Any] = {
            self._cache_kwarg: view,
            # transformers takes a 4-D mask as given; the ragged attention reads each row's own mask instead
            "attention_mask": torch.zeros(rows, 1, width, 1, dtype=self.dtype, device=self.device),
            "position_ids": positions.to(self.device),
        }
        if last_only:  # [rows, 1]: per row, the column of its last real token
            kwargs["logits_to_keep"] = torch.tensor([[k - 1] for k in sizes], device=self.device)
        rows_positions = [positions[row, :k].to(self.device) for row, k in enumerate(sizes)]
        ragged_rows = view.rows(masks, rows_positions if self.windows.active else None)
        one_call = batch_attention(self.device) == "flex"
        with ragged_batch(RaggedBatch(ragged_rows, self.dtype, one_call)) as ragged:
            logits = self._call(ids.to(self.device), sizes, captures, kwargs)
        if pool.states is not None:
            read = [block.tokens.tolist() for block in blocks]
            pool.states.after_step([block.seq_id for block in blocks], read, width, view.recurrent)
            for row_capture, skip in zip(captures, reread, strict=True):
                if row_capture is not None and skip and row_capture.value is not None:
                    row_capture.value = row_capture.value[skip:]
        # the pool's attention layers this model runs (all of them, or the first few for a layer-skip view)
        attending = sum(1 for layer in pool.arena_of if layer < self.model.config.get_text_config().num_hidden_layers)
        if ragged.calls != attending:
            raise RuntimeError(
                f"{self.info.architecture} attended through specserve's ragged attention in {ragged.calls} of its "
                f"{attending} layers; batched forwards need a model whose attention goes through transformers' "
                f"AttentionInterface, loaded with attn_implementation='sdpa'"
            )
        if last_only:
            return [logits[row, :1] for row in range(len(blocks))]
        return [
            logits[row, skip : skip + block.size] for row, (skip, block) in enumerate(zip(reread, given, strict=True))
        ]


class CapturedSteps(Protocol):
    """Batched steps of one pool that run captured when they fit
    (:class:`~specserve.core.static.batch_graphs.BatchGraphs`)."""

    pool: KVPool

    def fits(self, blocks: Sequence[BatchBlock]) -> bool: ...

    def forward(
        self, blocks: Sequence[BatchBlock], last_only: bool, captures: Sequence[FeatureCapture | None]
    ) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class BatchBlock:
    """One sequence's block in :meth:`CausalLM.forward_batch`: its pool sequence id, its tokens and how they attend."""

    seq_id: int
    tokens: torch.Tensor  # [k] int64
    ancestry: torch.Tensor | None = None  # [k, k] bool, row i may see column j; None = causal (a chain or a prefill)
    offsets: tuple[int, ...] = ()  # [k] position of token i after the sequence's cached prefix; () = 0 .. k - 1

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def chain(seq_id: int, tokens: torch.Tensor) -> BatchBlock:
        """``tokens`` appended causally (a verify chain headed by the last committed token, or a prefill chunk)."""
        return BatchBlock(seq_id, tokens, None, tuple(range(int(tokens.shape[0]))))

    @staticmethod
    def tree(seq_id: int, root: int, tree: DraftTree) -> BatchBlock:
        """``[root] + tree nodes`` with tree attention, as :meth:`CausalLM.forward_tree` lays them out."""
        return BatchBlock.after(seq_id, root, tree.tokens, tree.parents)

    @staticmethod
    def after(seq_id: int, root: int, tokens: torch.Tensor, parents: Sequence[int]) -> BatchBlock:
        """``[root] + nodes`` where node i has parent ``parents[i]`` (-1 = the root): each node sees the root, its
        ancestors and itself, at position ``1 + depth`` after the root. A chain (parents -1, 0, 1, ...) is causal."""
        size = len(parents)
        sees = torch.zeros(size + 1, size + 1, dtype=torch.bool)
        sees[:, 0] = True
        depths: list[int] = []
        for node, parent in enumerate(parents):
            sees[node + 1] |= sees[parent + 1]
            sees[node + 1, node + 1] = True
            depths.append(0 if parent < 0 else depths[parent] + 1)
        ids = torch.cat([torch.tensor([root], dtype=torch.long), tokens.to("cpu", torch.long)])
        return BatchBlock(seq_id, ids, sees, (0, *(1 + depth for depth in depths)))

    def attends(self) -> torch.Tensor:
        """[k, k] bool: which of the block's tokens each of them sees."""
        if self.ancestry is not None:
            return self.ancestry
        return torch.ones(self.size, self.size, dtype=torch.bool).tril()


def _after_checkpoints(pool: KVPool, blocks: Sequence[BatchBlock]) -> tuple[list[BatchBlock], list[int]]:
    """A hybrid's step (:mod:`specserve.core.kv.pool_states`): each sequence's KV cut back to its recurrent checkpoint
    and its block extended in front by the tokens past it; the blocks, and how many tokens each row reads again."""
    extended, reread = [], []
    for block in blocks:
        if block.offsets != tuple(range(block.size)) or not bool(block.attends().equal(block.attends().tril())):
            raise UserError(
                "a hybrid model's recurrent layers read a block in order, so its batched steps take chains only; "
                "verify draft trees one request at a time (--max-num-seqs 1)"
            )
        pending = pool.rewind_to_checkpoint(block.seq_id)
        tokens = torch.cat([torch.tensor(pending, dtype=torch.long), block.tokens.to("cpu", torch.long)])
        extended.append(BatchBlock.chain(block.seq_id, tokens))
        reread.append(len(pending))
    return extended, reread


@dataclass(frozen=True)
class TargetDescription:
    """What a drafter needs to know about its target without holding the target's weights."""

    info: ModelInfo
    tokenizer: Any | None
    device: torch.device


def load_tokenizer(directory: str | Path) -> Any | None:
    """The tokenizer saved in ``directory``, or ``None`` when the directory carries none."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # any failure means the tokenizer files are unusable
        raise ModelLoadError(f"could not load the tokenizer in {directory}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _attention_windows(model: PreTrainedModel, info: ModelInfo) -> LayerWindows:
    """The model's sliding windows (:mod:`specserve.core.attention.windows`); refuses layers that are not attention."""
    try:
        windows = layer_windows(model.config, info.max_positions)
    except ValueError as exc:
        raise ModelLoadError(
            f"{info.architecture} has {exc}; specserve serves full and sliding-window attention and linear-attention "
            "(recurrent) layers only (the "
            "supported families are listed in docs/checkpoints.md)"
        ) from exc
    return windows
