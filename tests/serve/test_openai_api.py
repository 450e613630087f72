"""OpenAI semantics over a runner, checked with the in-process engine on the tiny models (no HTTP, no Ray)."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
from conftest import TinyPair

from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.prompts import PromptCodec
from specserve.core.sampling import SamplingParams
from specserve.drafters.registry import build_drafter_set
from specserve.serve.config import ServeConfig
from specserve.serve.openai_api import OpenAIHandler, plain_chat_prompt
from specserve.serve.schemas import (
    ChainTree,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DynamicTree,
    RequestError,
    SpeculationOptions,
    StaticTree,
)

TREE_OPTIONS = (ChainTree, DynamicTree, StaticTree)
CONFIG = ServeConfig(model_name="tiny", gamma=3, default_max_tokens=16)


class Api:
    """The handler driven synchronously over the in-process engine."""

    def __init__(self, pair: TinyPair) -> None:
        self.runner = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
        self.handler = OpenAIHandler(self.runner.prompts, CONFIG)

    def completion(self, request: CompletionRequest) -> Any:
        return self.handler.run(self.runner, request)

    def chat(self, request: ChatCompletionRequest) -> Any:
        return self.handler.run(self.runner, request)

    def models(self) -> dict[str, Any]:
        return self.handler.models()


@pytest.fixture()
def handler(pair: TinyPair) -> Api:
    return Api(pair)


def events(stream: Any) -> list[dict[str, Any]]:
    lines = list(stream)
    assert lines[-1] == "data: [DONE]\n\n"
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_completion_equals_the_engine(handler: Api, pair: TinyPair) -> None:
    answer = handler.completion(CompletionRequest(model="tiny", prompt="abcab", temperature=0, max_tokens=12))
    assert isinstance(answer, dict)
    want = handler.runner.generate("abcab", SamplingParams(), GenerationConfig(max_new_tokens=12, gamma=3))
    choice = answer["choices"][0]
    assert choice["text"] == want.text and answer["object"] == "text_completion"
    assert choice["finish_reason"] == {"eos": "stop", "length": "length"}[want.finish_reason]
    assert answer["usage"] == {
        "prompt_tokens": len(want.prompt_ids),
        "completion_tokens": len(want.output_ids),
        "total_tokens": len(want.prompt_ids) + len(want.output_ids),
    }
    spec = answer["speculation"]
    assert spec["drafted_tokens"] > 0 and spec["mean_accepted_length"] >= 1 and spec["lossy"] is False


def test_streamed_text_equals_the_whole_answer(handler: Api) -> None:
    request = {"model": "tiny", "prompt": "hello wor", "temperature": 0, "max_tokens": 14}
    whole = handler.completion(CompletionRequest(**request))
    assert isinstance(whole, dict)
    chunks = events(handler.completion(CompletionRequest(**request, stream=True)))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_uses_the_plain_template(handler: Api) -> None:
    messages = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    answer = handler.chat(ChatCompletionRequest(model="tiny", messages=messages, temperature=0, max_tokens=10))
    assert isinstance(answer, dict) and answer["object"] == "chat.completion"
    want = handler.runner.generate(plain_chat_prompt(messages), SamplingParams(), GenerationConfig(10, 3))
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    chunks = events(
        handler.chat(ChatCompletionRequest(model="tiny", messages=messages, temperature=0, max_tokens=10, stream=True))
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == want.text


def test_speculation_off_gives_the_same_text(handler: Api) -> None:
    on = handler.completion(CompletionRequest(model="tiny", prompt="xyzxyz", temperature=0, max_tokens=12))
    off = handler.completion(
        CompletionRequest(model="tiny", prompt="xyzxyz", temperature=0, max_tokens=12, speculation={"enabled": False})
    )
    assert isinstance(on, dict) and isinstance(off, dict)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert off["speculation"]["drafted_tokens"] == 0


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_chosen_drafter_gives_the_same_text(handler: Api, drafter: str) -> None:
    prompt = "xyzxyzxyz"
    default = handler.completion(CompletionRequest(model="tiny", prompt=prompt, temperature=0, max_tokens=12))
    chosen = handler.completion(
        CompletionRequest(model="tiny", prompt=prompt, temperature=0, max_tokens=12, speculation={"drafter": drafter})
    )
    assert isinstance(default, dict) and isinstance(chosen, dict)
    assert chosen["choices"][0]["text"] == default["choices"][0]["text"]
    assert (chosen["speculation"]["drafted_tokens"] > 0) == (drafter == "ngram")


TREES: list[dict[str, Any]] = [
    {"kind": "dynamic", "depth": 3, "width": 2, "nodes": 5},
    {"kind": "static", "paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]},
]


def test_trees_give_the_chain_text_and_report_their_shapes(handler: Api) -> None:
    prompt = "xyzxyzxyz"
    chain = handler.completion(CompletionRequest(model="tiny", prompt=prompt, temperature=0, max_tokens=12))
    assert isinstance(chain, dict)
    assert chain["speculation"]["tree_shapes"] == [] and chain["speculation"]["sampling"] == "greedy"
    for tree in TREES:
        request = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "speculation": {"tree": tree}}
        answer = handler.completion(CompletionRequest(**request))
        assert isinstance(answer, dict) and answer["choices"][0]["text"] == chain["choices"][0]["text"], tree
        spec = answer["speculation"]
        shapes = spec["tree_shapes"]
        assert len(shapes) == spec["cycles"] > 0 and sum(nodes for nodes, _ in shapes) == spec["drafted_tokens"]
        assert all(nodes <= 5 and depth <= 3 for nodes, depth in shapes), shapes
        streamed = events(handler.completion(CompletionRequest(**request, stream=True)))
        assert streamed[-1]["speculation"]["tree_shapes"] == shapes  # the last event carries the summary too


def test_drafter_invariant_output_is_the_same_for_every_drafter(handler: Api) -> None:
    def sampled(speculation: dict[str, Any]) -> dict[str, Any]:
        request = CompletionRequest(
            model="tiny", prompt="abcab", temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
            speculation={**speculation, "drafter_invariant": True},
        )  # fmt: skip
        answer = handler.completion(request)
        assert isinstance(answer, dict) and answer["speculation"]["sampling"] == "drafter_invariant"
        return answer

    first = sampled({"gamma": 2})
    want = first["choices"][0]["text"]
    accepted = first["speculation"]["accepted_tokens"]
    for speculation in ({"gamma": 6}, {"drafter": "ngram"}, {"drafter": "none"}, {"tree": TREES[0]}):
        answer = sampled(speculation)
        assert answer["choices"][0]["text"] == want, speculation
        accepted += answer["speculation"]["accepted_tokens"]
    assert accepted > 0  # drafts were accepted: the equality is not that of plain decoding runs only
    plain = handler.completion(CompletionRequest(model="tiny", prompt="abcab", temperature=1.0, seed=5, max_tokens=4))
    assert isinstance(plain, dict) and plain["speculation"]["sampling"] == "rejection"


def test_refusals(handler: Api) -> None:
    with pytest.raises(RequestError) as info:
        handler.completion(CompletionRequest(model="gpt-4", prompt="x"))
    assert info.value.status == 404 and "tiny" in info.value.message
    with pytest.raises(RequestError) as info:
        handler.completion(CompletionRequest(model="tiny", prompt="x", max_tokens=10_000))
    assert info.value.status == 400 and info.value.param == "max_tokens" and "context" in info.value.message
    assert "max_tokens (10000)" in info.value.message and "max_new_tokens" not in info.value.message


def test_models_says_when_the_deployment_started(handler: Api) -> None:
    (model,) = handler.models()["data"]
    assert model["id"] == "tiny" and 0 < model["created"] <= time.time()  # default: when the handler was made
    started = OpenAIHandler(handler.runner.prompts, CONFIG, created=1_700_000_000)
    assert started.models()["data"][0]["created"] == 1_700_000_000


def test_chat_uses_the_tokenizers_own_template(handler: Api) -> None:
    tokenizer = copy.deepcopy(handler.runner.prompts.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    own = OpenAIHandler(PromptCodec(handler.runner.prompts.info, tokenizer), CONFIG)
    messages = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    assert own.chat_prompt(messages) == "[system]be brief[user]hi>"
    prepared = own.prepare(ChatCompletionRequest(model="tiny", messages=messages, max_tokens=4))
    assert prepared.prompt_ids == handler.runner.prompts.encode("[system]be brief[user]hi>")


def test_every_request_field_is_documented() -> None:
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, SpeculationOptions, *TREE_OPTIONS):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"
