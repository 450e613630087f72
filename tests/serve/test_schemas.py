"""Request validation at the HTTP edge: every malformed body gets an OpenAI-style 4xx saying what to fix."""

from __future__ import annotations

import json
import typing

import pytest
import yaml
from pydantic import ValidationError

from specserve.core.engine import REQUEST_DRAFTERS
from specserve.core.tree import TreeBudget, TreeSpec, TreeTopology
from specserve.serve.config import API_KEY_ENV, ServeConfig
from specserve.serve.schemas import (
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    MAX_TREE_WIDTH,
    ChainTree,
    ChatCompletionRequest,
    CompletionRequest,
    DynamicTree,
    RequestError,
    SpeculationOptions,
    StaticTree,
    parse_request,
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
        ({"n": 2}, "n", "only n = 1"),
        ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": "many"}, "max_tokens", "integer"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"speculation": {"gamma": 0}}, "speculation.gamma", "greater than or equal to 1"),
        ({"speculation": {"gama": 3}}, "speculation.gama", "Extra inputs"),
        ({"speculation": {"drafter": "eagle"}}, "speculation.drafter", "'default', 'ngram' or 'none'"),
        ({"speculation": {"drafter": "models/draft"}}, "speculation.drafter", "'default', 'ngram' or 'none'"),
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
        ({"kind": "chain", "depth": 3}, "depth: Extra inputs are not permitted"),
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
