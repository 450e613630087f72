"""OpenAI semantics over a runner, checked with the in-process engine on the tiny models (no HTTP, no Ray)."""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import pytest
from conftest import TinyPair

from specserve.core.engine import SpeculativeEngine
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set
from specserve.serve.config import ServeConfig
from specserve.serve.errors import RequestError
from specserve.serve.openai_api import OpenAIHandler, plain_chat_prompt
from specserve.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from specserve.serve.speculation_schema import ChainTree, DynamicTree, SpeculationOptions, StaticTree

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
        "prompt_tokens_details": {"cached_tokens": 0},  # the single-request engine has no prefix cache
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


def test_a_deployment_may_sample_drafter_invariantly_by_default(pair: TinyPair) -> None:
    """``drafter_invariant: true`` in the deployment: a sampled request that says nothing samples invariantly (so a
    shadow check can reproduce it), one that says false does not, and typical acceptance keeps its lossy rule."""
    api = Api(pair)
    api.handler = OpenAIHandler(api.runner.prompts, CONFIG.model_copy(update={"drafter_invariant": True}))
    base: dict[str, Any] = {"model": "tiny", "prompt": "abcab", "temperature": 1.0, "seed": 5, "max_tokens": 6}

    def sampling(speculation: dict[str, Any]) -> str:
        answer = api.completion(CompletionRequest(**base, speculation=speculation))
        return str(answer["speculation"]["sampling"])

    assert sampling({}) == "drafter_invariant"
    assert sampling({"drafter_invariant": False}) == "rejection"
    typical = {"acceptance": "typical", "lossy": True}
    assert CompletionRequest(**base, speculation=typical).sampling(True).lossy_acceptance
    assert not CompletionRequest(**base, speculation=typical).sampling(True).drafter_invariant


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


# Logprobs, penalties, n and best_of ----------------------------------------------------------------


def test_completion_logprobs_are_the_engines_in_the_api_shape(handler: Api) -> None:
    request = {"model": "tiny", "prompt": "hello wor", "temperature": 0, "max_tokens": 10, "logprobs": 2}
    answer = handler.completion(CompletionRequest(**request))
    want = handler.runner.generate("hello wor", SamplingParams(logprobs=2), GenerationConfig(10, 3))
    assert want.logprobs is not None
    logprobs = answer["choices"][0]["logprobs"]
    decode = handler.handler.token_text
    assert logprobs["tokens"] == [decode(entry.token) for entry in want.logprobs]
    assert logprobs["token_logprobs"] == [entry.logprob for entry in want.logprobs]
    assert logprobs["top_logprobs"] == [{decode(t): v for t, v in entry.top} for entry in want.logprobs]
    ends = [offset + len(token) for offset, token in zip(logprobs["text_offset"], logprobs["tokens"], strict=True)]
    assert logprobs["text_offset"] == [0, *ends[:-1]]
    streamed = events(handler.completion(CompletionRequest(**request, stream=True)))
    merged = {key: [v for c in streamed if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][key]]
              for key in logprobs}  # fmt: skip
    assert merged == logprobs


def test_chat_logprobs_carry_tokens_bytes_and_alternatives(handler: Api) -> None:
    messages = [ChatMessage(role="user", content="hi")]
    request = ChatCompletionRequest(
        model="tiny", messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    answer = handler.chat(request)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 3
        assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"]  # greedy: the top
    plain = handler.chat(ChatCompletionRequest(model="tiny", messages=messages, temperature=0, max_tokens=6))
    assert "logprobs" not in plain["choices"][0]
    chunks = events(handler.chat(request.model_copy(update={"stream": True})))
    assert [e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get("content", [])] == content


def test_penalties_and_biases_are_the_engines(handler: Api) -> None:
    fields = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {"70": 3.0}, "repetition_penalty": 1.3}
    answer = handler.completion(CompletionRequest(model="tiny", prompt="abcab", temperature=0, max_tokens=12, **fields))
    params = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={70: 3.0}, repetition_penalty=1.3)
    want = handler.runner.generate("abcab", params, GenerationConfig(max_new_tokens=12, gamma=3))
    assert answer["choices"][0]["text"] == want.text
    with pytest.raises(RequestError) as info:
        handler.completion(CompletionRequest(model="tiny", prompt="x", logit_bias={"96": 1.0}))
    assert (
        info.value.status == 400 and info.value.param == "logit_bias" and "outside the vocabulary" in info.value.message
    )


def test_n_choices_have_their_own_seeds_and_usage_counts_them_all(handler: Api) -> None:
    request = {"model": "tiny", "prompt": "abcab", "temperature": 1.0, "seed": 11, "max_tokens": 8}
    answer = handler.completion(CompletionRequest(**request, n=3))
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    one = handler.completion(CompletionRequest(**request))
    assert answer["choices"][0]["text"] == one["choices"][0]["text"]  # choice 0 keeps the request's seed
    texts = {c["text"] for c in answer["choices"]}
    assert len(texts) > 1, "three samples at T = 1 should not all be equal"
    lengths = [len(handler.runner.prompts.encode(c["text"])) for c in answer["choices"]]
    assert answer["usage"]["completion_tokens"] >= sum(lengths)
    assert answer["speculation"]["cycles"] > one["speculation"]["cycles"]
    streamed = events(handler.completion(CompletionRequest(**request, n=3, stream=True)))
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == answer["usage"]
    for index in range(3):
        text = "".join(c["choices"][0]["text"] for c in streamed[:-1] if c["choices"][0]["index"] == index)
        assert text == answer["choices"][index]["text"]


def test_best_of_keeps_the_likeliest_per_token(handler: Api) -> None:
    request = {"model": "tiny", "prompt": "abcab", "temperature": 1.0, "seed": 4, "max_tokens": 8}
    answer = handler.completion(CompletionRequest(**request, best_of=4))
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None  # not asked for
    candidates = handler.completion(CompletionRequest(**request, n=4, logprobs=0))
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in candidates["choices"]]
    best = max(range(4), key=lambda i: means[i])
    assert answer["choices"][0]["text"] == candidates["choices"][best]["text"]
    assert answer["usage"] == candidates["usage"]


def test_structured_outputs_choice_and_regex(handler: Api) -> None:
    choices = ["alpha", "beta gamma", "delta"]
    answer = handler.chat(
        ChatCompletionRequest(
            model="tiny",
            messages=[ChatMessage(role="user", content="pick")],
            temperature=0,
            max_tokens=20,
            structured_outputs={"choice": choices},  # type: ignore[arg-type]
        )
    )
    assert answer["choices"][0]["message"]["content"] in choices and answer["choices"][0]["finish_reason"] == "stop"
    request = {"model": "tiny", "prompt": "abcab", "temperature": 0, "max_tokens": 20}
    regex = {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}}
    whole = handler.completion(CompletionRequest(**request, **regex))
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", whole["choices"][0]["text"])
    streamed = events(handler.completion(CompletionRequest(**request, **regex, stream=True)))
    assert "".join(c["choices"][0]["text"] for c in streamed) == whole["choices"][0]["text"]
    with pytest.raises(RequestError) as info:
        handler.completion(CompletionRequest(**request, structured_outputs={"regex": "[0-"}))  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "structured_outputs"
    assert "the regex grammar is not valid" in info.value.message
    with pytest.raises(RequestError) as info:
        handler.completion(CompletionRequest(**request, **regex, ignore_eos=True))
    assert info.value.param == "structured_outputs" and "ignore_eos" in info.value.message


@pytest.mark.parametrize(
    "grammar", [{"regex": "a{1000000}"}, {"grammar": "start: /a{1000000}/"}], ids=["regex", "lark"]
)
def test_a_grammar_that_compiles_but_cannot_run_is_a_400_before_it_reaches_a_batch(
    handler: Api, grammar: dict[str, str]
) -> None:
    """llguidance compiles these and then gives up at their first tokens ("too many expressions constructed"): the
    edge runs every new grammar a few tokens ahead, so the client hears it at once, naming the field."""
    kind = "regex" if "regex" in grammar else "lark"
    completion = CompletionRequest(model="tiny", prompt="ab", max_tokens=8, structured_outputs=grammar)  # type: ignore[arg-type]
    chat = ChatCompletionRequest(
        model="tiny",
        messages=[ChatMessage(role="user", content="a")],
        max_tokens=8,
        structured_outputs=grammar,  # type: ignore[arg-type]
    )
    for call, body in ((handler.completion, completion), (handler.chat, chat)):
        with pytest.raises(RequestError) as info:
            call(body)  # type: ignore[operator]
        assert info.value.status == 400 and info.value.param == "structured_outputs"
        assert f"the {kind} grammar cannot run" in info.value.message
        assert "too many expressions constructed" in info.value.message and "simplify" in info.value.message
