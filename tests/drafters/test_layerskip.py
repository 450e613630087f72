"""Layer-skip self-speculation: the early-exit view shares the target's weights, computes what a shallow copy
of the target computes, and speculative decoding with it stays exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import REF_TOKENS, TinyPair, build_model

from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model import CausalLM
from specserve.core.sampling import SamplingParams
from specserve.core.tree import TreeBudget, TreeSpec
from specserve.drafters.layerskip import LayerSkipDrafter, early_exit_model

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]


def deep_target(family: str) -> CausalLM:
    return CausalLM(build_model(family, num_layers=4, seed=3).double())


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
    target = CausalLM(build_model(pair.family, num_layers=4, seed=5).double())
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
