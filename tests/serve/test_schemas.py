"""Request validation at the HTTP edge: every malformed body gets an OpenAI-style 4xx saying what to fix."""

from __future__ import annotations

import json
import typing

import pytest
import yaml

from specserve.core.engine import REQUEST_DRAFTERS
from specserve.serve.config import API_KEY_ENV, ServeConfig
from specserve.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    SpeculationOptions,
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
