"""Hostile bodies against the real HTTP server: every answer is a 2xx or OpenAI's 4xx error JSON, never a 5xx or a hang.

One application (the tiny float64 llama pair, a 128-token context) on the session's Serve, twice: with
the default one-at-a-time replica (its target shard and drafter as Ray actors), then with a replica
batching 4 requests in its own process (deploying while the first is tested); everything below runs against
each. First the operator's probe from issue 17, each finding as a named request; then a hypothesis fuzzer that
posts generated JSON bodies to ``/v1/completions`` and ``/v1/chat/completions``: mixtures of valid
fields and mutated ones (wrong types, huge and non-finite numbers, NaN-like strings, empty and long
strings, nested junk, random extra keys, unsupported OpenAI fields), some whole, some streamed.
The fuzzer is derandomised (the same examples on every run, so CI is reproducible) and bounded
(``MAX_EXAMPLES`` in all, half per replica — ``$SPECSERVE_FUZZ_EXAMPLES`` for a longer hunt —,
``max_tokens`` small, a timeout on every request). Afterwards the server still answers ``/health`` and a normal request.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import cases_in_use
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray.serve import Application
from serve_helpers import deploy_without_waiting, quick_shutdown, wait_until_running

from specserve.core.sampling.params import MAX_TOP_K
from specserve.serve.app import application
from specserve.serve.config import ServeConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "fuzz-http"  # the application of a replica kind is APP-<kind>, at /<kind>
MODEL_NAME = "tiny-fuzz"
MAX_BODY = 8192
MAX_EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "150"))  # in all; more, for a longer hunt
PER_REPLICA = max(1, MAX_EXAMPLES // 2)  # each replica kind gets half
TIMEOUT_S = (10, 60)  # connect, read: a hang fails the test instead of the session
ROUTES = ("/v1/completions", "/v1/chat/completions")
ERROR_KEYS = {"message", "type", "param", "code"}
STATUSES: Counter[int] = Counter()  # what the fuzzer's requests were answered


KINDS = {"one-at-a-time": 1, "batched": 4}  # max_num_seqs


def app_of(kind: str, models: Path) -> Application:
    config = ServeConfig(
        model_name=MODEL_NAME,
        target=str(models / "target"),
        draft=str(models / "draft"),
        dtype="float64",
        gamma=3,
        default_max_tokens=4,  # a body without max_tokens stays cheap
        max_body_bytes=MAX_BODY,
        max_num_seqs=KINDS[kind],
    )
    return application(config, quick_shutdown())


@pytest.fixture(scope="module", params=list(KINDS))
def url(request: pytest.FixtureRequest, serve_url: str, saved_pairs: dict[str, Path]) -> Iterator[str]:
    """The application with a one-at-a-time replica (target shard and drafter as Ray actors), then with a replica
    batching 4 requests in its own process. The first kind's tests begin once its application runs; the next kind's
    application deploys meanwhile."""
    from ray import serve

    kinds = cases_in_use(request, "url")
    kind = request.param
    if kind == kinds[0]:
        serve.run(app_of(kind, saved_pairs["llama"]), name=f"{APP}-{kind}", route_prefix=f"/{kind}")
        for later in kinds[1:]:
            deploy_without_waiting(app_of(later, saved_pairs["llama"]), f"{APP}-{later}", f"/{later}")
    wait_until_running(f"{APP}-{kind}")
    STATUSES.clear()  # what this replica's fuzzing was answered
    yield f"{serve_url}/{kind}"
    serve.delete(f"{APP}-{kind}")


def post(url: str, route: str, body: Any) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps writes NaN as NaN
    headers = {"Content-Type": "application/json"}
    return requests.post(f"{url}{route}", data=data, headers=headers, timeout=TIMEOUT_S, stream=True)


def check_answer(answer: requests.Response) -> str:
    """The response is a 2xx (whole JSON, or events ending in [DONE] with no error event) or OpenAI's 4xx error JSON.

    Returns the completion's text (2xx) or the error message (4xx)."""
    with answer:
        raw = answer.content  # the whole body, within the read timeout
    assert answer.status_code < 500, f"{answer.status_code}: {raw[:2000]!r}"
    if answer.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"], error
        assert error["type"] != "server_error", error
        return str(error["message"])
    assert answer.status_code == 200, raw[:2000]
    if not answer.headers["content-type"].startswith("text/event-stream"):
        body = json.loads(raw)
        choice = body["choices"][0]
        return str(choice["text"] if "text" in choice else choice["message"]["content"])
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]", raw[-500:]
    texts = []
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event  # a failure after the status line
        choice = event["choices"][0]
        texts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(texts)


GOOD: dict[str, Any] = {"model": MODEL_NAME, "prompt": "abcab", "max_tokens": 4}


# ---------------------------------------------------------------------------------------------
# The operator's probe (issue 17), each finding as a named request


def test_probe_temperatures_below_the_floor_answer_greedily(url: str) -> None:
    greedy = check_answer(post(url, ROUTES[0], {**GOOD, "temperature": 0}))
    for temperature in (1e-300, 5e-324):
        answer = post(url, ROUTES[0], {**GOOD, "temperature": temperature})
        assert answer.status_code == 200, answer.text
        assert check_answer(answer) == greedy  # greedy: the same text as temperature 0
        assert answer.json()["speculation"]["sampling"] == "greedy"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"seed": 2**63}, "seed"),
        ({"top_k": MAX_TOP_K + 1}, "top_k"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"speculation": {"enabled": "no"}}, "speculation.enabled"),
        ({"echo": True}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"x5": 10}}, "logit_bias"),
        ({"logit_bias": {"96": 1}}, "logit_bias"),  # outside the tiny vocabulary
        ({"best_of": 17}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),  # compiles, then cannot run
        ({"structured_outputs": {"grammar": "start: /a{1000000}/"}}, "structured_outputs"),
    ],
)
def test_probe_refusals_are_400s_naming_the_field(url: str, change: dict[str, Any], param: str) -> None:
    answer = post(url, ROUTES[0], {**GOOD, **change})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_probe_top_k_beyond_the_vocabulary_truncates_nothing(url: str) -> None:
    """The tiny vocabulary has 96 tokens: top_k 1000 keeps them all, so a seeded answer equals top_k 0's."""
    texts = [
        check_answer(post(url, ROUTES[0], {**GOOD, "temperature": 1.0, "seed": 11, "top_k": top_k}))
        for top_k in (0, 1000, MAX_TOP_K)
    ]
    assert texts[0] == texts[1] == texts[2]


# ---------------------------------------------------------------------------------------------
# The fuzzer

JUNK_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400, 0, -1, 1]),
    st.floats(),  # NaN and infinities too (json.dumps writes NaN, Infinity)
    st.sampled_from([1e-300, 5e-324, 1e308, -0.0, 1e-5, 9.999e-6]),
    st.text(max_size=12),
    st.sampled_from(["NaN", "nan", "Infinity", "-inf", "1e400", "16", "true", "null", "", " ", "\x00", "é" * 3]),
    st.text(min_size=300, max_size=600),
)
JUNK = st.recursive(
    JUNK_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

# Valid values (a few of them still refused: typical acceptance without lossy, a static tree path without its
# parent, a prompt beyond the context or outside the vocabulary...), then mutations of a few fields.
TREES = st.one_of(
    st.just({"kind": "chain"}),
    st.fixed_dictionaries(
        {"kind": st.just("dynamic")},
        optional={"depth": st.integers(1, 4), "width": st.integers(1, 3), "nodes": st.integers(1, 8)},
    ),
    st.fixed_dictionaries(
        {"kind": st.just("static"), "paths": st.sampled_from([[[0]], [[0], [1]], [[0], [1], [0, 0]], [[0], [0, 5]]])}
    ),
)
SPECULATION = st.fixed_dictionaries(
    {},
    optional={
        "enabled": st.booleans(),
        "gamma": st.integers(1, 8),
        "drafter": st.sampled_from(["default", "ngram", "none"]),
        "tree": TREES,
        "policy": st.sampled_from(["fixed", "heuristic", "adaptive"]),
        "drafter_invariant": st.booleans(),
        "acceptance": st.sampled_from(["exact", "exact", "typical"]),
        "lossy": st.booleans(),
        "typical_epsilon": st.floats(0.01, 0.99),
        "typical_delta": st.floats(0.01, 1.0),
    },
)
COMMON = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.just(0), st.floats(0.0, 2.0), st.floats(1e-320, 1e-4), st.floats(1.0, 100.0)),
    "top_p": st.floats(1e-9, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 5, 95, 96, 97, 1000, MAX_TOP_K]),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "n": st.just(1),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "speculation": SPECULATION,
    "user": st.text(max_size=10),
    "stream_options": st.just({"include_usage": True}),
    "logprobs": st.sampled_from([None, False]),
    "logit_bias": st.one_of(
        st.just({}), st.dictionaries(st.integers(0, 95).map(str), st.floats(-100, 100), max_size=4)
    ),
    "presence_penalty": st.one_of(st.sampled_from([0, 0.0]), st.floats(-2.0, 2.0)),
    "frequency_penalty": st.one_of(st.sampled_from([0, 0.0]), st.floats(-2.0, 2.0)),
}
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=20),
    st.text(alphabet="abc xyz", min_size=1, max_size=10),
    st.text(min_size=200, max_size=400),  # beyond the 128-token context
    st.lists(st.integers(0, 95), min_size=1, max_size=10),
    st.lists(st.integers(-5, 2**40), min_size=1, max_size=5),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)},
        optional={"name": st.none(), "tool_calls": st.just([])},
    ),
    min_size=1,
    max_size=3,
)
BODIES = {
    ROUTES[0]: st.fixed_dictionaries(
        {"model": st.just(MODEL_NAME), "prompt": PROMPTS},
        optional={**COMMON, "echo": st.just(False), "best_of": st.just(1)},
    ),
    ROUTES[1]: st.fixed_dictionaries(
        {"model": st.just(MODEL_NAME), "messages": MESSAGES},
        optional={**COMMON, "tools": st.just([]), "response_format": st.just({"type": "text"})},
    ),
}
# Where a mutation lands: a field of either route, an OpenAI field we refuse, a field of the speculation object or
# of a chat message, or a new key.
TOP_KEYS = [*COMMON, "model", "prompt", "messages", "echo", "best_of", "suffix", "tools", "top_logprobs"]
NESTED_KEYS = ["enabled", "gamma", "drafter", "tree", "policy", "drafter_invariant", "acceptance", "typical_epsilon"]
MUTATION = st.tuples(
    st.sampled_from(["replace", "replace", "delete", "speculation", "message", "new key"]),
    st.one_of(st.sampled_from(TOP_KEYS), st.text(min_size=1, max_size=10)),
    st.sampled_from(NESTED_KEYS),
    JUNK,
)


def mutate(body: dict[str, Any], mutation: tuple[str, str, str, Any]) -> None:
    how, key, nested, junk = mutation
    if (how == "replace" and key in TOP_KEYS) or how == "new key":
        body[key] = junk
    elif how == "delete":
        body.pop(key, None)
    elif how == "speculation":
        speculation = body.get("speculation")
        body["speculation"] = {**(speculation if isinstance(speculation, dict) else {}), nested: junk}
    elif how == "message" and isinstance(body.get("messages"), list) and body["messages"]:
        message = body["messages"][0]
        body["messages"][0] = {
            **(message if isinstance(message, dict) else {}),
            ("content", "role", key)[len(key) % 3]: junk,
        }


@st.composite
def requests_to_send(draw: st.DrawFn) -> tuple[str, Any]:
    """A route and a body: valid (about a third), a valid body with 1-3 mutations, or no JSON object at all."""
    route = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 9)) == 0:
        return route, draw(st.one_of(st.binary(max_size=64), JUNK.map(lambda value: json.dumps(value).encode())))
    body = dict(draw(BODIES[route]))
    for mutation in draw(st.lists(MUTATION, max_size=3)):
        mutate(body, mutation)
    return route, body


def cheap(body: Any) -> bool:
    """Whether the server would generate at most a few tokens (junk may ask for many; it is not sent)."""
    if not isinstance(body, dict):
        return True
    max_tokens = body.get("max_tokens")
    return not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 6 < max_tokens <= 128)


@settings(
    max_examples=PER_REPLICA,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(request=requests_to_send())
def test_hostile_bodies_get_a_2xx_or_an_openai_4xx(url: str, request: tuple[str, Any]) -> None:
    route, body = request
    if not cheap(body):
        body = {**body, "max_tokens": 4}
    answer = post(url, route, body)
    check_answer(answer)
    STATUSES[answer.status_code] += 1


def test_the_server_still_serves_after_the_fuzzing(url: str) -> None:
    if STATUSES:  # the fuzzer ran: a good share of its bodies generated text, the rest were refused
        assert STATUSES[200] >= PER_REPLICA // 5 and set(STATUSES) - {200} <= {400, 404, 413}, STATUSES
    assert requests.get(f"{url}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
    answer = post(url, ROUTES[0], {**GOOD, "temperature": 0})
    assert answer.status_code == 200 and check_answer(answer)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3, "stream": True}
    assert check_answer(post(url, ROUTES[1], chat)) is not None
    assert math.isfinite(answer.json()["speculation"]["mean_accepted_length"])
