"""The HTTP edge of the lossy typical acceptance (specserve.core.verify.typical), without Ray: the ``speculation``
fields are validated (typical without ``lossy`` is a 400 at ``speculation.lossy``), answers say ``lossy``, and
per-request metrics carry the request's ``lossy`` tag."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import TinyPair
from metric_helpers import record_metrics

from specserve.core.engine import SpeculativeEngine
from specserve.core.stats import RequestStats
from specserve.drafters.registry import build_drafter_set
from specserve.serve.config import ServeConfig
from specserve.serve.errors import RequestError
from specserve.serve.metrics import ServeMetrics
from specserve.serve.openai_api import OpenAIHandler
from specserve.serve.schemas import CompletionRequest, parse_request

GOOD: dict[str, Any] = {"model": "tiny", "prompt": "def f(", "temperature": 1.0, "seed": 4, "max_tokens": 8}
TYPICAL = {"acceptance": "typical", "lossy": True}


def parse(body: dict[str, Any]) -> CompletionRequest:
    request = parse_request(CompletionRequest, json.dumps(body).encode(), 4096)
    assert isinstance(request, CompletionRequest)
    return request


def refused(body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


def test_typical_needs_lossy_and_maps_to_the_sampling_params() -> None:
    for speculation in ({"acceptance": "typical"}, {"acceptance": "typical", "lossy": False}):
        error = refused({**GOOD, "speculation": speculation})
        assert error.param == "speculation.lossy" and "typical acceptance is lossy" in error.message
    params = parse({**GOOD, "speculation": {**TYPICAL, "typical_epsilon": 0.2, "typical_delta": 0.5}}).sampling()
    assert params.lossy_acceptance and (params.typical_epsilon, params.typical_delta) == (0.2, 0.5)
    default = parse(GOOD).sampling()
    assert default.acceptance == "exact" and not default.lossy_acceptance
    assert not parse({**GOOD, "speculation": {"lossy": True}}).sampling().lossy_acceptance


@pytest.mark.parametrize(
    ("speculation", "param"),
    [
        ({"acceptance": "medusa", "lossy": True}, "speculation.acceptance"),
        ({**TYPICAL, "drafter_invariant": True}, "speculation.acceptance"),
        ({**TYPICAL, "typical_epsilon": 1.0}, "speculation.typical_epsilon"),
        ({**TYPICAL, "typical_delta": 0}, "speculation.typical_delta"),
        ({**TYPICAL, "lossy": "maybe"}, "speculation.lossy"),
    ],
)
def test_bad_typical_fields_name_the_field(speculation: dict[str, Any], param: str) -> None:
    assert refused({**GOOD, "speculation": speculation}).param == param


def test_answers_say_lossy(pair: TinyPair) -> None:
    runner = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    handler = OpenAIHandler(runner.prompts, ServeConfig(model_name="tiny", gamma=3, default_max_tokens=8))
    lossy = handler.run(runner, parse({**GOOD, "speculation": TYPICAL}))
    exact = handler.run(runner, parse(GOOD))
    assert isinstance(lossy, dict) and isinstance(exact, dict)
    assert lossy["speculation"]["lossy"] is True and lossy["speculation"]["sampling"] == "typical"
    assert exact["speculation"]["lossy"] is False and exact["speculation"]["sampling"] == "rejection"


def test_request_metrics_carry_the_requests_lossy_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    record_metrics(monkeypatch)
    metrics = ServeMetrics("tiny")
    stats = RequestStats()
    stats.new_tokens = 3
    metrics.finished("stop", stats, lossy=True)
    metrics.finished("length", stats)
    metrics.first_token(0.1, lossy=True)
    requests: Any = metrics.requests
    tokens: Any = metrics.generated_tokens
    first: Any = metrics.time_to_first_token
    assert [tags["lossy"] for _, tags in requests.updates] == ["true", "false"]
    assert [tags["lossy"] for _, tags in tokens.updates] == ["true", "false"]
    assert first.updates == [(0.1, {"model": "tiny", "lossy": "true"})]
