"""Layer-skip self-speculation: the early-exit view shares the target's weights, computes what a shallow copy
of the target computes, and speculative decoding with it stays exact; an exit head starts as plain layer-skip,
round-trips through its directory, refuses other targets, keeps decoding exact, and training it helps."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import REF_TOKENS, VOCAB, TinyPair, build_model, char_tokenizer
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.layerskip import (
    ExitHead,
    ExitHeadError,
    ExitNorm,
    LayerSkipDrafter,
    early_exit_model,
    load_exit_head,
    save_exit_head,
)

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]


def deep_target(family: str) -> CausalLM:
    return CausalLM(build_model(family, num_layers=4, seed=3).double())


@functools.cache
def greedy_target(family: str) -> CausalLM:
    """The 4-layer target of the greedy tests, one per family, alive for the whole session: ``hf_greedy`` memoises
    by ``id(model)``, so a target freed between tests could hand its address, and its references, to another."""
    return CausalLM(build_model(family, num_layers=4, seed=5).double())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_view_shares_weights_and_equals_a_shallow_copy(family: str) -> None:
    target = deep_target(family)
    view = early_exit_model(target, 2)
    target_params = {p.data_ptr() for p in target.model.parameters()}
    assert all(p.data_ptr() in target_params for p in view.model.parameters())  # no new weights
    assert len(target.model.model.layers) == 4  # the target itself is untouched
    shallow = build_model(family, num_layers=2, seed=0).double()
    shallow.load_state_dict(target.model.state_dict(), strict=False)  # layers 2 and 3 are not in it
    ids = torch.tensor([[5, 17, 23, 8, 30, 2, 9]])
    with torch.inference_mode():
        want = shallow(input_ids=ids).logits[0]
    got = view.forward(view.new_cache(), ids[0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert len(view.new_cache().inner.layers) == 2


def test_bad_layer_counts_are_refused() -> None:
    target = deep_target("llama")
    for layers in (0, 4, 9):
        with pytest.raises(UserError, match="1 <= layers < 4"):
            early_exit_model(target, layers)


@pytest.mark.parametrize("layers", [1, 3])
def test_greedy_self_speculation_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy, layers: int) -> None:
    target = greedy_target(pair.family)
    engine = SpeculativeEngine(target, LayerSkipDrafter(target, layers))
    accepted = 0
    for prompt in pair.prompts[:4]:
        for config in (
            GenerationConfig(max_new_tokens=REF_TOKENS, gamma=3),
            GenerationConfig(max_new_tokens=REF_TOKENS, tree=TreeSpec("dynamic", budget=TreeBudget(3, 2, 5))),
        ):
            result = engine.generate(prompt, SamplingParams(), config)
            assert result.output_ids == hf_greedy(target, prompt, REF_TOKENS), (layers, prompt, config)
            accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_sampled_self_speculation_reproduces(pair: TinyPair) -> None:
    target = CausalLM(build_model(pair.family, num_layers=4, seed=5).double())
    engine = SpeculativeEngine(target, LayerSkipDrafter(target, 2))
    params = SamplingParams(temperature=1.0, top_k=30, seed=4)
    config = GenerationConfig(max_new_tokens=16, gamma=3)
    first = engine.generate(pair.prompts[0], params, config)
    assert engine.generate(pair.prompts[0], params, config).output_ids == first.output_ids


def test_the_registry_builds_layerskip_drafters(pair: TinyPair) -> None:
    from specserve.drafters.registry import build_drafter

    target = CausalLM(build_model(pair.family, num_layers=4, seed=5).double())
    drafter = build_drafter("layerskip:2", target)
    assert isinstance(drafter, LayerSkipDrafter) and drafter.layers == 2
    for bad in ("layerskip:", "layerskip:two", "layerskip:-1"):
        with pytest.raises(UserError, match="layerskip:L"):
            build_drafter(bad, target)


# ---------------------------------------------------------------------------------------------
# The trained exit head


def random_exit_head(hidden_size: int = 32, seed: int = 7) -> ExitHead:
    """An exit head with every weight drawn (W2 too, so it is not the identity), in float64."""
    head = ExitHead(hidden_size, 24).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype) + (param.dim() == 1))
    return head


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_untrained_exit_head_is_plain_layerskip_and_leaves_the_target_alone(family: str) -> None:
    target = deep_target(family)
    norm = target.model.model.norm
    state = {k: v.clone() for k, v in target.model.state_dict().items()}
    ids = torch.tensor([5, 17, 23, 8, 30, 2, 9])
    target_logits = target.forward(target.new_cache(), ids)
    head = ExitHead(32, generator=torch.Generator().manual_seed(0))
    assert not head.down.weight.any() and head.up.weight.any()
    plain, with_head = early_exit_model(target, 2), early_exit_model(target, 2, head)
    assert isinstance(with_head.model.model.norm, ExitNorm) and with_head.model.model.norm.norm is norm
    want = plain.forward(plain.new_cache(), ids)
    torch.testing.assert_close(with_head.forward(with_head.new_cache(), ids), want, rtol=0, atol=0)
    assert head.up.weight.dtype == torch.float64  # moved to the target's dtype
    # the target is untouched: same norm object, same modules, same weights, same logits
    assert target.model.model.norm is norm and len(target.model.model.layers) == 4
    assert target.model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in target.model.state_dict().items())
    torch.testing.assert_close(target.forward(target.new_cache(), ids), target_logits, rtol=0, atol=0)
    assert set(head.state_dict()) == {"norm.weight", "up.weight", "down.weight"}  # no target module in the head


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_view_with_a_head_computes_what_training_computes(family: str) -> None:
    """Serving (the view's own forward) and training (the target's hidden_states[L] -> head -> norm -> LM head)
    are the same function; a non-zero head changes the view."""
    from specserve.training.exit_head import early_exit_logits

    target = deep_target(family)
    head = random_exit_head()
    view = early_exit_model(target, 3, head)
    ids = torch.tensor([[5, 17, 23, 8, 30, 2, 9]])
    with torch.inference_mode():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states[3]
        trained_path = early_exit_logits(target.model, head, hidden)[0]
    got = view.forward(view.new_cache(), ids[0])
    torch.testing.assert_close(got, trained_path, rtol=0, atol=1e-10)
    plain = early_exit_model(target, 3)
    assert not torch.allclose(got, plain.forward(plain.new_cache(), ids[0]))


def test_an_exit_head_directory_round_trips(tmp_path: Path) -> None:
    target = deep_target("llama")
    head = random_exit_head()
    save_exit_head(tmp_path / "head", head, target, 2)
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["specserve_drafter"] == "exit-head" and config["layers"] == 2
    assert (config["hidden_size"], config["intermediate_size"], config["target_num_layers"]) == (32, 24, 4)
    assert (config["target_architecture"], config["vocab_size"]) == ("LlamaForCausalLM", VOCAB)
    loaded, layers = load_exit_head(tmp_path / "head", target)
    assert layers == 2 and loaded.up.weight.dtype == torch.float64
    for name, tensor in head.state_dict().items():  # saved in float32
        torch.testing.assert_close(loaded.state_dict()[name], tensor.float().double(), rtol=0, atol=0)
    drafter = LayerSkipDrafter.from_directory(target, tmp_path / "head")
    assert drafter.layers == 2 and drafter.exit_head is not None
    want = early_exit_model(target, 2, loaded)
    ids = torch.tensor([3, 4, 5, 6])
    torch.testing.assert_close(
        drafter.model.forward(drafter.model.new_cache(), ids), want.forward(want.new_cache(), ids), rtol=0, atol=0
    )


def test_bad_exit_head_directories_are_refused(tmp_path: Path, saved_pair_dirs: dict[str, Path]) -> None:
    target = deep_target("llama")
    cases = {
        tmp_path / "missing": "does not exist",
        saved_pair_dirs["target"]: "not an exit head directory",  # a model directory
    }
    (tmp_path / "empty").mkdir()
    cases[tmp_path / "empty"] = "has no config.json"
    broken = save_exit_head(tmp_path / "broken", random_exit_head(), target, 2)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cases[broken] = "could not read"
    bad_json = save_exit_head(tmp_path / "bad-json", random_exit_head(), target, 2)
    (bad_json / "config.json").write_text("{")
    cases[bad_json] = "not valid JSON"
    bad_layers = save_exit_head(tmp_path / "bad-layers", random_exit_head(), target, 2)
    config = json.loads((bad_layers / "config.json").read_text())
    (bad_layers / "config.json").write_text(json.dumps({**config, "layers": 4}))
    cases[bad_layers] = "must be below target_num_layers"
    for directory, message in cases.items():
        with pytest.raises(ExitHeadError, match=message):
            load_exit_head(directory, target)
    assert issubclass(ExitHeadError, UserError)


def test_an_exit_head_for_another_target_is_refused(tmp_path: Path) -> None:
    directory = save_exit_head(tmp_path / "head", random_exit_head(), deep_target("llama"), 2)
    shallower = CausalLM(build_model("llama", num_layers=3, seed=3).double())
    with pytest.raises(ExitHeadError, match=r"target_num_layers 4 \(the target has 3\)"):
        load_exit_head(directory, shallower)
    with pytest.raises(ExitHeadError, match=r"target_architecture LlamaForCausalLM .*train an exit head for"):
        load_exit_head(directory, deep_target("qwen2"))
    with pytest.raises(ExitHeadError, match=r"hidden states of size 16 .* hidden size 32"):
        early_exit_model(deep_target("llama"), 2, ExitHead(16))


@pytest.mark.parametrize("layers", [1, 3])
def test_greedy_self_speculation_with_an_exit_head_equals_transformers(
    pair: TinyPair, hf_greedy: HfGreedy, layers: int
) -> None:
    target = greedy_target(pair.family)
    engine = SpeculativeEngine(target, LayerSkipDrafter(target, layers, random_exit_head(seed=layers)))
    accepted = 0
    for prompt in pair.prompts[:4]:
        for config in (
            GenerationConfig(max_new_tokens=REF_TOKENS, gamma=3),
            GenerationConfig(max_new_tokens=REF_TOKENS, tree=TreeSpec("dynamic", budget=TreeBudget(3, 2, 5))),
        ):
            result = engine.generate(prompt, SamplingParams(), config)
            assert result.output_ids == hf_greedy(target, prompt, REF_TOKENS), (layers, prompt, config)
            accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_the_registry_loads_an_exit_head_directory(tmp_path: Path, saved_pairs: dict[str, Path]) -> None:
    from specserve.drafters.registry import build_drafter

    target = deep_target("qwen2")
    head = random_exit_head()
    directory = save_exit_head(tmp_path / "head", head, target, 3)
    drafter = build_drafter("layerskip:" + str(directory), target)
    assert isinstance(drafter, LayerSkipDrafter) and drafter.layers == 3 and drafter.exit_head is not None
    assert torch.equal(drafter.exit_head.down.weight, head.down.weight.float().double())
    with pytest.raises(ExitHeadError, match="not an exit head directory"):
        build_drafter("layerskip:" + str(saved_pairs["qwen2"] / "target"), target)
    # a drafter process that holds only the target's description loads its own copy of the target
    saved = CausalLM.load(saved_pairs["qwen2"] / "target", dtype="float64")
    directory = save_exit_head(tmp_path / "saved-head", random_exit_head(), saved, 1)
    remote = build_drafter("layerskip:" + str(directory), saved.describe(), dtype="float64")
    assert isinstance(remote, LayerSkipDrafter) and remote.layers == 1
    assert remote.model.model.model.layers[0] is not saved.model.model.layers[0]


def test_per_request_drafters_share_the_weights_loaded_once(
    tmp_path: Path, saved_pairs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched engine's per-request layer-skip drafters (a drafter process: the target's description only)
    load the target copy and the exit head once, and share them; each request's state is its own."""
    from specserve.drafters.registry import request_drafters

    saved = CausalLM.load(saved_pairs["qwen2"] / "target", dtype="float64")
    directory = save_exit_head(tmp_path / "head", random_exit_head(), saved, 1)
    loads = []
    load = CausalLM.load
    monkeypatch.setattr(CausalLM, "load", lambda *a, **k: loads.append(a) or load(*a, **k))
    new_drafter = request_drafters("layerskip:" + str(directory), saved.describe(), dtype="float64")
    drafters = [new_drafter("default") for _ in range(3)]
    assert len(loads) == 1
    first, *others = drafters
    assert isinstance(first, LayerSkipDrafter) and first.exit_head is not None
    for other in others:
        assert isinstance(other, LayerSkipDrafter)
        assert other.model is first.model and other.exit_head is first.exit_head
    # the same request drafted by a shared-weight drafter beside another one drafts as it would alone
    first.start([5, 6, 7, 8], SamplingParams(), torch.Generator().manual_seed(0))
    others[0].start([9, 10, 11], SamplingParams(), torch.Generator().manual_seed(0))
    alone = new_drafter("default")
    alone.start([5, 6, 7, 8], SamplingParams(), torch.Generator().manual_seed(0))
    others[0].propose(3)
    assert first.propose(3).tokens.tolist() == alone.propose(3).tokens.tolist()


def test_training_an_exit_head_brings_the_view_closer_to_the_target(tmp_path: Path) -> None:
    from specserve.training.exit_head import ExitHeadRecipe, exit_head_loss, new_exit_head, train_exit_head_on

    target = CausalLM(build_model("llama", num_layers=4, seed=5).double(), char_tokenizer(), path="<tiny-target>")
    generator = torch.Generator().manual_seed(0)
    train_stream = torch.randint(3, VOCAB, (3000,), generator=generator)
    heldout_stream = torch.randint(3, VOCAB, (600,), generator=generator)
    prompts = [[5, 6, 7, 8, 5, 6], [40, 41, 17]]
    recipe = ExitHeadRecipe(
        layers=2, steps=150, batch_size=8, seq_len=32, peak_lr=1e-2, bf16_autocast=False, checkpoint_every=50,
        report_tokens=12,
    )  # fmt: skip
    batch = heldout_stream[:66].reshape(2, 33)
    loss_fn = exit_head_loss(target.model, 2)
    untrained_loss = loss_fn(new_exit_head(target.model, recipe), batch).item()

    summary = train_exit_head_on(target, tmp_path / "head", train_stream, heldout_stream, prompts, recipe)

    out = tmp_path / "head"
    for name in ("config.json", "model.safetensors", "README.md", "training_summary.json", "checkpoints"):
        assert (out / name).exists(), name
    assert json.loads((out / "training_summary.json").read_text()) == json.loads(json.dumps(summary))
    assert "Layer-skip exit head" in (out / "README.md").read_text()
    before, after = summary["teacher_forced"]["untrained"], summary["teacher_forced"]["trained"]
    assert after["kl_nats"] < 0.8 * before["kl_nats"]
    assert after["greedy"] > before["greedy"]
    trained, layers = load_exit_head(out, target)
    assert layers == 2
    assert loss_fn(trained, batch).item() < 0.8 * untrained_loss
    report = summary["heldout_acceptance"]["trained"]["chain_gamma_3"]
    assert report["prompts"] == 2 and report["mean_accepted_length"] >= 1.0


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_sampled_self_speculation_emits_the_target_joint_law(shape: str) -> None:
    """Two tokens at T = 1 drafted by the first layer with an exit head (sampled chains with q, sampled trees
    without replacement): their joint law is the target's (chi-square, significance 1e-3, fixed seeds). 2,500 seeds as
    requests of one batched engine (where the drafter keeps a cache of its own), whose first seeds the single-request
    engine (drafting on the target's cache) emits alike."""
    target = greedy_target("llama")
    head = random_exit_head(seed=1)
    batched = BatchedEngine(target, lambda name: LayerSkipDrafter(target, 1, head), max_num_seqs=32)
    prompt = [5, 17, 23, 8, 30]
    tree = None if shape == "chain" else TreeSpec("dynamic", budget=TreeBudget(depth=3, width=3, nodes=7))
    config = GenerationConfig(max_new_tokens=2, gamma=3, tree=tree, ignore_eos=True)
    params = SamplingParams(temperature=1.0, top_k=24)
    runs = batched_runs(batched, prompt, params, config, 2500)
    assert two_token_fit([run.output_ids for run in runs], target, prompt, params) > 1e-3
    single = SpeculativeEngine(target, LayerSkipDrafter(target, 1, head))
    check_single_engine_agrees(single, runs, prompt, params, config)


@pytest.mark.parametrize("with_head", [False, True])
def test_drafting_on_the_target_cache_proposes_the_same_and_gives_it_back_untouched(with_head: bool) -> None:
    """In one process the drafter drafts on the target cache's first layers: the same proposals as with a cache
    of its own, no cache layers of its own, and the target cache exactly as it was (length and every entry)."""
    from specserve.core.target import LocalSequence

    target = greedy_target("llama")
    head = random_exit_head(seed=2) if with_head else None
    prompt = [5, 17, 23, 8, 30, 41, 9]
    sequence = LocalSequence(target)
    sequence.forward(torch.tensor(prompt[:-1]), last_only=True)  # what the engine's prefill leaves
    before = sequence.cache.snapshot()
    shared, own = LayerSkipDrafter(target, 2, head), LayerSkipDrafter(target, 2, head)
    for drafter in (shared, own):
        drafter.start(prompt, SamplingParams(), torch.Generator())
    shared.share_target_cache(sequence.cache)
    assert all(a is b for a, b in zip(shared._cache.inner.layers, sequence.cache.inner.layers[:2], strict=False))
    spec = TreeSpec("dynamic", budget=TreeBudget(3, 2, 5))
    for _ in range(2):  # twice: the second proposal starts from a cache the first gave back
        assert shared.propose(4).tokens.tolist() == own.propose(4).tokens.tolist()
        assert shared.propose_tree(spec).tokens.tolist() == own.propose_tree(spec).tokens.tolist()
        assert sequence.length == len(prompt) - 1
        for (k0, v0), (k1, v1) in zip(before, sequence.cache.snapshot(), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.parametrize("with_head", [False, True])
def test_following_the_pool_proposes_the_same_and_catches_up_by_copying(with_head: bool) -> None:
    """In a batched engine the drafter fills its own cache from the request's span of the target's pool: the same
    proposals (chains and trees) as a drafter computing its cache, the copied keys and values equal to what the view
    computes, and after tokens it did not draft after (plain cycles) its catch-up forward feeds only the last
    committed token; the span is left as it was."""
    from specserve.core.batch_step import LocalPool
    from specserve.core.kv.pool import KVPool
    from specserve.core.target import PooledSequence

    target = greedy_target("llama")
    head = random_exit_head(seed=2) if with_head else None
    context = [5, 17, 23, 8, 30, 41, 9]
    pool = KVPool(target.model, capacity=64)
    ops = LocalPool(target, pool)
    sequence = PooledSequence(ops, pool.allocate(32))
    sequence.forward(torch.tensor(context[:-1]), last_only=True)  # what the engine's prefill leaves
    following, own = LayerSkipDrafter(target, 2, head), LayerSkipDrafter(target, 2, head)
    for drafter in (following, own):
        drafter.start(context, SamplingParams(), torch.Generator())
    following.follow_target_pool(pool, sequence.seq_id)
    fed: list[int] = []
    forward = following.model.forward

    def counting(cache, input_ids, **kwargs):  # type: ignore[no-untyped-def]
        fed.append(len(input_ids))
        return forward(cache, input_ids, **kwargs)

    following.model.forward = counting  # type: ignore[method-assign]
    spec = TreeSpec("dynamic", budget=TreeBudget(3, 2, 5))
    for plain_cycles in (0, 3):
        for _ in range(plain_cycles):  # the target commits a token; the drafter does not draft after it
            token = int(target.forward(target.new_cache(), torch.tensor(context), last_only=True)[-1].argmax())
            sequence.forward(torch.tensor(context[-1:]), last_only=True)
            context.append(token)
            for drafter in (following, own):
                drafter.accept([token])
        fed.clear()
        assert following.propose(4).tokens.tolist() == own.propose(4).tokens.tolist()
        assert fed[0] == 1  # the last committed token only: the rest was copied
        assert following.propose_tree(spec).tokens.tolist() == own.propose_tree(spec).tokens.tolist()
        assert sequence.length == len(context) - 1
    (keys, values), *_ = pool.read(sequence.seq_id, 2, 0, len(context) - 1)
    computed = following.model.new_cache()
    forward(computed, torch.tensor(context[:-1]), last_only=True)
    own_keys, own_values = computed.snapshot()[0]
    torch.testing.assert_close(following._cache.snapshot()[0][0][:, :, : len(context) - 1], own_keys)
    torch.testing.assert_close(keys, own_keys)
    torch.testing.assert_close(values, own_values)


def test_a_pool_it_cannot_read_is_not_followed() -> None:
    """A pool whose first layers keep latents (multi-head latent attention) cannot be copied from: the drafter
    computes its own cache, and reading it is refused in one line."""
    from specserve.core.kv.pool import KVPool

    target = greedy_target("llama")
    pool = KVPool(target.model, capacity=16)
    sequence = pool.allocate(8)
    with pytest.raises(ValueError, match=r"cannot read positions 0\.\.3"):
        pool.read(sequence, 1, 0, 3)
    pool.gathers = True
    drafter = LayerSkipDrafter(target, 2)
    drafter.start([1, 2, 3], SamplingParams(), torch.Generator())
    drafter.follow_target_pool(pool, sequence)
    assert drafter._pool is None
    with pytest.raises(ValueError, match="do not all keep plain keys and values"):
        pool.read(sequence, 1, 0, 0)
