"""The Serve application end to end: real Ray Serve on 127.0.0.1, the official ``openai`` client, raw HTTP.

One application (ingress + one ModelServer replica placing its target shard and drafter as Ray
actors) serves the shipped default models with an API key for the whole module. Checks: greedy
answers equal ``specserve generate`` and transformers' greedy decoding token for token; streamed
text equals the whole answer; draft trees give the chain's answer, and drafter-invariant sampling
the same text whoever drafts; every bad request gets OpenAI's error JSON with a 4xx and the
server keeps serving; the API key, a body that is not JSON (415) and the API docs (off: a key is
set); what Serve's own proxy routes answer; a client that disconnects mid-stream cancels its
generation and frees its KV; Prometheus metrics, the idle queue gauges among them, reach Ray's
exporter.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import requests
import torch
from metric_helpers import wait_until_exported
from serve_helpers import quick_shutdown

from specserve import cli, defaults
from specserve.benchmarks.serve_load import LoadConfig, compare, markdown, run_load
from specserve.core.model.causal_lm import CausalLM
from specserve.serve.app import MODEL, application
from specserve.serve.config import SERVE_MAX_NUM_SEQS, ServeConfig

pytestmark = pytest.mark.timeout(600)

APP = "http-api"
KEY = "sk-test-key"
MODEL_NAME = "specserve-test"
MAX_BODY = 4096
STARTED = 0  # the Unix time the module's application was deployed
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def url(serve_url: str) -> Iterator[str]:
    from ray import serve

    global STARTED
    config = ServeConfig(model_name=MODEL_NAME, api_key=KEY, default_max_tokens=24, max_body_bytes=MAX_BODY)
    STARTED = int(time.time())
    serve.run(application(config, quick_shutdown()), name=APP, route_prefix="/")
    yield serve_url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body: Any, key: str | None = KEY, **kwargs: Any) -> requests.Response:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}{path}", data=data, headers=headers, timeout=120, **kwargs)


def model_status() -> dict[str, Any]:
    from ray import serve

    return dict(serve.get_deployment_handle(MODEL, APP).status.remote().result(timeout_s=60))


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def test_a_default_server_batches_its_concurrent_requests(client: openai.OpenAI) -> None:
    """The module's server is a default one (the shipped pair; no batching setting): it batches in its own process,
    and concurrent requests share target forwards. (That a batch changes no request's tokens is asserted in float64
    by test_batched_serving.py; this float32 pair may flip near ties between batch shapes.)"""
    status = model_status()
    assert (status["path"], status["at_once"]) == ("batched", SERVE_MAX_NUM_SEQS)
    before = sum(n for size, n in model_status()["batch_sizes"].items() if int(size) > 1)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=32,
                                                                  temperature=0, extra_body={"ignore_eos": True}),
                                PROMPTS))  # fmt: skip
    assert [a.usage.completion_tokens for a in answers if a.usage] == [32] * len(PROMPTS)
    assert sum(n for size, n in model_status()["batch_sizes"].items() if int(size) > 1) > before


def test_an_overloaded_default_server_answers_429_and_serves_on(client: openai.OpenAI) -> None:
    """A bounded load test of the defaults: Serve sends every request on to the model replica (its
    max_ongoing_requests is derived above the replica's bound), which holds max_num_seqs generating and max_queue
    waiting, and refuses the next one at once with 429, Retry-After and the bound in its settings' names."""
    defaults_ = ServeConfig()
    at_once, queue = defaults_.max_num_seqs, defaults_.max_queue
    endless = {"max_tokens": 900, "extra_body": {"ignore_eos": True}}
    refused_before = model_status()["finished"].get("queue_full", 0)
    streams = []
    try:
        for i in range(at_once + queue):  # each stream's status line means the replica took it
            streams.append(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i % 3], stream=True, **endless))
        wait_for(lambda: model_status()["running"] == at_once, 60, f"{at_once} requests generating")
        assert model_status()["waiting"] == queue
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **endless)
        answer = refused.value.response
        assert answer.headers["retry-after"].isdigit() and int(answer.headers["retry-after"]) >= 1
        assert f"(max_num_seqs {at_once} + max_queue {queue})" in answer.json()["error"]["message"]
    finally:
        for stream in streams:
            stream.close()  # the clients leave: their requests are cancelled, their KV freed

    def idle() -> bool:
        status = model_status()
        return (status["running"], status["waiting"], status["active_requests"]) == (0, 0, [])

    wait_for(idle, 120, "the cancelled requests gone")
    assert model_status()["finished"]["queue_full"] == refused_before + 1
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert again.usage is not None and again.usage.completion_tokens == 8


# ---------------------------------------------------------------------------------------------
# Answers


def specserve_generate(
    prompt: str, max_new_tokens: int, capsys: pytest.CaptureFixture[str], *flags: str
) -> dict[str, Any]:
    capsys.readouterr()
    args = ["generate", "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--temperature", "0", "--json"]
    assert cli.main([*args, *flags]) == 0
    return dict(json.loads(capsys.readouterr().out))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_specserve_generate(
    client: openai.OpenAI, prompt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0)
    want = specserve_generate(prompt, 40, capsys)
    assert answer.choices[0].text == want["text"]
    assert answer.usage is not None
    assert answer.usage.completion_tokens == len(want["output_ids"])
    assert answer.usage.prompt_tokens == len(want["prompt_ids"])
    assert answer.choices[0].finish_reason == ("stop" if want["finish_reason"] in ("eos", "stop") else "length")
    # ... and `specserve generate` is transformers' own greedy decoding, token for token
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    ref = target.model.generate(
        torch.tensor([want["prompt_ids"]]), do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0
    )[0, len(want["prompt_ids"]) :].tolist()
    assert want["output_ids"] == ref[: len(want["output_ids"])]
    spec = answer.model_extra["speculation"] if answer.model_extra else None
    assert spec is not None and spec["drafted_tokens"] > 0 and spec["lossy"] is False
    assert len(spec["acceptance_by_position"]) == defaults.DEFAULT_GAMMA


def test_streamed_text_equals_the_whole_answer(client: openai.OpenAI) -> None:
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=48, temperature=0)
        parts = list(
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=48, temperature=0, stream=True)
        )
        assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
        assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert all(p.choices[0].finish_reason is None for p in parts[:-1])


def test_logprobs_penalties_and_n_through_the_openai_client(
    client: openai.OpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same greedy tokens and logprobs as ``specserve generate`` with the same flags, whole and streamed; n
    choices (greedy: all the same) with usage over all of them; best_of; chat logprobs with alternatives."""
    prompt = PROMPTS[0]
    fields: dict[str, Any] = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "logit_bias": {"10": 3.0}}
    extra = {"repetition_penalty": 1.2, "min_p": 0.05}  # min_p: no effect when greedy, accepted
    answer = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=2, extra_body=extra, **fields
    )
    want = specserve_generate(
        prompt, 24, capsys, "--presence-penalty", "0.8", "--frequency-penalty", "0.4", "--logit-bias", "10=3",
        "--repetition-penalty", "1.2", "--logprobs", "2",
    )  # fmt: skip
    assert answer.choices[0].text == want["text"]
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx([entry["logprob"] for entry in want["logprobs"]], abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    parts = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=2, stream=True,
            extra_body=extra, **fields,
        )
    )  # fmt: skip
    streamed = [v for part in parts if part.choices[0].logprobs for v in part.choices[0].logprobs.token_logprobs or []]
    assert streamed == logprobs.token_logprobs

    several = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2] and len({c.text for c in several.choices}) == 1
    assert several.usage is not None and answer.usage is not None
    one = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert one.usage is not None and several.usage.completion_tokens == 3 * one.usage.completion_tokens
    streamed_choices = list(
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, n=3, stream=True)
    )
    for index in range(3):
        text = "".join(c.choices[0].text for c in streamed_choices if c.choices and c.choices[0].index == index)
        assert text == several.choices[index].text
    assert streamed_choices[-1].choices == [] and streamed_choices[-1].usage == several.usage
    best = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1, seed=3, best_of=3)
    assert len(best.choices) == 1 and best.usage is not None and best.usage.completion_tokens >= 3

    messages: Any = [{"role": "user", "content": "A loop:"}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and chat.usage is not None and len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    chat_parts = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed_content = [
        e for p in chat_parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.logprob) for e in streamed_content] == [(e.token, e.logprob) for e in content]


def test_json_schema_and_structured_outputs(client: openai.OpenAI) -> None:
    """response_format json_schema through the official client, whole and streamed: JSON that follows the schema;
    a regex and a choice through the structured_outputs extension; a schema that does not compile is a 400."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer", "maximum": 99}},
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    messages: Any = [{"role": "user", "content": "Describe a file as JSON."}]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "file", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=64, temperature=0, response_format=fmt
    )
    text = whole.choices[0].message.content
    assert text is not None and whole.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    parts = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=64, temperature=0, response_format=fmt, stream=True
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text
    sampled = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=64, temperature=1, seed=2, response_format=fmt
    )
    jsonschema.validate(json.loads(sampled.choices[0].message.content or ""), schema)

    regex = client.completions.create(
        model=MODEL_NAME,
        prompt="x = ",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{2,5}"}},
    )
    assert re.fullmatch("[0-9]{2,5}", regex.choices[0].text)
    regex_parts = list(
        client.completions.create(
            model=MODEL_NAME, prompt="x = ", max_tokens=16, temperature=0, stream=True,
            extra_body={"structured_outputs": {"regex": "[0-9]{2,5}"}},
        )
    )  # fmt: skip
    assert "".join(p.choices[0].text for p in regex_parts if p.choices) == regex.choices[0].text
    choice = client.completions.create(
        model=MODEL_NAME,
        prompt="ok = ",
        max_tokens=8,
        temperature=1,
        extra_body={"structured_outputs": {"choice": ["True", "False"]}},
    )
    assert choice.choices[0].text in ("True", "False")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"structured_outputs": {"json": {"type": "objekt"}}}
        )
    assert "json_schema grammar is not valid" in str(info.value)


def test_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop:"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    parts = list(
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0, stream=True)
    )
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens > 0


def test_speculation_off_and_sampling_options(client: openai.OpenAI) -> None:
    prompt = PROMPTS[0]
    on = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
    off = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"speculation": {"enabled": False}}
    )
    assert on.choices[0].text == off.choices[0].text
    assert off.model_extra is not None and off.model_extra["speculation"]["drafted_tokens"] == 0
    seeded = [
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=0.8,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 50, "speculation": {"gamma": 2}},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]  # a seed makes sampling reproducible
    stopped = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=["\n"])
    assert "\n" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_trees_and_drafter_invariant_sampling(client: openai.OpenAI) -> None:
    def complete(temperature: float, speculation: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        answer = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=temperature, seed=3,
            extra_body={"speculation": speculation},
        )  # fmt: skip
        assert answer.model_extra is not None
        return answer.choices[0].text, answer.model_extra["speculation"]

    chain, chain_stats = complete(0, {})
    assert chain_stats["tree_shapes"] == [] and chain_stats["sampling"] == "greedy"
    for tree in (
        {"kind": "dynamic", "depth": 3, "width": 2, "nodes": 6},
        {"kind": "static", "paths": [[0], [1], [0, 0]]},
    ):
        text, stats = complete(0, {"tree": tree})
        assert text == chain, tree  # a tree changes the speed, never the answer
        assert len(stats["tree_shapes"]) == stats["cycles"] > 0 and stats["drafted_tokens"] > 0, stats
    # drafter-invariant sampling: the same seed gives the same text whoever drafts
    by_drafter = {
        drafter: complete(1.0, {"drafter": drafter, "drafter_invariant": True}) for drafter in ("default", "ngram")
    }
    assert by_drafter["default"][0] == by_drafter["ngram"][0]
    assert all(stats["sampling"] == "drafter_invariant" for _, stats in by_drafter.values())
    # a policy decides each cycle's budget in the replica's drafter actor; the answer is the same
    for policy in ("adaptive", "heuristic"):
        text, stats = complete(0, {"policy": policy})
        assert text == chain, policy
        assert len(stats["budgets"]) == stats["cycles"] > 0, stats
    assert set(chain_stats["budgets"][:-1]) <= {3}  # fixed: the deployment's γ every cycle (the last may be cut)


def test_models_health_and_readiness(client: openai.OpenAI, url: str) -> None:
    (model,) = client.models.list()
    assert model.id == MODEL_NAME
    assert STARTED - 1 <= model.created <= time.time()  # the Unix time the model deployment started
    assert requests.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    ready = requests.get(f"{url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["model"] == MODEL_NAME


# ---------------------------------------------------------------------------------------------
# Refusals


GOOD: dict[str, Any] = {"model": MODEL_NAME, "prompt": "x = 1", "max_tokens": 4}
BAD_REQUESTS: list[tuple[Any, int, str | None, str]] = [
    # (body, status, param or None, words the message must contain)
    (b"{not json", 400, None, "not valid JSON"),
    ({**GOOD, "prompt": 5}, 400, "prompt", "prompt"),
    ({**GOOD, "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ({**GOOD, "model": "gpt-4"}, 404, "model", "GET /v1/models"),
    ({"model": MODEL_NAME, "max_tokens": 4}, 400, "prompt", "prompt"),
    ({**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({**GOOD, "max_tokens": 5000}, 400, "max_tokens", "max_tokens (5000) exceeds the target's context"),
    ({**GOOD, "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "greater than 0"),
    ({**GOOD, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ({**GOOD, "n": 17}, 400, "n", "less than or equal to 16"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({**GOOD, "speculation": {"gamma": 0}}, 400, "speculation.gamma", "greater than or equal to 1"),
    ({**GOOD, "speculation": {"drafter": "eagle"}}, 400, "speculation.drafter", "'suffix', 'lookahead' or 'none'"),
    ({**GOOD, "speculation": {"tree": {"kind": "static", "paths": [[0, 1]]}}}, 400, "speculation.tree", "parent path"),
    ({**GOOD, "prompt": "x" * (MAX_BODY + 10)}, 413, None, "exceeds the limit"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(url: str, body: Any, status: int, param: str | None, words: str) -> None:
    answer = post(url, "/v1/completions", body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"]
    # in the client's words: the OpenAI field names, none of pydantic's prefixes
    assert "max_new_tokens" not in error["message"] and "Value error" not in error["message"]
    assert post(url, "/v1/completions", GOOD).status_code == 200  # and the server keeps serving


def test_bad_chat_requests(url: str) -> None:
    for body, param in [
        ({"model": MODEL_NAME, "messages": []}, "messages"),
        ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"model": MODEL_NAME, "messages": [{"role": "user"}]}, "messages.0.content"),
    ]:
        answer = post(url, "/v1/chat/completions", body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_unknown_routes_and_methods(url: str) -> None:
    missing = requests.get(f"{url}/v1/engines", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = requests.get(f"{url}/v1/completions", timeout=30)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_openai_client_raises_typed_errors(client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(5000\)") as too_long:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5000)
    assert "max_new_tokens" not in str(too_long.value)
    with pytest.raises(openai.BadRequestError, match="the prompt is empty") as empty:
        client.completions.create(model=MODEL_NAME, prompt="", max_tokens=2)
    assert "Value error" not in str(empty.value)
    wrong_key = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)


def test_api_key(url: str) -> None:
    for key in (None, "sk-wrong", KEY + "x"):
        answer = post(url, "/v1/completions", GOOD, key=key)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in answer.json()["error"]["message"]
    assert requests.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert post(url, "/v1/completions", GOOD).status_code == 200
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # probes need no key


def test_bodies_must_be_json_and_docs_are_off_with_a_key(url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}
    answer = requests.post(f"{url}/v1/completions", data=json.dumps(GOOD), headers=headers, timeout=30)
    assert answer.status_code == 415 and answer.json()["error"]["code"] == "unsupported_media_type"
    for path in ("/docs", "/redoc", "/openapi.json"):  # api_docs "auto": off, since a key is set
        assert requests.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 404


def test_what_serves_own_proxy_routes_reveal(url: str) -> None:
    """Serve's proxy answers these before a request reaches the app, key or no key (docs/security.md)."""
    routes = requests.get(f"{url}/-/routes", timeout=30)
    assert routes.status_code == 200 and routes.json()["/"] == APP  # route prefixes and application names
    healthz = requests.get(f"{url}/-/healthz", timeout=30)
    assert healthz.status_code == 200 and healthz.text == "success"


# ---------------------------------------------------------------------------------------------
# Disconnects and metrics


def test_disconnect_cancels_the_generation_and_frees_kv(url: str, client: openai.OpenAI) -> None:
    before = model_status()["finished"].get("cancelled", 0)
    body = {**GOOD, "prompt": PROMPTS[0], "max_tokens": 900, "stream": True, "ignore_eos": True}
    with post(url, "/v1/completions", body, stream=True) as answer:
        assert answer.status_code == 200
        events = answer.iter_lines()
        received = [line for line, _ in zip(events, range(6), strict=False) if line]
        assert received and all(line.startswith(b"data: {") for line in received)

    # the connection is closed after a few events of a ~900-token generation; a batched replica cancels it at its
    # next step
    def cancelled() -> bool:
        status = model_status()
        return status["finished"].get("cancelled", 0) == before + 1 and status["active_requests"] == []

    wait_for(cancelled, 60, "the cancellation")
    status = model_status()
    assert status["running"] == 0
    if "kv" in status:  # batched in process: the pool is whole again
        assert status["kv"]["free"] == status["kv"]["tokens"]
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert again.usage is not None and again.usage.completion_tokens == 8


def test_metrics_reach_prometheus(client: openai.OpenAI, ray_cluster: Any) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0)
    port = ray_cluster.nodes()[0]["MetricsExportPort"]
    names = {
        "ray_specserve_requests_total",
        "ray_specserve_drafts_total",
        "ray_specserve_draft_tokens_total",
        "ray_specserve_accepted_tokens_total",
        "ray_specserve_accepted_by_position_total",
        "ray_specserve_mean_accepted_length_bucket",
        "ray_specserve_gamma_bucket",
        "ray_specserve_tokens_per_second_bucket",
        "ray_specserve_time_to_first_token_seconds_bucket",
        "ray_specserve_queue_length",
        "ray_specserve_running_requests",
    }
    wait_until_exported(port, names, MODEL_NAME, also=lambda line: 'lossy="false"' in line)


# ---------------------------------------------------------------------------------------------
# The load generator of `specserve bench-serve`, against this application


def test_load_generator_counts_what_the_server_generated(url: str) -> None:
    modes = (("off", {"enabled": False}), ("ngram", {"drafter": "ngram", "gamma": 3}))
    cfg = LoadConfig(max_tokens=12, concurrency=(1, 2), requests_per_level=(2, 3), modes=modes, rounds=2)
    rows = run_load(url, MODEL_NAME, PROMPTS, cfg, api_key=KEY)
    assert [(r["concurrency"], r["mode"], r["requests"]) for r in rows] == [
        (1, "off", 4), (1, "ngram", 4), (2, "off", 6), (2, "ngram", 6)
    ]  # fmt: skip
    for row in rows:
        assert row["errors"] == 0 and row["tokens"] == 12 * row["requests"]  # EOS ignored: exactly max_tokens
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 0 < row["itl_p50_s"] <= row["itl_p99_s"]
        assert row["throughput_tok_s"] == pytest.approx(row["tokens"] / row["wall_s"])
        assert row["mean_accepted_length"] == 1 if row["mode"] == "off" else row["mean_accepted_length"] >= 1
    report = {"rows": rows, "comparison": compare(rows)}
    assert [(c["concurrency"], c["mode"]) for c in report["comparison"]] == [(1, "ngram"), (2, "ngram")]
    # every ngram request (prompt and seed) was also sent without speculation, at one level or the other
    assert [c["compared_texts"] for c in report["comparison"]] == [4, 6]
    assert markdown(report).count("\n| 1 |") == 3  # two rows and one comparison at concurrency 1
    # answered whole (--no-stream): the same counts and, request for request, the same texts as streamed
    whole_cfg = LoadConfig(
        max_tokens=12, concurrency=(2,), requests_per_level=(3,), modes=modes, rounds=1, stream=False
    )
    whole = run_load(url, MODEL_NAME, PROMPTS, whole_cfg, api_key=KEY)
    for row in whole:
        assert row["errors"] == 0 and row["tokens"] == 36 and row["itl_p50_s"] is None and row["ttft_p50_s"] > 0
        streamed = next(r for r in rows if r["concurrency"] == 2 and r["mode"] == row["mode"])
        assert row["texts"].items() <= streamed["texts"].items()
    unauthorised = run_load(url, MODEL_NAME, PROMPTS, LoadConfig(concurrency=(1,), requests_per_level=(1,), rounds=1))
    assert all(r["errors"] == 1 and "401" in r["errors_seen"][0] for r in unauthorised)
