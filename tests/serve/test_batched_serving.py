"""A batched replica end to end: real Ray Serve on 127.0.0.1, the official ``openai`` client, the tiny llama pair.

One application whose ModelServer replica batches (``max_num_seqs`` 2, ``max_queue`` 1, KV slots of
1024 tokens) serves the tiny float64 llama target and draft model, saved with a 2048-token context so
that a request can outlive the test's other calls. Checks: concurrent requests (whole and streamed)
each return exactly the text they return alone, greedy, while the replica's steps verify two at
once; a third waits and a fourth is refused with 429, OpenAI's error JSON and ``Retry-After``, and
the server keeps serving; clients that close their streams cancel their requests and the engine's
KV pool is empty again; a request that can never fit a KV slot is a 400 saying so; a repeated prompt, a chat's next
turn and a ``cache_salt`` are served from the prefix cache as they should; the batch size, tokens per step and the
prefix cache's counts reach Ray's Prometheus exporter. The replica shadow-checks every finished request (decoded
again without speculation when it is idle, beside every other test here): greedy and drafter-invariant requests
match, and the checks, inter-token latency, acceptance and speedup reach Prometheus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from conftest import LONG_CONTEXT as CONTEXT
from metric_helpers import wait_until_exported
from serve_helpers import quick_shutdown

from specserve.serve.app import MODEL, application
from specserve.serve.config import ServeConfig
from specserve.serve.openai_api import choice_seed

pytestmark = pytest.mark.timeout(600)

APP = "batched"
MODEL_NAME = "tiny-batched"
AT_ONCE, QUEUE, MAX_SEQ_LEN = 2, 1, 1024
KV_TOKENS = AT_ONCE * MAX_SEQ_LEN  # the default pool: room for max_num_seqs requests of max_seq_len
PROMPTS = ["abcabcabc", "hello wor", "xyz xyz x", "0123 0123"]
NO_EOS = {"ignore_eos": True}
ENDLESS: dict[str, Any] = {"max_tokens": 1000, "temperature": 0, "extra_body": NO_EOS}


@pytest.fixture(scope="module")
def url(serve_url: str, long_context_pair: Path) -> Iterator[str]:
    from ray import serve

    config = ServeConfig(
        model_name=MODEL_NAME,
        target=str(long_context_pair / "target"),
        draft=str(long_context_pair / "draft"),
        dtype="float64",
        gamma=3,
        max_num_seqs=AT_ONCE,
        max_queue=QUEUE,
        max_seq_len=MAX_SEQ_LEN,
        max_batch_tokens=32,
        shadow_fraction=1.0,  # every finished request is decoded again plainly when the replica is idle
        # max_ongoing_requests left at its default: derived above max_num_seqs + max_queue, so that the replica
        # itself refuses the excess (the 429 test below)
    )
    serve.run(application(config, quick_shutdown()), name=APP, route_prefix="/")
    yield serve_url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def model_status() -> dict[str, Any]:
    from ray import serve

    return dict(serve.get_deployment_handle(MODEL, APP).status.remote().result(timeout_s=60))


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def pool_empty() -> bool:
    status = model_status()
    free = status["kv"]["tokens"] == status["kv"]["free"] == KV_TOKENS  # the prefix cache's positions count as free
    return free and status["active_requests"] == [] and status["running"] == 0


def complete(client: openai.OpenAI, prompt: str, stream: bool) -> tuple[str, int]:
    """The text and how many tokens it came from."""
    options: dict[str, Any] = {"max_tokens": 160, "temperature": 0, "extra_body": NO_EOS}
    if stream:
        parts = list(client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **options))
        usage = parts[-1].usage
        assert usage is not None
        return "".join(part.choices[0].text for part in parts), usage.completion_tokens
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, **options)
    assert answer.usage is not None
    return answer.choices[0].text, answer.usage.completion_tokens


def test_concurrent_requests_each_return_what_they_return_alone(client: openai.OpenAI) -> None:
    status = model_status()
    assert status["path"] == "batched" and status["kv"]["tokens"] == KV_TOKENS
    prompts = PROMPTS[: AT_ONCE + QUEUE]  # as many as the replica holds: two generate at once, one waits its turn
    alone = [complete(client, prompt, stream=False) for prompt in prompts]
    assert all(tokens == 160 for _, tokens in alone)  # EOS ignored: long enough to overlap
    before = model_status()["batch_sizes"].get(AT_ONCE, 0)
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, [client] * len(prompts), prompts, [False, True, True]))
    assert together == alone
    assert model_status()["batch_sizes"].get(AT_ONCE, 0) > before  # steps verified two requests at once
    wait_for(pool_empty, 30, "the KV pool to empty")


def test_n_choices_generate_together_each_as_its_own_seed_alone(client: openai.OpenAI) -> None:
    """n = 2 choices run in the same steps; each is what a request with its seed (choice 0: the request's; choice 1:
    one derived from it) returns alone, logprobs and penalties included."""
    fields: dict[str, Any] = {"temperature": 1.0, "max_tokens": 40, "logprobs": 1, "presence_penalty": 0.5}
    before = model_status()["batch_sizes"].get(2, 0)
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=2, seed=5, extra_body=NO_EOS, **fields)
    assert model_status()["batch_sizes"].get(2, 0) > before  # the two choices were verified in the same forwards
    for index, seed in enumerate([5, choice_seed(5, 1)]):
        alone = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], seed=seed, extra_body=NO_EOS, **fields)
        assert both.choices[index].text == alone.choices[0].text
        ours, theirs = both.choices[index].logprobs, alone.choices[0].logprobs
        assert ours is not None and theirs is not None and theirs.token_logprobs is not None
        assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-9)
    assert both.usage is not None and both.usage.completion_tokens == 80
    wait_for(pool_empty, 30, "the KV pool to empty")


def test_a_full_replica_answers_429_and_serves_on(client: openai.OpenAI) -> None:
    cancelled = model_status()["finished"].get("cancelled", 0)
    # max_num_seqs generate and max_queue wait; each stream's status line means the replica took it
    streams = [client.completions.create(model=MODEL_NAME, prompt=p, stream=True, **ENDLESS) for p in PROMPTS[:3]]
    try:
        wait_for(lambda: model_status()["running"] == AT_ONCE, 30, "two requests generating")
        status = model_status()
        assert (status["running"], status["waiting"]) == (AT_ONCE, QUEUE)
        assert status["kv"]["free"] <= KV_TOKENS - AT_ONCE * ENDLESS["max_tokens"]  # each reserved its prompt + 1000
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], **ENDLESS)
        answer = refused.value.response
        assert answer.status_code == 429
        assert answer.headers["retry-after"].isdigit() and int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "queue_full", None)
        assert f"(max_num_seqs {AT_ONCE} + max_queue {QUEUE})" in error["message"]
    finally:
        for stream in streams:
            stream.close()  # the clients leave: their requests are cancelled and their KV freed
    wait_for(pool_empty, 60, "the cancelled requests' KV")
    wait_for(lambda: model_status()["finished"].get("cancelled", 0) == cancelled + 3, 30, "three cancellations")
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=8, extra_body=NO_EOS)
    assert again.usage is not None and again.usage.completion_tokens == 8
    assert model_status()["finished"]["queue_full"] == 1


def test_a_request_longer_than_max_seq_len_is_refused_with_why(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL_NAME, prompt="ab", max_tokens=MAX_SEQ_LEN, temperature=0)
    error = too_long.value.response.json()["error"]
    assert f"exceed the {MAX_SEQ_LEN} tokens one request may hold on this replica" in error["message"]
    assert "max_seq_len" in error["message"] and error["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as context:
        client.completions.create(model=MODEL_NAME, prompt="ab", max_tokens=CONTEXT, temperature=0)
    assert f"the target's context of {CONTEXT} tokens" in context.value.response.json()["error"]["message"]
    assert client.completions.create(model=MODEL_NAME, prompt="ab", max_tokens=4).usage is not None


def test_batch_metrics_reach_prometheus(client: openai.OpenAI, ray_cluster: Any) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    port = ray_cluster.nodes()[0]["MetricsExportPort"]
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)  # a cache hit
    names = {
        "ray_specserve_batch_size_bucket",
        "ray_specserve_tokens_per_step_bucket",
        "ray_specserve_gamma_bucket",
        "ray_specserve_prompt_tokens_total",
        "ray_specserve_prefix_cache_hit_tokens_total",
        "ray_specserve_prefix_cache_tokens",
    }
    tagged = lambda line: not line.startswith("ray_specserve_gamma_bucket") or "batch_size=" in line  # noqa: E731
    wait_until_exported(port, names, MODEL_NAME, also=tagged)


def test_repeated_prefixes_come_from_the_prefix_cache_within_a_namespace(client: openai.OpenAI) -> None:
    """A prompt sent again reuses all but its last token's KV (``usage.prompt_tokens_details.cached_tokens``) and
    answers the same; a chat's next turn reuses the previous turn's prompt and answer; a ``cache_salt`` is its own
    namespace. The counts reach ``status()`` and Prometheus."""
    prompt = "prefix caching: the same words again and again"
    options: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": NO_EOS}
    hits = model_status()["prefix_cache"]["hits"]

    def cached(answer: Any) -> int:
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return int(answer.usage.prompt_tokens_details.cached_tokens)

    first = client.completions.create(model=MODEL_NAME, prompt=prompt, **options)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, **options)
    assert (cached(first), cached(again)) == (0, first.usage.prompt_tokens - 1)  # type: ignore[union-attr]
    assert again.choices[0].text == first.choices[0].text
    salted = [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, **{**options, "extra_body": {**NO_EOS, "cache_salt": salt}}
        )
        for salt in ("tenant-a", "tenant-b", "tenant-a")
    ]
    assert [cached(answer) for answer in salted] == [0, 0, first.usage.prompt_tokens - 1]  # type: ignore[union-attr]
    assert {answer.choices[0].text for answer in salted} == {first.choices[0].text}
    messages: list[Any] = [{"role": "user", "content": "hello there, how are you"}]
    turn = client.chat.completions.create(model=MODEL_NAME, messages=messages, **options)
    messages += [{"role": "assistant", "content": turn.choices[0].message.content}, {"role": "user", "content": "ok"}]
    following = client.chat.completions.create(model=MODEL_NAME, messages=messages, **options)
    assert cached(following) >= turn.usage.prompt_tokens  # type: ignore[union-attr]  # its prompt, and some answer
    status = model_status()
    assert status["prefix_cache"]["hits"] >= hits + 3 and status["kv"]["cached"] > 0
    wait_for(pool_empty, 30, "the KV pool to empty")


def test_shadow_checks_match_on_served_traffic_and_reach_prometheus(client: openai.OpenAI, ray_cluster: Any) -> None:
    before = model_status()["shadow"]
    invariant = {**NO_EOS, "speculation": {"drafter_invariant": True}}
    for prompt in PROMPTS:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body=NO_EOS)
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=1.0, extra_body=invariant)
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0)  # rejection: skipped

    def checked() -> bool:
        shadow = model_status()["shadow"]
        return shadow["waiting"] == 0 and shadow.get("match", 0) >= before.get("match", 0) + 2 * len(PROMPTS)

    wait_for(checked, 120, f"the shadow checks of 8 requests (before: {before})")
    shadow = model_status()["shadow"]
    assert not shadow.get("mismatch") and not shadow.get("near_tie"), shadow
    assert shadow.get("skipped:sampled", 0) > before.get("skipped:sampled", 0)
    assert model_status()["drafters"]["draft_model"]["speedup"] > 0
    port = ray_cluster.nodes()[0]["MetricsExportPort"]
    names = {
        "ray_specserve_shadow_checks_total",
        "ray_specserve_shadow_skipped_total",
        "ray_specserve_inter_token_latency_seconds_bucket",
        "ray_specserve_acceptance_rate",
        "ray_specserve_speculation_speedup",
        "ray_specserve_draft_budget",
    }
    wait_until_exported(port, names, MODEL_NAME)
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    assert 'result="mismatch"' not in text and 'result="match"' in text
