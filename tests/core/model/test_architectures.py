"""Which Hugging Face architecture families specserve serves, tested the way a user meets them: a checkpoint
directory.

For each family a tiny random-initialised target (2 layers, grouped-query attention, the char tokenizer's
vocabulary) and a 1-layer draft of the same family sharing its embeddings, first block and head are saved with
``save_pretrained`` (safetensors, ``config.json``, tokenizer files) and loaded back through
:meth:`CausalLM.load`, as a downloaded directory would be. Then, in float64, against transformers' own greedy
``generate`` on a freshly loaded copy (its own attention, none of specserve's):

* the single-request engine, with the draft model and with n-gram lookup, in chains and dynamic trees;
* the batched engine, with a mix of drafters and shapes in one batch, more requests than slots;
* tensor parallelism at world size 2: equal to the full model for the families it supports, otherwise
  refused with a message naming them.

Sliding-window families run with windows (16 positions) shorter than the tests' text, so the window acts: every
layer windowed (Mistral v0.1, Phi-3-mini-4k) and full and windowed layers alternating (Qwen2 with
``use_sliding_window``, Gemma 2 and 3, gpt-oss), with Gemma 2's soft-capped attention logits and gpt-oss's attention
sinks and experts. Mixtures of experts (gpt-oss, Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V3 with multi-head latent
attention) also show that a padded batched step sends every real token to the experts it gets alone. Families with
layers specserve does not serve yet (Qwen3-Next's linear attention) are refused when
they load, saying what. docs/checkpoints.md documents the result.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import (
    EOS_ID,
    MAX_POSITIONS,
    VOCAB,
    assert_pool_empty,
    char_tokenizer,
    finish_all,
    hf_greedy_ids,
)
from family_checkpoints import (
    ALPHA,
    DYNAMIC,
    FAMILIES,
    NEW_TOKENS,
    PROMPTS,
    REFUSED,
    Checkpoint,
    Family,
    build,
    make_checkpoint,
    save,
)
from static_helpers import BUCKETS, RecordingGraphs
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit
from test_tensor_parallel import assert_matches_reference
from transformers import PreTrainedModel

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock, CausalLM
from specserve.core.model.checkpoint_dir import ModelLoadError
from specserve.core.model.tensor_parallel import SHARDABLE_MODEL_TYPES, TensorParallelError, check_shardable
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.graphs import GraphCache
from specserve.core.static.options import StaticOptions
from specserve.core.tree.draft_tree import DraftTree
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.eagle3 import Eagle3Config, Eagle3Head
from specserve.drafters.eagle_head import target_layer_shape

SHAPE = {"chain": None, "tree": DYNAMIC}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_checkpoint(request.param, tmp_path_factory)


def test_a_saved_checkpoint_loads_as_its_family(checkpoint: Checkpoint) -> None:
    info = checkpoint.target.info
    assert info.architecture == FAMILIES[checkpoint.name].architecture
    assert (info.vocab_size, info.max_positions, info.eos_token_ids) == (VOCAB, MAX_POSITIONS, (EOS_ID,))
    assert checkpoint.target.dtype == torch.float64
    # The saved tokenizer encodes as the char tokenizer does. (Not spaces everywhere: transformers 5 loads the
    # tokenizer of a directory whose config says qwen2 as its Qwen2Tokenizer, which pre-tokenises its own way
    # and adds <|endoftext|>; a real Qwen checkpoint's tokenizer is that class anyway.)
    text = "f(x)=x*2;return[x]"
    assert checkpoint.target.tokenizer is not None
    assert checkpoint.target.tokenizer(text)["input_ids"] == char_tokenizer()(text)["input_ids"]
    assert checkpoint.draft.model.config.num_hidden_layers == FAMILIES[checkpoint.name].draft_layers


@pytest.mark.parametrize("shape", list(SHAPE))
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_speculative_greedy_equals_transformers(checkpoint: Checkpoint, drafter: str, shape: str) -> None:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, tree=SHAPE[shape])
    for prompt, expected in checkpoint.greedy.items():
        engine = SpeculativeEngine(checkpoint.target, checkpoint.new_drafter(drafter))
        result = engine.generate(list(prompt), SamplingParams(), config)
        assert result.output_ids == expected, f"{checkpoint.name}, {drafter} {shape}, prompt {prompt}"


def test_batched_engine_equals_transformers(checkpoint: Checkpoint) -> None:
    configs = [
        GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3),
        GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=2, drafter="ngram"),
        GenerationConfig(max_new_tokens=NEW_TOKENS, tree=DYNAMIC),
        GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none"),
    ]
    if "hybrid" in checkpoint.target.windows.types:  # attention and Mamba-2 in one layer: one request at a time
        with pytest.raises(UserError, match=r"side by side.*--max-num-seqs 1"):
            BatchedEngine(checkpoint.target, checkpoint.new_drafter, max_num_seqs=3, max_seq_len=48)
        return
    if checkpoint.target.windows.recurrent:  # a hybrid's batched steps verify chains (core/kv/pool_states.py)
        configs[2] = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4)
    # three slots for four requests: the last waits for the first to finish
    engine = BatchedEngine(checkpoint.target, checkpoint.new_drafter, max_num_seqs=3, max_seq_len=48, prefill_tokens=8)
    prompts = {
        engine.submit(list(prompt), SamplingParams(), config): prompt
        for prompt, config in zip(PROMPTS, configs, strict=True)
    }
    outputs = {prompts[request_id]: result.output_ids for request_id, result in finish_all(engine).items()}
    assert outputs == checkpoint.greedy
    assert_pool_empty(engine)


def test_tensor_parallel_is_exact_or_refused(checkpoint: Checkpoint) -> None:
    model = checkpoint.target.model
    if model.config.model_type in SHARDABLE_MODEL_TYPES:
        # 4 query heads and 2 KV heads over 2 ranks (threads): one KV head each, logits within 1e-10 of the full model
        assert_matches_reference(model, world_size=2, expected_kv_heads=1)
        return
    with pytest.raises(TensorParallelError) as refused:
        check_shardable(model, 2)
    message = str(refused.value)
    assert FAMILIES[checkpoint.name].architecture in message
    assert "Llama, Mistral, Qwen2, Qwen3 and Granite" in message and "tensor parallel size 1" in message
    check_shardable(model, 1)  # and it runs unsharded, as the tests above show


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])  # a sliding-window family; a mixture of experts with sinks
def test_sampled_output_follows_the_targets_law_past_the_window(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """T = 1 through the batched engine with draft-model chains, after a prompt longer than the 16-position window: the
    joint law of the two emitted tokens is transformers' own (chi-square over 2,500 seeds, error probability 1e-3 per
    family), and the first seeds emit what the single-request engine emits."""
    checkpoint = make_checkpoint(name, tmp_path_factory)
    prompt = [5 + (7 * i) % 60 for i in range(20)]
    params = SamplingParams(temperature=1.0, top_k=24)
    config = GenerationConfig(max_new_tokens=2, gamma=3, ignore_eos=True)
    engine = BatchedEngine(checkpoint.target, checkpoint.new_drafter, max_num_seqs=32)
    runs = batched_runs(engine, prompt, params, config, 2500)
    reference = SimpleNamespace(model=checkpoint.reference)  # transformers alone, its own sliding-window masks
    assert two_token_fit([run.output_ids for run in runs], reference, prompt, params) > ALPHA
    single = SpeculativeEngine(checkpoint.target, checkpoint.new_drafter("default"))
    check_single_engine_agrees(single, runs, prompt, params, config)


MIXTURES = ["gpt-oss", "qwen3-moe", "mixtral", "glm4-moe", "deepseek-v3"]  # (Qwen3-Next's are not batched: hybrid)


class ExpertChoices:
    """Records, per MoE layer, the experts each token of a forward was sent to: every family hands its experts module
    (``mlp.experts``) the flattened tokens' chosen expert indices (``[tokens, top_k]``) as its second argument."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.calls: list[torch.Tensor] = []
        experts = [module for name, module in model.named_modules() if name.endswith("mlp.experts")]
        assert experts, f"{type(model).__name__}: no experts module found"
        self.handles = [module.register_forward_pre_hook(self._record) for module in experts]

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.calls.append(args[1].detach().sort(dim=-1).values.clone())  # the set of experts, as sorted indices

    def take(self, width: int) -> list[torch.Tensor]:
        """Per MoE layer, ``[rows, width, top_k]``: the forward's tokens as rows of ``width`` columns."""
        calls, self.calls = self.calls, []
        return [call.reshape(-1, width, call.shape[-1]) for call in calls]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("name", MIXTURES)
def test_a_batched_step_routes_each_real_token_to_the_experts_it_gets_alone(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Rows of different lengths and prefixes in one forward (the short ones padded), a tree block among them: every
    real token's chosen experts, in every MoE layer, are those it is sent to when its sequence runs alone."""
    checkpoint = make_checkpoint(name, tmp_path_factory)
    target = checkpoint.target
    prompts = [list(prompt) for prompt in PROMPTS]
    tree = DraftTree(torch.tensor([21, 22, 23, 24]), (-1, -1, 0, 1))
    blocks_of = [
        lambda seq: BatchBlock.chain(seq, torch.tensor([9, 10, 11, 12, 13])),
        lambda seq: BatchBlock.chain(seq, torch.tensor([30])),
        lambda seq: BatchBlock.tree(seq, 50, tree),
        lambda seq: BatchBlock.chain(seq, torch.tensor([61, 62])),
    ]
    choices = ExpertChoices(target.model)
    try:
        pool = KVPool(target.model, capacity=4 * 32)
        seqs = [pool.allocate(32) for _ in prompts]
        target.forward_batch(pool, [BatchBlock.chain(s, torch.tensor(p)) for s, p in zip(seqs, prompts, strict=True)])
        choices.take(max(map(len, prompts)))
        blocks = [make(seq) for make, seq in zip(blocks_of, seqs, strict=True)]
        target.forward_batch(pool, blocks)
        batched = choices.take(max(block.size for block in blocks))
        for row, (prompt, block) in enumerate(zip(prompts, blocks, strict=True)):
            cache = target.new_cache()
            target.forward(cache, torch.tensor(prompt))
            choices.take(len(prompt))
            if block.ancestry is None:
                target.forward(cache, block.tokens)
            else:
                target.forward_tree(cache, int(block.tokens[0]), tree)
            alone = choices.take(block.size)
            assert len(alone) == len(batched) > 0
            for layer, (together, solo) in enumerate(zip(batched, alone, strict=True)):
                assert torch.equal(together[row, : block.size], solo[0]), f"{name}: row {row}, MoE layer {layer}"
    finally:
        choices.close()


def test_a_latent_pool_expands_only_the_positions_of_its_steps_rows(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Multi-head latent attention in the batched pool: each layer expands the latent (``kv_b_proj``) of the step's
    rows' positions only, not of the pool's whole capacity, and the logits equal those over the whole arena."""
    checkpoint = make_checkpoint("deepseek-v3", tmp_path_factory)
    target = checkpoint.target
    expanded: list[int] = []
    projections = [module for name, module in target.model.named_modules() if name.endswith("kv_b_proj")]
    handles = [
        module.register_forward_hook(lambda m, args, out: expanded.append(args[0].shape[-2])) for module in projections
    ]
    prompts = [list(prompt) for prompt in PROMPTS[:3]]
    logits = {}
    try:
        for gathers in (True, False):
            pool = KVPool(target.model, capacity=400)
            assert pool.gathers
            pool.gathers = gathers
            seqs = [pool.allocate(100) for _ in prompts]
            target.forward_batch(
                pool, [BatchBlock.chain(s, torch.tensor(p)) for s, p in zip(seqs, prompts, strict=True)]
            )
            expanded.clear()
            blocks = [
                BatchBlock.chain(seqs[0], torch.tensor([9, 10, 11])),
                BatchBlock.chain(seqs[2], torch.tensor([30])),
            ]
            logits[gathers] = target.forward_batch(pool, blocks)
            step = [len(prompts[0]) + 3, len(prompts[2]) + 1]
            assert expanded == [sum(step) if gathers else 400 + pool.scratch] * len(projections), expanded
    finally:
        for handle in handles:
            handle.remove()
    for gathered, whole in zip(logits[True], logits[False], strict=True):
        assert torch.allclose(gathered, whole, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss", "deepseek-v3", "qwen3-next"])  # windows, sinks, MLA, hybrid
def test_an_eagle3_head_drafts_for_the_family_exactly(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A random head in the published EAGLE-3 architecture over the family's own features (the inputs of its two
    layers and the output): greedy output equals transformers' ``generate`` with chains and dynamic trees, alone, and
    in a batch of mixed requests for the families that batch (a hybrid's features come from its path-by-path tree
    forward)."""
    checkpoint = make_checkpoint(name, tmp_path_factory)
    target = checkpoint.target
    shape = target_layer_shape(target.model)  # the aux layers of a 2-layer target: the embeddings and both layers
    width = shape["hidden_size"]
    config = Eagle3Config(feature_layers=(0, 1, 2), target_hidden_size=width, draft_vocab_size=VOCAB, **shape)
    head = Eagle3Head(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3 + (parameter.dim() == 1))
    drafter = EagleDrafter.for_target(head.eval(), target)
    for shape, tree in SHAPE.items():
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, tree=tree)
        for prompt, expected in checkpoint.greedy.items():
            result = SpeculativeEngine(target, drafter.fresh()).generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == expected, f"{name}, EAGLE-3 {shape}, prompt {prompt}"
    if target.windows.recurrent:
        return
    engine = BatchedEngine(target, lambda _: drafter.fresh(), max_num_seqs=3, max_seq_len=48, prefill_tokens=8)
    configs = [
        GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3),
        GenerationConfig(max_new_tokens=NEW_TOKENS, tree=DYNAMIC),
    ]
    prompts = {
        engine.submit(list(prompt), SamplingParams(), configs[i % 2]): prompt for i, prompt in enumerate(PROMPTS)
    }
    outputs = {prompts[request_id]: result.output_ids for request_id, result in finish_all(engine).items()}
    assert outputs == checkpoint.greedy
    assert_pool_empty(engine)


WINDOWED = ["mistral-v0.1", "gemma2", "gemma3", "gpt-oss"]


# every windowed family eagerly; through the graph path (slow to record on the CPU) one with alternating windows and
# one with sinks
@pytest.mark.parametrize(
    ("name", "mode"), [*((name, "eager") for name in WINDOWED), ("gemma3", "graphs"), ("gpt-oss", "graphs")]
)
def test_static_shapes_apply_each_layers_window(name: str, mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The static-shape engine (preallocated slots, blocks padded to buckets; on the CPU the graph path through the
    stand-in backend) past the window: greedy output equals transformers' ``generate`` with the draft model and with
    n-gram lookup, chains and dynamic trees."""
    checkpoint = make_checkpoint(name, tmp_path_factory)
    for drafter, (shape, tree) in itertools.product(("model", "ngram"), SHAPE.items()):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, tree=tree)
        engine = SpeculativeEngine(
            checkpoint.target, checkpoint.new_drafter(drafter), static=StaticOptions(buckets=BUCKETS)
        )
        assert engine.static is not None
        engine.static.graphs = GraphCache(RecordingGraphs() if mode == "graphs" else None)
        for prompt, expected in checkpoint.greedy.items():
            result = engine.generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == expected, f"{name} static {mode}, {drafter} {shape}, prompt {prompt}"


# sliding windows (uniform, alternating), soft-capped logits, sinks and experts; a latent pool and a hybrid fall back
@pytest.mark.parametrize("name", [*WINDOWED, "qwen3-moe", "deepseek-v3", "qwen3-next"])
def test_captured_batched_steps_equal_transformers(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The batched engine's steps as captured graphs (the stand-in backend, :mod:`specserve.core.static.batch_graphs`)
    past the window: greedy output equals transformers' ``generate`` for draft-model chains, n-gram, dynamic trees and
    plain decoding, four requests in three slots. A latent pool (DeepSeek-V3) and a hybrid's recurrent layers
    (Qwen3-Next) run the ordinary batched forward instead, and are exact too."""
    checkpoint = make_checkpoint(name, tmp_path_factory)
    experts = checkpoint.target.model.config
    if name in MIXTURES:  # transformers' batched expert matmuls (no host read of the experts hit) can be captured
        experts._experts_implementation = "batched_mm"
    recording = RecordingGraphs()
    engine = BatchedEngine(
        checkpoint.target, checkpoint.new_drafter, max_num_seqs=3, max_seq_len=48, prefill_tokens=8,
        static=StaticOptions(buckets=BUCKETS), graph_backend=recording,
    )  # fmt: skip
    configs = [
        GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3),
        GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=2, drafter="ngram"),
        GenerationConfig(max_new_tokens=NEW_TOKENS, tree=DYNAMIC),
        GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none"),
    ]
    if checkpoint.target.windows.recurrent:  # a hybrid's batched steps verify chains (core/kv/pool_states.py)
        configs[2] = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4)
    window_prompt = tuple(5 + (7 * i) % 60 for i in range(20))  # past the 16-position window
    prompts = [window_prompt, *list(checkpoint.greedy)[1:]]
    expected = {prompt: checkpoint.greedy.get(prompt) or hf_greedy_ids(checkpoint.reference, prompt, NEW_TOKENS)
                for prompt in prompts}  # fmt: skip
    ids = {engine.submit(list(p), SamplingParams(), c): p for p, c in zip(prompts, configs, strict=True)}
    outputs = {ids[request_id]: result.output_ids for request_id, result in finish_all(engine).items()}
    assert outputs == expected
    assert_pool_empty(engine)
    assert engine.graphs is not None
    graphed = name not in ("deepseek-v3", "qwen3-next")
    assert (engine.graphs.steps > 0) == graphed and (recording.replays > 0) == graphed
    assert not engine.graphs.graphs.failures


def test_experts_run_one_by_one_are_not_captured(tmp_path_factory: pytest.TempPathFactory) -> None:
    checkpoint = make_checkpoint("qwen3-moe", tmp_path_factory)  # float64: transformers' eager experts
    engine = BatchedEngine(
        checkpoint.target, checkpoint.new_drafter, max_num_seqs=2, static=StaticOptions(buckets=BUCKETS),
        graph_backend=RecordingGraphs(),
    )  # fmt: skip
    assert engine.graphs is not None and "experts run one by one" in (engine.graphs.refused or "")
    prompt = next(iter(checkpoint.greedy))
    request = engine.submit(list(prompt), SamplingParams(), GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3))
    assert finish_all(engine)[request].output_ids == checkpoint.greedy[prompt] and engine.graphs.steps == 0


def test_every_runnable_family_is_covered_here() -> None:
    tested = {build(family, 2, 0).config.model_type for family in FAMILIES.values()}
    assert set(SHARDABLE_MODEL_TYPES) <= tested, "a model type tensor parallelism accepts must be tested here"


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_specserve_cannot_reproduce_is_refused_when_it_loads(name: str, tmp_path: Path) -> None:
    family, what = REFUSED[name]
    directory = save(build(family, num_layers=2, seed=0), tmp_path / name)
    with pytest.raises(ModelLoadError) as refused:
        CausalLM.load(directory, dtype="float64")
    message = str(refused.value)
    assert what in message and "docs/checkpoints.md" in message


def test_sliding_windows_are_read_per_layer() -> None:
    windows = {name: CausalLM(build(FAMILIES[name], 2, 0)).windows for name in ("mistral-v0.1", "qwen2-sliding")}
    assert windows["mistral-v0.1"].windows == (16, 16) and windows["mistral-v0.1"].uniform == 16
    assert windows["qwen2-sliding"].windows == (None, 16) and windows["qwen2-sliding"].uniform is None
    assert not CausalLM(build(FAMILIES["llama"], 2, 0)).windows.active


@pytest.mark.parametrize(
    "make",
    [
        lambda: build(FAMILIES["mistral"], 1, 0),  # no window at all
        lambda: build(Family("MistralConfig", {"sliding_window": MAX_POSITIONS}, ""), 1, 0),  # as long as the context
    ],
    ids=["no-window", "window-spans-context"],
)
def test_a_window_that_never_acts_is_accepted(make: Callable[[], PreTrainedModel]) -> None:
    CausalLM(make())
