"""Tests of tensor-parallel sharding: ranks simulated by threads agree with the unsharded model; a real gloo reduce.

The sharded ranks run in one process, one thread each, joined by an in-test all-reduce that sums in
rank order (so, like :class:`DeterministicAllReduce`, every rank gets the same bits). Each rank runs
the same script as the unsharded reference: a prefill, greedy decode steps, a speculative-style
block with a wrong draft token, rollbacks and re-forwards.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from conftest import VOCAB, build_model, randomise_
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specserve.core.model.causal_lm import CausalLM
from specserve.core.model.tensor_parallel import (
    DeterministicAllReduce,
    RowParallelLinear,
    ShardInfo,
    TensorParallelError,
    check_shardable,
    shard_model,
)

ROOT = Path(__file__).resolve().parents[3]
PROMPT = [5, 17, 33, 60, 61, 9, 41]
DECODE_STEPS = 20
ATOL = 1e-10  # float64: a sharded sum differs from the full matmul only by rounding

T = TypeVar("T")


def ids(tokens: list[int]) -> torch.Tensor:  # [k] int64
    return torch.tensor(tokens, dtype=torch.long)


def llama_variant(
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    bias: bool = False,
    num_layers: int = 2,
) -> PreTrainedModel:
    """A random float64 Llama with the given head layout (and, with ``bias``, biases on every projection)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=128,
        attention_bias=bias,
        mlp_bias=bias,
    )
    model = LlamaForCausalLM(config).double().eval()
    randomise_(model, seed=7)
    return model


# ---------------------------------------------------------------------------------------------
# Ranks as threads


class ThreadAllReduce:
    """An all-reduce among ``world_size`` threads: each gets the sum of all ranks' tensors, added in rank order."""

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.calls = 0  # counted by rank 0

    def member(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor
            self.barrier.wait()
            parts = [part for part in self.slots if part is not None]
            assert len(parts) == len(self.slots)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            self.barrier.wait()  # no rank overwrites its slot before every rank has summed
            if rank == 0:
                self.calls += 1
            return total

        return all_reduce


def shard_copies(model: PreTrainedModel, world_size: int) -> tuple[list[CausalLM], ThreadAllReduce]:
    reducer = ThreadAllReduce(world_size)
    ranks = [
        CausalLM(shard_model(copy.deepcopy(model), rank, world_size, reducer.member(rank)))  # type: ignore[arg-type]
        for rank in range(world_size)
    ]
    return ranks, reducer


def run_ranks(ranks: list[CausalLM], reducer: ThreadAllReduce, script: Callable[[CausalLM], T]) -> list[T]:
    """Run ``script`` on every rank, each in its own thread; a failing rank aborts the others' barriers."""

    def run(lm: CausalLM) -> T:
        try:
            return script(lm)
        except BaseException:
            reducer.barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        futures = [pool.submit(run, lm) for lm in ranks]
        return [future.result(timeout=60) for future in futures]


@dataclass
class Trace:
    logits: list[torch.Tensor]  # each [k, vocab], one per forward
    tokens: list[int]  # the greedy continuation
    kv_heads: list[int]  # per layer, the head dimension of the cached keys
    length: int  # cached positions at the end


def decode_script(lm: CausalLM) -> Trace:
    cache = lm.new_cache()
    logits = [lm.forward(cache, ids(PROMPT))]
    tokens: list[int] = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(lm.forward(cache, ids(tokens[-1:])))
    # A speculative round: verify a block whose last two draft tokens are wrong, roll back past them,
    # then re-forward the right tokens (positions must follow the rolled-back cache).
    keep = len(PROMPT) + 5
    cache.rollback(keep)
    logits.append(lm.forward(cache, ids([tokens[5], tokens[6], 3, 4])))
    cache.rollback(keep + 2)
    logits.append(lm.forward(cache, ids(tokens[7:10]), last_only=False))
    logits.append(lm.forward(cache, ids(tokens[10:11]), last_only=True))
    kv_heads = [int(layer.keys.shape[1]) for layer in cache.inner.layers]
    return Trace(logits, tokens, kv_heads, cache.length)


def assert_matches_reference(model: PreTrainedModel, world_size: int, expected_kv_heads: int) -> list[Trace]:
    reference = decode_script(CausalLM(model))
    ranks, reducer = shard_copies(model, world_size)
    traces = run_ranks(ranks, reducer, decode_script)

    forwards = len(reference.logits)
    assert reducer.calls == 2 * model.config.num_hidden_layers * forwards  # one after attention, one after the MLP
    assert len(set(reference.tokens)) > 3, "a degenerate greedy continuation would make the token check vacuous"
    for rank, trace in enumerate(traces):
        assert trace.tokens == reference.tokens, f"rank {rank}: greedy tokens differ"
        assert trace.length == reference.length == len(PROMPT) + 5 + 2 + 3 + 1
        assert trace.kv_heads == [expected_kv_heads] * model.config.num_hidden_layers, f"rank {rank}"
        for step, (got, want) in enumerate(zip(trace.logits, reference.logits, strict=True)):
            assert got.shape == want.shape
            err = float((got - want).abs().max())
            assert err <= ATOL, f"rank {rank}, forward {step}: max |Δlogit| {err:.3g}"
        for step, (got, want) in enumerate(zip(trace.logits, traces[0].logits, strict=True)):
            assert torch.equal(got, want), f"rank {rank}, forward {step}: logits differ from rank 0's"
    assert reference.kv_heads == [model.config.num_key_value_heads] * model.config.num_hidden_layers
    return traces


# ---------------------------------------------------------------------------------------------
# Sharded forwards equal the full model


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2-split-kv", "tp4-replicated-kv"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sharded_decode_matches_unsharded(family: str, world_size: int) -> None:
    # 4 query heads, 2 KV heads: TP 2 gives each rank one KV head; TP 4 puts each KV head on two ranks.
    assert_matches_reference(build_model(family, num_layers=2, seed=0), world_size, expected_kv_heads=1)


def test_sharded_multi_head_attention_with_biases_everywhere() -> None:
    # 4 KV heads over 2 ranks: 2 KV heads per rank, no grouping; o_proj/down_proj biases are added once.
    model = llama_variant(num_kv_heads=4, bias=True)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert_matches_reference(model, world_size=2, expected_kv_heads=2)


def test_sharded_eager_attention_matches_unsharded() -> None:
    # eager attention repeats KV heads by the module's num_key_value_groups, as sdpa's fallback does
    model = build_model("llama", num_layers=2, seed=0)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    assert_matches_reference(model, world_size=4, expected_kv_heads=1)


def test_shard_layout_and_replicated_kv_heads() -> None:
    model = build_model("llama", num_layers=2, seed=0)
    head_dim = model.config.head_dim
    full_layer = model.model.layers[1]
    ranks, _ = shard_copies(model, world_size=4)
    for rank, lm in enumerate(ranks):
        info = lm.model.tensor_parallel
        assert info == ShardInfo(
            rank=rank, world_size=4, num_heads=1, num_kv_heads=1, kv_replicas=2, intermediate_size=16
        )
        layer = lm.model.model.layers[1]
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.num_key_value_groups == 1
        kv_head = rank // 2  # query head r attends with KV head r // (4 query heads / 2 KV heads)
        assert torch.equal(attn.k_proj.weight, full_layer.self_attn.k_proj.weight[kv_head * head_dim :][:head_dim])
        assert torch.equal(attn.q_proj.weight, full_layer.self_attn.q_proj.weight[rank * head_dim :][:head_dim])
        assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.weight.shape == (32, head_dim)
        assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.weight.shape == (32, 16)
        assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (16, 32)
        # embeddings, norms and head are replicated untouched
        assert torch.equal(lm.model.lm_head.weight, model.lm_head.weight)
        assert torch.equal(layer.input_layernorm.weight, full_layer.input_layernorm.weight)
    # the config keeps describing the checkpoint
    assert ranks[0].model.config.num_attention_heads == 4 and ranks[0].model.config.num_key_value_heads == 2


def test_shards_are_fresh_tensors_so_the_full_weights_can_be_freed() -> None:
    model = build_model("qwen2", num_layers=1, seed=0)
    shard_model(model, rank=1, world_size=2, all_reduce=lambda tensor: tensor)
    for name, param in model.named_parameters():
        if "layers." in name and "norm" not in name:
            storage_bytes = param.untyped_storage().nbytes()
            assert storage_bytes == param.numel() * param.element_size(), f"{name} is a view of a larger tensor"


def test_world_size_one_changes_nothing() -> None:
    model = build_model("llama", num_layers=1, seed=0)
    before = {name: param for name, param in model.named_parameters()}
    assert shard_model(model, rank=0, world_size=1, all_reduce=lambda tensor: tensor) is model
    assert {name: param for name, param in model.named_parameters()} == before
    assert not hasattr(model, "tensor_parallel")
    assert not any(isinstance(module, RowParallelLinear) for module in model.modules())


# ---------------------------------------------------------------------------------------------
# Errors


def tiny_gpt2() -> PreTrainedModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64))


@pytest.mark.parametrize(
    ("make_model", "world_size", "fragments"),
    [
        (lambda: build_model("llama", num_layers=1), 3, ["4 attention heads", "size 3"]),
        (lambda: llama_variant(num_heads=12, num_kv_heads=4, hidden_size=48, intermediate_size=24), 6, ["4 KV heads"]),
        (lambda: llama_variant(intermediate_size=66), 4, ["intermediate size 66", "size 4"]),
        (tiny_gpt2, 2, ["GPT2LMHeadModel", "not a Llama-family model", "tensor parallel size 1"]),
        (lambda: build_model("llama", num_layers=1), 0, [">= 1"]),
    ],
    ids=["heads-by-3", "kv-neither-divides", "intermediate", "gpt2", "zero"],
)
def test_unshardable_models_are_refused_with_a_helpful_message(
    make_model: Callable[[], PreTrainedModel], world_size: int, fragments: list[str]
) -> None:
    model = make_model()
    with pytest.raises(TensorParallelError) as excinfo:
        check_shardable(model, world_size)
    for fragment in fragments:
        assert fragment in str(excinfo.value)
    with pytest.raises(TensorParallelError):
        shard_model(model, 0, world_size, lambda tensor: tensor)


def test_any_model_runs_unsharded() -> None:
    model = tiny_gpt2()
    check_shardable(model, 1)
    assert shard_model(model, 0, 1, lambda tensor: tensor) is model


def test_bad_rank_and_double_sharding_are_refused() -> None:
    model = build_model("llama", num_layers=1, seed=0)
    with pytest.raises(TensorParallelError, match=r"rank must be an integer in \[0, 2\)"):
        shard_model(model, 2, 2, lambda tensor: tensor)
    shard_model(model, 0, 2, lambda tensor: tensor)
    with pytest.raises(TensorParallelError, match="already sharded"):
        shard_model(model, 1, 2, lambda tensor: tensor)


def test_deterministic_all_reduce_needs_an_initialised_process_group() -> None:
    with pytest.raises(TensorParallelError, match="init_process_group"):
        DeterministicAllReduce()


# ---------------------------------------------------------------------------------------------
# DeterministicAllReduce over real gloo processes

GLOO_CHILD = r"""
import datetime, sys
import torch
import torch.distributed as dist
from specserve.core.model.tensor_parallel import DeterministicAllReduce

rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
    timeout=datetime.timedelta(seconds=20),
)
generator = torch.Generator().manual_seed(1000 + rank)
def contribution(shape, dtype):
    # mixed magnitudes, so the order of a floating-point sum shows in the low bits
    scale = 10.0 ** torch.randint(-6, 7, shape, generator=generator)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
reduce = DeterministicAllReduce()
inputs = [
    contribution((1, 5, 32), torch.float32),  # a decode step's hidden states
    contribution((4096,), torch.float32),
    contribution((7, 3), torch.float64),
]
results = [reduce(inputs[0])]
assert reduce.calls == 1 and reduce.seconds > 0
reduce.reset()
assert reduce.calls == 0 and reduce.seconds == 0.0
results += [reduce(x) for x in inputs[1:]]
torch.save({"inputs": inputs, "results": results, "calls": reduce.calls}, out)
dist.barrier()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(90)
def test_deterministic_all_reduce_over_gloo_is_bit_identical_and_rank_ordered(tmp_path: Path) -> None:
    # Three ranks, not two: IEEE addition is commutative, so only from three terms on does the
    # order of the sum change its bits.
    world_size = 3
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_CHILD, str(rank), str(world_size), str(port), str(tmp_path / f"{rank}.pt")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + 60
    try:
        outputs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"

    saved = [torch.load(tmp_path / f"{rank}.pt") for rank in range(world_size)]
    assert all(s["calls"] == 2 for s in saved)
    order_mattered = False
    for index in range(3):
        parts = [s["inputs"][index] for s in saved]
        rank_ordered = (parts[0] + parts[1]) + parts[2]
        for rank, s in enumerate(saved):
            got = s["results"][index]
            assert got.dtype == parts[0].dtype and got.shape == parts[0].shape
            assert torch.equal(got, rank_ordered), f"rank {rank}, tensor {index}: not the rank-ordered sum"
        order_mattered |= not torch.equal(rank_ordered, (parts[2] + parts[1]) + parts[0])
    assert order_mattered, "the inputs never made summation order visible; the bit-identity check is vacuous"
