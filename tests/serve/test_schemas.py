"""Request validation at the HTTP edge: every malformed body gets an OpenAI-style 4xx saying what to fix."""

from __future__ import annotations

import json
import typing

import pytest
import yaml
from pydantic import ValidationError

from specserve.core.draft.drafter import REQUEST_DRAFTERS
from specserve.core.model.causal_lm import ModelInfo
from specserve.core.prompts import PromptCodec
from specserve.core.sampling.params import MAX_TOP_K, GrammarSpec
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.serve.config import API_KEY_ENV, ServeConfig
from specserve.serve.errors import RequestError
from specserve.serve.openai_api import OpenAIHandler
from specserve.serve.schemas import (
    GREEDY_BELOW,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    NO_OP_VALUES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    parse_request,
)
from specserve.serve.speculation_schema import (
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    MAX_TREE_WIDTH,
    ChainTree,
    DynamicTree,
    SpeculationOptions,
    StaticTree,
)

LIMIT = 4096


def parse(body: dict[str, object] | bytes, kind: type = CompletionRequest) -> object:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(kind, data, LIMIT)


def refused(body: dict[str, object] | bytes, kind: type = CompletionRequest) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body, kind)
    error = info.value
    assert 400 <= error.status < 500
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    return error


GOOD = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"best_of": 1, "n": 2}, "best_of", "best_of (1) must be at least n (2)"),
        ({"best_of": 3, "stream": True}, "best_of", "best_of > n cannot stream"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"logprobs": True}, "logprobs", "true names none"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids written as strings of digits"),
        ({"logit_bias": {"7": 101}}, "logit_bias", "biases must be in [-100, 100], got 101.0 for 7"),
        ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias", "a token id is named twice"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"logprobs_mode": "logits"}, "logprobs_mode", "'raw' or 'processed'"),
        ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": "many"}, "max_tokens", "integer"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"speculation": {"gamma": 0}}, "speculation.gamma", "greater than or equal to 1"),
        ({"speculation": {"gama": 3}}, "speculation.gama", "unknown field"),
        ({"speculation": {"drafter": "eagle"}}, "speculation.drafter", "'suffix', 'lookahead' or 'none'"),
        ({"speculation": {"drafter": "models/draft"}}, "speculation.drafter", "'suffix', 'lookahead' or 'none'"),
    ],
)
def test_bad_fields_name_the_field(change: dict[str, object], param: str, words: str) -> None:
    error = refused({**GOOD, **change})
    assert error.status == 400 and error.param == param and words in error.message
    assert "Value error" not in error.message, error.message  # pydantic's prefix is not the client's business


def test_missing_fields_and_bad_json() -> None:
    assert refused({"model": "m"}).param == "prompt"
    assert refused({"prompt": "x"}).param == "model"
    assert refused({"model": "m", "messages": []}, ChatCompletionRequest).param == "messages"
    assert refused({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, ChatCompletionRequest).status == 400
    error = refused(b'{"model": "m", "prompt": ')
    assert error.code == "invalid_json" and "not valid JSON" in error.message


def test_oversize_body_is_413() -> None:
    error = refused({**GOOD, "prompt": "x" * (2 * LIMIT)})
    assert error.status == 413 and "exceeds" in error.message


def test_defaults_and_translation() -> None:
    request = parse({**GOOD, "temperature": 0, "stop": "\n\n", "user": "ignored-by-us"})
    assert isinstance(request, CompletionRequest)
    params = request.sampling()
    assert params.greedy
    config = request.generation(default_max_tokens=64, default_gamma=3)
    assert (config.max_new_tokens, config.gamma, config.stop) == (64, 3, ("\n\n",))
    off = parse({**GOOD, "max_tokens": 5, "speculation": {"enabled": False, "gamma": 7}})
    assert isinstance(off, CompletionRequest)
    assert off.generation(64, 3).gamma == 0 and off.generation(64, 3).max_new_tokens == 5
    on = parse({**GOOD, "speculation": {"gamma": 7}})
    assert isinstance(on, CompletionRequest) and on.generation(64, 3).gamma == 7


def test_a_request_without_a_policy_takes_the_deployments() -> None:
    default = parse(GOOD)
    assert isinstance(default, CompletionRequest)
    assert default.generation(64, 3).policy == "fixed"  # the library's default
    assert default.generation(64, 3, default_policy="adaptive").policy == "adaptive"
    own = parse({**GOOD, "speculation": {"policy": "heuristic"}})
    assert isinstance(own, CompletionRequest) and own.generation(64, 3, default_policy="adaptive").policy == "heuristic"
    off = parse({**GOOD, "speculation": {"enabled": False}})
    assert isinstance(off, CompletionRequest) and off.generation(64, 3, default_policy="adaptive").policy == "fixed"


def test_drafter_choice_maps_to_the_generation_config() -> None:
    field = SpeculationOptions.model_fields["drafter"]
    assert typing.get_args(field.annotation) == REQUEST_DRAFTERS and field.description
    default = parse(GOOD)
    assert isinstance(default, CompletionRequest) and default.generation(64, 3).drafter == "default"
    for name in REQUEST_DRAFTERS:
        request = parse({**GOOD, "speculation": {"drafter": name, "gamma": 5}})
        assert isinstance(request, CompletionRequest)
        config = request.generation(64, 3)
        assert (config.drafter, config.gamma) == (name, 5)
    off = parse({**GOOD, "speculation": {"enabled": False, "drafter": "ngram"}})
    assert isinstance(off, CompletionRequest) and off.generation(64, 3).gamma == 0
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "speculation": {"drafter": "none"}},
                 ChatCompletionRequest)  # fmt: skip
    assert isinstance(chat, ChatCompletionRequest) and chat.generation(64, 3).drafter == "none"


@pytest.mark.parametrize(
    ("tree", "want"),
    [
        (None, None),
        ({"kind": "chain"}, None),
        ({"kind": "dynamic"}, TreeSpec("dynamic", budget=TreeBudget(4, 2, 8))),
        (
            {"kind": "dynamic", "depth": MAX_TREE_DEPTH, "width": MAX_TREE_WIDTH, "nodes": MAX_TREE_NODES},
            TreeSpec("dynamic", budget=TreeBudget(MAX_TREE_DEPTH, MAX_TREE_WIDTH, MAX_TREE_NODES)),
        ),
        (
            {"kind": "static", "paths": [[0], [1], [0, 0]]},
            TreeSpec("static", topology=TreeTopology(((0,), (1,), (0, 0)))),
        ),
    ],
)
def test_tree_maps_to_the_tree_spec(tree: dict[str, object] | None, want: TreeSpec | None) -> None:
    speculation = {"gamma": 5} if tree is None else {"gamma": 5, "tree": tree}
    request = parse({**GOOD, "speculation": speculation})
    assert isinstance(request, CompletionRequest)
    config = request.generation(64, 3)
    assert config.tree == want and config.gamma == 5
    off = parse({**GOOD, "speculation": {**speculation, "enabled": False}})
    assert isinstance(off, CompletionRequest)
    assert off.generation(64, 3).tree is None and off.generation(64, 3).gamma == 0  # no drafting: no tree


LE = "Input should be less than or equal to"
TOO_DEEP = [[0] * (MAX_TREE_DEPTH + 1)]


@pytest.mark.parametrize(
    ("tree", "words"),
    [
        ({"kind": "eagle"}, "kind: Input should be 'chain', 'dynamic' or 'static'"),
        ({"depth": 3}, "kind: Input should be 'chain', 'dynamic' or 'static'"),
        ("dynamic", "valid dictionary"),
        ({"kind": "dynamic", "depth": 0}, "depth: Input should be greater than or equal to 1"),
        ({"kind": "dynamic", "depth": MAX_TREE_DEPTH + 1}, f"depth: {LE} {MAX_TREE_DEPTH}"),
        ({"kind": "dynamic", "width": MAX_TREE_WIDTH + 1}, f"width: {LE} {MAX_TREE_WIDTH}"),
        ({"kind": "dynamic", "nodes": MAX_TREE_NODES + 1}, f"nodes: {LE} {MAX_TREE_NODES}"),
        ({"kind": "chain", "depth": 3}, "depth: unknown field"),
        ({"kind": "static"}, "paths: Field required"),
        ({"kind": "static", "paths": []}, "paths: List should have at least 1 item"),
        ({"kind": "static", "paths": [[0], [0, 1, 0]]}, "paths: topology path (0, 1, 0) has no parent path (0, 1)"),
        ({"kind": "static", "paths": [[0], [0]]}, "paths: topology lists a path twice"),
        ({"kind": "static", "paths": [0, 1]}, "paths.0: Input should be a valid list"),
        ({"kind": "static", "paths": "[[0]]"}, "paths: Input should be a valid list"),
        ({"kind": "static", "paths": [[0], []]}, "paths.1: List should have at least 1 item"),
        ({"kind": "static", "paths": [[-1]]}, "paths.0.0: Input should be greater than or equal to 0"),
        ({"kind": "static", "paths": TOO_DEEP}, f"paths.0: List should have at most {MAX_TREE_DEPTH} "),
        ({"kind": "static", "paths": [[k] for k in range(MAX_TREE_NODES + 1)]}, "paths: List should have at most"),
    ],
)  # fmt: skip
def test_bad_trees_are_refused_at_speculation_tree(tree: object, words: str) -> None:
    error = refused({**GOOD, "speculation": {"tree": tree}})
    assert error.status == 400 and error.param == "speculation.tree" and error.code == "invalid_value"
    assert error.message.startswith("speculation.tree: ") and words in error.message, error.message


def test_drafter_invariant_maps_to_the_sampling_params() -> None:
    default = parse(GOOD)
    assert isinstance(default, CompletionRequest) and default.sampling().drafter_invariant is False
    request = parse({**GOOD, "temperature": 0.7, "seed": 3, "speculation": {"drafter_invariant": True}})
    assert isinstance(request, CompletionRequest)
    params = request.sampling()
    assert params.drafter_invariant and params.invariant_sampling and params.seed == 3
    greedy = parse({**GOOD, "temperature": 0, "speculation": {"drafter_invariant": True}})
    assert isinstance(greedy, CompletionRequest) and not greedy.sampling().invariant_sampling  # no effect when greedy
    error = refused({**GOOD, "speculation": {"drafter_invariant": "yes please"}})
    assert error.param == "speculation.drafter_invariant" and "valid boolean" in error.message


def test_tree_options_are_documented() -> None:
    for model in (ChainTree, DynamicTree, StaticTree):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_config_yaml_round_trip_and_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ServeConfig(model_name="x", draft="ngram", tp_degree=2, drafter_placement="separate", overlap=True)
    again = ServeConfig.model_validate(yaml.safe_load(yaml.safe_dump(config.model_dump())))
    assert again == config
    replica = again.replica()
    assert (replica.tp_degree, replica.drafter_placement, replica.overlap, replica.draft) == (
        2,
        "separate",
        True,
        "ngram",
    )
    assert all(field.description for field in ServeConfig.model_fields.values())
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config.resolved_api_key() is None
    monkeypatch.setenv(API_KEY_ENV, "sekrit")
    assert config.resolved_api_key() == "sekrit"
    assert ServeConfig(api_key="file-key").resolved_api_key() == "file-key"
    with pytest.raises(ValueError, match="tp_degree"):
        ServeConfig(tp_degree=0)
    with pytest.raises(ValueError, match="Extra inputs"):
        ServeConfig.model_validate({"tp": 2})


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "adaptive"])
def test_policy_maps_to_the_generation_config(policy: str) -> None:
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "speculation": {"policy": policy, "gamma": 5}}
    )
    config = request.generation(default_max_tokens=8, default_gamma=3)
    assert config.policy == policy and config.gamma == 5
    off = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "speculation": {"policy": policy, "enabled": False}}
    )
    assert off.generation(8, 3).policy == "fixed" and off.generation(8, 3).gamma == 0
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculation": {"policy": "sometimes"}})


def test_engine_errors_are_worded_as_the_client_sent_the_request() -> None:
    from specserve.core.errors import UserError

    error = RequestError.from_user_error(UserError("prompt (3 tokens) + max_new_tokens (9) exceed 10"), param="x")
    assert error.message == "prompt (3 tokens) + max_tokens (9) exceed 10" and error.status == 400
    assert refused({**GOOD, "prompt": ""}).message == "prompt: the prompt is empty; send at least one character"


# ---------------------------------------------------------------------------------------------
# Issue 17: strict, bounded bodies. First the operator's probe, one regression test per finding.

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_probe_seed_of_2_to_the_63_is_a_400_not_a_500() -> None:
    error = refused({**GOOD, "seed": 2**63})
    assert error.status == 400 and error.param == "seed" and "less than 9223372036854775808" in error.message
    last = parse({**GOOD, "seed": 2**63 - 1})
    assert isinstance(last, CompletionRequest) and last.sampling().seed == 2**63 - 1
    assert refused({**GOOD, "seed": 10**400}).param == "seed"  # arbitrarily large JSON integers too
    assert refused({**GOOD, "seed": -1}).param == "seed"


def test_probe_top_k_above_max_top_k_is_a_400_and_beyond_the_vocabulary_truncates_nothing() -> None:
    error = refused({**GOOD, "top_k": MAX_TOP_K + 1})  # 1048577, the probe's value
    assert error.status == 400 and error.param == "top_k" and f"less than or equal to {MAX_TOP_K}" in error.message
    for top_k in (MAX_TOP_K, 1000):  # beyond any test vocabulary: accepted, and warp_probs keeps every token
        request = parse({**GOOD, "top_k": top_k})
        assert isinstance(request, CompletionRequest) and request.sampling().top_k == top_k
    off = parse({**GOOD, "top_k": -1})  # vLLM's "off"
    assert isinstance(off, CompletionRequest) and off.sampling().top_k == 0
    assert refused({**GOOD, "top_k": -2}).param == "top_k"


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, GREEDY_BELOW / 2])
def test_probe_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    request = parse({**GOOD, "temperature": temperature})
    assert isinstance(request, CompletionRequest)
    params = request.sampling()
    assert params.greedy and params.mode == "greedy" and params.temperature == 0.0


def test_the_temperature_floor_itself_samples() -> None:
    request = parse({**GOOD, "temperature": GREEDY_BELOW})
    assert isinstance(request, CompletionRequest)
    assert request.sampling().temperature == GREEDY_BELOW and not request.sampling().greedy
    assert refused({**GOOD, "temperature": 100.5}).param == "temperature"


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"temperature": True}, "temperature", "valid number"),
        ({"max_tokens": "16"}, "max_tokens", "valid integer"),
        ({"speculation": {"enabled": "no"}}, "speculation.enabled", "valid boolean"),
    ],
)
def test_probe_wrong_json_types_are_refused_not_coerced(change: dict[str, object], param: str, words: str) -> None:
    error = refused({**GOOD, **change})
    assert error.status == 400 and error.param == param and words in error.message, error.message


# Strict types ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"top_k": 5.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": 3.0}, "seed"),
        ({"seed": "3"}, "seed"),
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 1.0}, "n"),
        ({"n": True}, "n"),
        ({"stream": "true"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"ignore_eos": 0}, "ignore_eos"),
        ({"model": 5}, "model"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [1, 2.0]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"stop": 5}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"speculation": {"gamma": "3"}}, "speculation.gamma"),
        ({"speculation": {"gamma": 3.0}}, "speculation.gamma"),
        ({"speculation": {"drafter_invariant": 1}}, "speculation.drafter_invariant"),
        ({"speculation": {"typical_epsilon": "0.1"}}, "speculation.typical_epsilon"),
        ({"speculation": {"tree": {"kind": "dynamic", "depth": True}}}, "speculation.tree"),
        ({"speculation": "on"}, "speculation"),
    ],
)
def test_types_are_json_s_own(change: dict[str, object], param: str) -> None:
    error = refused({**GOOD, **change})
    assert error.status == 400 and error.param == param, error.message
    assert error.message.startswith(f"{param}: ")


def test_integers_are_numbers() -> None:
    request = parse({**GOOD, "temperature": 1, "top_p": 1, "speculation": {"typical_delta": 1}})
    assert isinstance(request, CompletionRequest) and request.temperature == 1.0 and request.top_p == 1.0


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", str(10**400).encode()])
def test_numbers_are_finite(literal: bytes) -> None:
    for field in (b"temperature", b"top_p"):
        error = refused(b'{"model": "m", "prompt": "x", "' + field + b'": ' + literal + b"}")
        assert error.param == field.decode(), error.message


@pytest.mark.parametrize("body", [b"[]", b"null", b"1", b'"text"', b"true"])
def test_the_body_is_a_json_object(body: bytes) -> None:
    error = refused(body)
    assert error.param is None and error.message == "the request body must be a JSON object"


@pytest.mark.parametrize("body", [b"", b"\xff\xfe", b"{" * 10_000, b"[" * 3000 + b"]" * 3000, b'{"model": "m",}'])
def test_junk_bodies_are_invalid_json(body: bytes) -> None:
    error = refused(body) if len(body) <= LIMIT else refused_big(body)
    assert error.code == "invalid_json" and error.param is None


def refused_big(body: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(CompletionRequest, body, len(body))
    return info.value


# Bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"max_tokens": MAX_TOKENS + 1}, "max_tokens", f"less than or equal to {MAX_TOKENS}"),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature", "less than or equal to 100"),
        ({"top_p": -1e-300}, "top_p", "greater than 0"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 10**30}, "n", "less than or equal to 16"),
        ({"stop": ""}, "stop", "non-empty"),
        ({"stop": ["a", ""]}, "stop", "non-empty"),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", f"at most {MAX_STOP_CHARS} characters"),
        ({"model": ""}, "model", "at least 1 character"),
        ({"model": "m" * 257}, "model", "at most 256 characters"),
        ({"user": "u" * 257}, "user", "at most 256 characters"),
        ({"speculation": {"gamma": 65}}, "speculation.gamma", "less than or equal to 64"),
        ({"speculation": {"gamma": -(2**70)}}, "speculation.gamma", "greater than or equal to 1"),
        ({"speculation": {"typical_epsilon": 1}}, "speculation.typical_epsilon", "less than 1"),
        ({"speculation": {"typical_delta": 0}}, "speculation.typical_delta", "greater than 0"),
        ({"speculation": {"tree": {"kind": "dynamic", "expand": 9}}}, "speculation.tree", "less than or equal to 8"),
    ],
)
def test_every_number_is_bounded(change: dict[str, object], param: str, words: str) -> None:
    error = refused({**GOOD, **change})
    assert error.status == 400 and error.param == param and words in error.message, error.message


def test_stop_strings_at_the_bounds_are_accepted() -> None:
    stops = ["x" * MAX_STOP_CHARS] * 4
    request = parse({**GOOD, "stop": stops})
    assert isinstance(request, CompletionRequest) and request.stop_strings() == tuple(stops)


def test_engine_checks_that_still_fail_are_a_400_from_prepare() -> None:
    """Defence in depth: a request the schema let through but the engine refuses is the client's 400, never a 500."""
    info = ModelInfo(path="<none>", vocab_size=10, max_positions=1024, eos_token_ids=(2,), architecture="x")
    handler = OpenAIHandler(PromptCodec(info, tokenizer=None), ServeConfig(model_name="m"))
    request = CompletionRequest.model_construct(model="m", prompt=[3, 4], seed=2**64)  # skips validation
    with pytest.raises(RequestError) as error:
        handler.prepare(request)
    assert error.value.status == 400 and "seed" in error.value.message
    prepared = handler.prepare(
        CompletionRequest.model_validate({"model": "m", "prompt": [3, 4], "temperature": 1e-300})
    )
    assert prepared.params.greedy


# Fields this server does not implement, and unknown fields ------------------------------------

UNSUPPORTED_COMPLETION = [
    ("echo", True),
    ("suffix", "}"),
]
UNSUPPORTED_CHAT = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"),
    ("web_search_options", {}),
    ("max_completion_tokens", 16),
]


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED_COMPLETION)
def test_unsupported_completion_fields_are_refused(field: str, value: object) -> None:
    error = refused({**GOOD, field: value})
    assert error.status == 400 and error.param == field and error.code == "invalid_value"
    assert error.message == f"{field}: not supported by this server; leave it out", error.message


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_refused(field: str, value: object) -> None:
    error = refused({**CHAT, field: value}, ChatCompletionRequest)
    assert error.status == 400 and error.param == field
    assert f"{field}: not supported by this server; " in error.message, error.message
    if field == "max_completion_tokens":
        assert "send max_tokens instead" in error.message


@pytest.mark.parametrize(
    ("field", "value"), [("name", "bob"), ("tool_calls", [{"id": "1"}]), ("tool_call_id", "1"), ("refusal", "no")]
)
def test_unsupported_message_fields_are_refused(field: str, value: object) -> None:
    body = {**CHAT, "messages": [{"role": "assistant", "content": "x", field: value}]}
    error = refused(body, ChatCompletionRequest)
    assert error.param == f"messages.0.{field}" and "not supported by this server" in error.message


def test_no_op_values_of_unsupported_fields_are_accepted() -> None:
    """What clients send as defaults asks for nothing: accepted."""
    completion = {
        "echo": False, "logprobs": None, "logit_bias": {}, "best_of": 1, "suffix": None,
        "presence_penalty": 0, "frequency_penalty": 0.0,
    }  # fmt: skip
    assert isinstance(parse({**GOOD, **completion}), CompletionRequest)
    chat = {
        "logprobs": False, "top_logprobs": None, "logit_bias": None, "response_format": {"type": "text"},
        "tools": [], "tool_choice": "none", "functions": None, "modalities": ["text"], "parallel_tool_calls": True,
        "max_completion_tokens": None,
    }  # fmt: skip
    message = {"role": "assistant", "content": "x", "name": None, "tool_calls": [], "refusal": None}
    request = parse({**CHAT, **chat, "messages": [message]}, ChatCompletionRequest)
    assert isinstance(request, ChatCompletionRequest)


def test_harmless_fields_are_accepted_and_ignored() -> None:
    for kind, base in ((CompletionRequest, GOOD), (ChatCompletionRequest, CHAT)):
        request = parse({**base, "user": "u-1", "stream": True, "stream_options": {"include_usage": True}}, kind)
        assert isinstance(request, kind) and request.stream
    assert refused({**GOOD, "stream_options": {"include_usage": "yes"}}).param == "stream_options.include_usage"


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (CompletionRequest, {**GOOD, "foo": 1}, "foo"),
        (CompletionRequest, {**GOOD, "length_penalty": 1.1}, "length_penalty"),  # vLLM's, not ours
        (CompletionRequest, {**GOOD, "tools": []}, "tools"),  # a chat field, not a completions one
        (CompletionRequest, {**GOOD, "messages": []}, "messages"),
        (ChatCompletionRequest, {**CHAT, "prompt": "x"}, "prompt"),
        (ChatCompletionRequest, {**CHAT, "echo": False}, "echo"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "x", "x": 1}]}, "messages.0.x"),
    ],
)
def test_unknown_fields_are_refused_by_name(kind: type, body: dict[str, object], param: str) -> None:
    error = refused(body, kind)
    assert error.status == 400 and error.param == param
    assert (
        error.message
        == f"{param}: unknown field: this route takes the OpenAI fields and extensions listed in docs/usage.md"
    )


def test_every_field_is_documented() -> None:
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, SpeculationOptions, StreamOptions):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"
    unsupported = [
        name
        for name, field in ChatCompletionRequest.model_fields.items()
        if "refused unless" in (field.description or "")
    ]
    assert set(unsupported) <= set(NO_OP_VALUES)


# Logprobs, penalties, biases, n and best_of -----------------------------------------------------


def test_sampling_fields_reach_the_engine() -> None:
    body = {
        **GOOD, "logprobs": 3, "logit_bias": {"7": 1.5, "12": -100}, "presence_penalty": 0.5,
        "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1, "logprobs_mode": "processed",
        "n": 2, "best_of": 4, "temperature": 0.7,
    }  # fmt: skip
    request = parse(body)
    params = request.sampling()
    assert params.logprobs == 3 and params.logprobs_mode == "processed"
    assert params.logit_bias == ((7, 1.5), (12, -100.0))
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.2)
    assert params.min_p == 0.1 and params.penalised
    assert (request.n, request.choices()) == (2, 4)
    assert parse(GOOD).sampling().logprobs is None and parse(GOOD).choices() == 1


@pytest.mark.parametrize(
    ("fields", "logprobs"),
    [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5)],
)
def test_chat_logprobs_and_top_logprobs(fields: dict[str, object], logprobs: int | None) -> None:
    assert parse({**CHAT, **fields}, ChatCompletionRequest).sampling().logprobs == logprobs


def test_chat_top_logprobs_need_logprobs() -> None:
    error = refused({**CHAT, "top_logprobs": 2}, ChatCompletionRequest)
    assert error.param == "top_logprobs" and "top_logprobs needs logprobs: true" in error.message
    error = refused({**CHAT, "logprobs": True, "top_logprobs": 21}, ChatCompletionRequest)
    assert error.param == "top_logprobs" and "less than or equal to 20" in error.message


# Structured output -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_formats_become_grammars(kind: type) -> None:
    base = GOOD if kind is CompletionRequest else CHAT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases: list[tuple[dict[str, object], GrammarSpec | None]] = [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "thing", "schema": schema, "strict": True},
                }
            },
            GrammarSpec("json_schema", json.dumps(schema)),
        ),
        ({"structured_outputs": {"json": schema}}, GrammarSpec("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, GrammarSpec("regex", "[a-z]+")),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, GrammarSpec("lark", 'start: "x"')),
        ({"structured_outputs": {"choice": ["yes", 'n"o']}}, GrammarSpec("lark", 'start: "yes" | "n\\"o"')),
    ]
    for fields, grammar in cases:
        assert parse({**base, **fields}, kind).sampling().grammar == grammar, fields


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "type: Input should be 'text', 'json_object' or"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: Field required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format",
            "json_schema.name: String should match pattern",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "give exactly one of json, regex, grammar or choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "unknown field"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "response_format already asks for a format; send one of the two",
        ),
    ],
)
def test_bad_formats_name_the_field(fields: dict[str, object], param: str, words: str) -> None:
    error = refused({**CHAT, **fields}, ChatCompletionRequest)
    assert error.param == param and words in error.message, error.message
