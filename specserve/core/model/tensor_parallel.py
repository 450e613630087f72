"""Megatron-style tensor parallelism applied to an already-loaded Hugging Face Llama-family model.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), §3: in every decoder block the attention projections q/k/v and the MLP's
gate/up are *column-parallel* (each rank keeps some output features: whole attention heads, a
slice of the intermediate dimension) and o/down are *row-parallel* (each rank keeps the matching
input features and produces a partial sum). One all-reduce after attention and one after the MLP
make every rank's residual stream whole again, so embeddings, norms and ``lm_head`` stay
replicated and every rank computes the full logits (rank 0's are the ones used).

:func:`shard_model` rewrites a built model in place; the model's own modeling code is untouched,
so the model never knows it is sharded. Column-parallel layers stay ``nn.Linear`` with fewer
output rows; row-parallel layers become :class:`RowParallelLinear`, which calls the injected
all-reduce. When there are fewer KV heads than ranks, each KV head is replicated on
``world_size // num_key_value_heads`` ranks (as vLLM does), so every rank still holds whole heads.

Two attribute decisions, checked against transformers 5.x ``LlamaAttention`` / ``Qwen2Attention``
/ ``MistralAttention`` (``Qwen3Attention`` adds q/k norms over one head's features, which every rank
applies whole; ``GraniteAttention`` only scales):

* ``self_attn.num_key_value_groups`` is per-module state read by the eager and sdpa attention
  functions (``repeat_kv``), so it is set to (local query heads // local KV heads). ``head_dim``
  and ``scaling`` are per-head and unchanged; projections are reshaped with ``-1`` heads.
* ``model.config`` is **not** changed: it keeps describing the checkpoint. Nothing at forward
  time reads its head counts (``DynamicCache(config=...)`` only reads layer types and sliding
  windows; caches grow from the tensors they are given), while code that derives ``head_dim``
  from ``hidden_size // num_attention_heads`` (Qwen2 has no ``head_dim`` field) or saves the
  config would go wrong if the counts were divided. The per-rank numbers live in
  ``model.tensor_parallel`` (a :class:`ShardInfo`).

:class:`DeterministicAllReduce` is the cross-process reduction: ``all_gather`` then a sum in rank
order, so every rank gets bit-identical results whatever the backend's ring order.

Does not: create process groups or spawn processes (the caller does), shard the vocabulary
(embeddings and ``lm_head`` are replicated), support architectures other than the Llama family
(:data:`SHARDABLE_MODEL_TYPES`; others run at ``world_size == 1`` only), or load weights shard by
shard (the full model is loaded first, then sliced; the full tensors can be freed afterwards).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specserve.core.errors import UserError

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks; every rank gets the sum

# ``config.model_type`` of the architectures whose sharded forwards are tested equal to the full model's
# (tests/core/model/test_tensor_parallel.py, tests/core/model/test_architectures.py). Others with the same projection
# names may still keep state this module does not split (OLMo 2's q/k norms span all heads; StableLM reshapes by a
# per-module head count), so they are refused rather than guessed at.
SHARDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")
SHARDABLE_FAMILIES = "Llama, Mistral, Qwen2, Qwen3 and Granite"

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class TensorParallelError(UserError):
    """A model or world size that cannot be tensor-parallel sharded; the message says what to change."""


@dataclass(frozen=True)
class ShardInfo:
    """What one rank holds; recorded as ``model.tensor_parallel`` by :func:`shard_model`."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when a KV head is replicated)
    kv_replicas: int  # ranks that hold each KV head (1 when KV heads are divided)
    intermediate_size: int  # MLP intermediate features on this rank


# ---------------------------------------------------------------------------------------------
# Validation


@dataclass(frozen=True)
class _Block:
    """One decoder block's attention and MLP modules and their projections."""

    attn: nn.Module  # the model's own attention class (LlamaAttention, Qwen2Attention, ...)
    mlp: nn.Module
    linears: dict[str, nn.Linear]  # "q_proj" .. "o_proj", "gate_proj" .. "down_proj"


@dataclass(frozen=True)
class _Dims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


def _blocks(model: nn.Module) -> list[_Block]:
    """The decoder blocks of a Llama-family model; raises unless every block has the expected projections."""
    name = type(model).__name__
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TensorParallelError(
            f"{name} is not a Llama-family model (no model.model.layers); tensor parallelism supports "
            f"{SHARDABLE_FAMILIES} checkpoints; run this model with tensor parallel size 1"
        )
    blocks = []
    for index, layer in enumerate(layers):
        parents = {"self_attn": getattr(layer, "self_attn", None), "mlp": getattr(layer, "mlp", None)}
        linears: dict[str, nn.Linear] = {}
        for parent, names in (("self_attn", ATTENTION_PROJECTIONS), ("mlp", MLP_PROJECTIONS)):
            missing = []
            for projection in names:
                module = getattr(parents[parent], projection, None)
                if isinstance(module, nn.Linear):
                    linears[projection] = module
                else:
                    missing.append(projection)
            if missing:
                raise TensorParallelError(
                    f"{name} layer {index} has no nn.Linear {parent}.{'/'.join(missing)}; tensor parallelism supports "
                    f"Llama-family blocks ({SHARDABLE_FAMILIES}); run this model with tensor parallel size 1"
                )
        attn, mlp = parents["self_attn"], parents["mlp"]
        assert isinstance(attn, nn.Module) and isinstance(mlp, nn.Module)  # they hold nn.Linear children
        blocks.append(_Block(attn, mlp, linears))
    return blocks


def _dims(model: nn.Module, blocks: list[_Block]) -> _Dims:
    """The full model's head and MLP sizes, read from the config and checked against every block's weights."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    num_heads = int(getattr(config, "num_attention_heads", 0) or 0)
    intermediate_size = int(getattr(config, "intermediate_size", 0) or 0)
    if num_heads < 1 or intermediate_size < 1:
        raise TensorParallelError(
            f"{name}'s config has no num_attention_heads/intermediate_size; tensor parallelism supports "
            "Llama-family models; run this model with tensor parallel size 1"
        )
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(blocks[0].attn, "head_dim", None) or blocks[0].linears["q_proj"].out_features // num_heads)
    for index, block in enumerate(blocks):
        linears = block.linears
        expected = {
            "self_attn.q_proj": (linears["q_proj"].out_features, num_heads * head_dim),
            "self_attn.k_proj": (linears["k_proj"].out_features, num_kv_heads * head_dim),
            "self_attn.v_proj": (linears["v_proj"].out_features, num_kv_heads * head_dim),
            "self_attn.o_proj": (linears["o_proj"].in_features, num_heads * head_dim),
            "mlp.gate_proj": (linears["gate_proj"].out_features, intermediate_size),
            "mlp.up_proj": (linears["up_proj"].out_features, intermediate_size),
            "mlp.down_proj": (linears["down_proj"].in_features, intermediate_size),
        }
        for what, (actual, wanted) in expected.items():
            if actual != wanted:
                raise TensorParallelError(
                    f"{name} layer {index} {what} has {actual} features where the config implies {wanted} "
                    f"({num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}, intermediate "
                    f"{intermediate_size}); tensor parallelism needs the checkpoint's full weights"
                )
    return _Dims(num_heads, num_kv_heads, head_dim, intermediate_size)


def check_shardable(model: nn.Module, world_size: int) -> None:
    """Raise :class:`TensorParallelError` unless ``model`` can be split over ``world_size`` ranks.

    Any model runs at ``world_size == 1``. Above that the model must be Llama-family (its
    ``config.model_type`` one of :data:`SHARDABLE_MODEL_TYPES`), the query
    heads and the MLP intermediate size must divide by ``world_size``, and the KV heads must
    either divide by it (each rank gets some) or divide it (each is replicated on
    ``world_size // num_key_value_heads`` ranks). Example: 32 query heads and 8 KV heads shard
    over 2, 4 or 8 ranks by dividing KV heads, and over 16 or 32 by replicating them.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TensorParallelError(f"tensor parallel size must be an integer >= 1, got {world_size!r}")
    if world_size == 1:
        return
    if getattr(model, "tensor_parallel", None) is not None:
        raise TensorParallelError(f"{type(model).__name__} is already sharded; shard a freshly loaded model")
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SHARDABLE_MODEL_TYPES:
        raise TensorParallelError(
            f"{name} (model_type {model_type!r}) is not a Llama-family model that tensor parallelism supports "
            f"({SHARDABLE_FAMILIES}); run this model with tensor parallel size 1"
        )
    dims = _dims(model, _blocks(model))
    if dims.num_heads % world_size:
        raise TensorParallelError(
            f"{name} has {dims.num_heads} attention heads, which do not divide by tensor parallel size {world_size}; "
            f"choose a size that divides {dims.num_heads}"
        )
    if dims.intermediate_size % world_size:
        raise TensorParallelError(
            f"{name} has MLP intermediate size {dims.intermediate_size}, which does not divide by tensor parallel "
            f"size {world_size}; choose a size that divides {dims.intermediate_size}"
        )
    if dims.num_kv_heads % world_size and world_size % dims.num_kv_heads:
        raise TensorParallelError(
            f"{name} has {dims.num_kv_heads} KV heads and tensor parallel size {world_size}: neither divides the "
            "other, so the KV heads can be neither split nor replicated evenly; choose a size that divides "
            f"{dims.num_kv_heads} or a multiple of {dims.num_kv_heads} that divides {dims.num_heads}"
        )


# ---------------------------------------------------------------------------------------------
# Sharding


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ weight_shard.T) + bias``: a linear layer whose input features are split.

    The bias is the full one and is added once, after the reduction.
    """

    def __init__(
        self,
        weight: torch.Tensor,  # [out_features, local in_features]
        bias: torch.Tensor | None,  # [out_features], the full bias
        all_reduce: AllReduce,
        requires_grad: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        self.all_reduce = all_reduce
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., local in_features] -> [..., out_features]
        out = self.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, bias={self.bias is not None}"


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    """Column-parallel: keep the output features ``rows`` (weight rows and bias entries), as fresh tensors."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=linear.weight.requires_grad)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=linear.bias.requires_grad)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, columns: slice, all_reduce: AllReduce) -> RowParallelLinear:
    """Row-parallel: keep the input features ``columns``; the full bias is added after the reduction."""
    with torch.no_grad():
        weight = linear.weight[:, columns].clone()
        bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(weight, bias, all_reduce, requires_grad=linear.weight.requires_grad)


def shard_model(model: nn.Module, rank: int, world_size: int, all_reduce: AllReduce) -> nn.Module:
    """Turn ``model`` (in place) into rank ``rank``'s share of a ``world_size``-way tensor-parallel model.

    ``all_reduce`` sums a tensor over the ranks and returns the same sum on every rank (for
    bit-identical logits it must sum in a fixed order, as :class:`DeterministicAllReduce` does).
    Every rank must run the same forwards in lockstep: each decoder block calls ``all_reduce``
    twice. At ``world_size == 1`` the model is returned unchanged. Returns ``model``.

    Rank r holds query heads ``[r*h, (r+1)*h)`` with ``h = num_heads // world_size``, MLP features
    ``[r*m, (r+1)*m)``, and either KV heads ``[r*g, (r+1)*g)`` with ``g = num_kv_heads //
    world_size`` or, when replicating, the single KV head ``r // (world_size // num_kv_heads)``,
    which is the one its query heads attend with.
    """
    check_shardable(model, world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise TensorParallelError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if world_size == 1:
        return model
    blocks = _blocks(model)
    dims = _dims(model, blocks)
    local_heads = dims.num_heads // world_size
    if dims.num_kv_heads % world_size == 0:
        kv_replicas = 1
        local_kv_heads = dims.num_kv_heads // world_size
        first_kv_head = rank * local_kv_heads
    else:  # world_size % num_kv_heads == 0, checked above
        kv_replicas = world_size // dims.num_kv_heads
        local_kv_heads = 1
        first_kv_head = rank // kv_replicas
    local_intermediate = dims.intermediate_size // world_size

    head_dim = dims.head_dim
    q_rows = slice(rank * local_heads * head_dim, (rank + 1) * local_heads * head_dim)
    kv_rows = slice(first_kv_head * head_dim, (first_kv_head + local_kv_heads) * head_dim)
    mlp_rows = slice(rank * local_intermediate, (rank + 1) * local_intermediate)

    for block in blocks:
        _keep_rows(block.linears["q_proj"], q_rows)
        _keep_rows(block.linears["k_proj"], kv_rows)
        _keep_rows(block.linears["v_proj"], kv_rows)
        block.attn.o_proj = _row_parallel(block.linears["o_proj"], q_rows, all_reduce)
        _keep_rows(block.linears["gate_proj"], mlp_rows)
        _keep_rows(block.linears["up_proj"], mlp_rows)
        block.mlp.down_proj = _row_parallel(block.linears["down_proj"], mlp_rows, all_reduce)
        # Read by repeat_kv in the eager and sdpa attention functions. (setattr: nn.Module's typed
        # attribute assignment only admits tensors and modules.)
        setattr(block.attn, "num_key_value_groups", local_heads // local_kv_heads)  # noqa: B010

    info = ShardInfo(
        rank=rank,
        world_size=world_size,
        num_heads=local_heads,
        num_kv_heads=local_kv_heads,
        kv_replicas=kv_replicas,
        intermediate_size=local_intermediate,
    )
    setattr(model, "tensor_parallel", info)  # noqa: B010
    return model


# ---------------------------------------------------------------------------------------------
# Cross-process reduction


class DeterministicAllReduce:
    """Sum a tensor over a ``torch.distributed`` process group, bit-identically on every rank.

    A backend all-reduce adds in whatever order its ring or tree visits the ranks, and that order
    can differ between ranks and runs, so floating-point sums may differ in the last bits. This
    gathers every rank's tensor (``all_gather``: pure copies) and adds them in rank order, rank 0
    first, with the same elementwise kernel on every rank, so all ranks get the same bits, and
    the same bits on every run. It moves ``world_size`` times the data of a ring all-reduce,
    which is cheap for the small activations of decoding.

    ``seconds`` accumulates the wall time spent in ``all_gather`` (on CUDA, NCCL returns once the
    copy is enqueued, so there it is host time only) and ``calls`` the number of reductions.
    A group of size 1 returns the input untouched and counts nothing.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise TensorParallelError(
                "torch.distributed is not initialised; call torch.distributed.init_process_group first"
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:  # any shape; returns the same shape and dtype
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        start = time.perf_counter()
        dist.all_gather(gathered, tensor, group=self.group)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        total = gathered[0]
        for part in gathered[1:]:
            total = total + part
        return total
