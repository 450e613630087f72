"""Frozen and lost actors: a frozen drafter costs speed, never a request; a lost or frozen target shard fails fast.

A drafter whose process is stopped (SIGSTOP) mid-stream: after ``stall_timeout_s`` without a report the coordinator
probes the replica, kills the drafter (Ray restarts it) and finishes the request without speculation — greedy, the
tokens of an undisturbed run (transformers' greedy reference); drafter-invariant sampling, the same tokens as an
undisturbed run with the same seed; the next request drafts again. One at a time and batched (TP 1, the replicas of
test_drafter_loss.py: ``shared_replicas``); batched, two requests stalling on the one drafter kill it once. A drafter
that does not answer a health check is restarted the same way, and the check passes.

Each path runs on each replica kind where the kind changes it: the greedy request (the coordinator's plain cycles on
a one-at-a-time and on a batched rank 0), garbage drafts. Where the kind changes nothing the coordinator does, one kind
is enough: drafter-invariant sampling (batched; the same stall and kill as the greedy case, and its plain cycles after
a lost drafter run on both kinds in test_drafter_loss.py) and the health check (one at a time; a probe of the drafter
actor, whatever it serves).

A target shard killed or stopped mid-stream (TP 2): the stream raises ``ReplicaLost`` instead of hanging, and so do
the health check and every later request, at once. Each such test spawns its own replica.

Stopped processes are always continued (SIGCONT) in a ``finally``, so none outlives its test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SharedReplicas, TinyPair
from replicas import Case, config_for, greedy_reference
from test_drafter_loss import longest, plain_cycles, tp1_config

from specserve.actors.coordinator import Coordinator
from specserve.core.errors import ReplicaLost
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(300)

STALL_TIMEOUT_S = 2.0  # the coordinator's wait for a report before it probes the replica


def pid_of(actor: Any) -> int:
    """The process id of an actor (the driver and the actors share this machine)."""
    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


@contextlib.contextmanager
def continued_afterwards(pid: int) -> Iterator[None]:
    """Whatever happens inside, the process ``pid`` is continued when it ends (a no-op for one that is gone)."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def wait_for_a_new_drafter(coordinator: Coordinator, old_pid: int, timeout_s: float = 120.0) -> int:
    """Until the replica's drafter answers from another process than ``old_pid`` (Ray restarted it); its pid."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = int(ray.get(coordinator.replica.drafter.__ray_call__.remote(lambda self: os.getpid()), timeout=5))
            if pid != old_pid:
                return pid
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the drafter (pid {old_pid}) was not restarted within {timeout_s:g}s")
        time.sleep(0.5)


ONE_AT_A_TIME, BATCHED = 1, 2
KINDS = {"one-at-a-time": ONE_AT_A_TIME, "batched": BATCHED}


@pytest.fixture(scope="module", params=list(KINDS.values()), ids=list(KINDS))
def coordinator(
    request: pytest.FixtureRequest, shared_replicas: SharedReplicas, saved_pairs: dict[str, Path]
) -> Coordinator:
    # the shared replica's drafter may be restarted more than the default 3 times (each test below costs one)
    config = tp1_config(saved_pairs["llama"], request.param)
    return shared_replicas.coordinator(config, stall_timeout_s=STALL_TIMEOUT_S)


def only(kind: str) -> pytest.MarkDecorator:
    """Runs a test on one replica kind of ``coordinator`` (the module-scoped fixture's own replica)."""
    return pytest.mark.parametrize("coordinator", [KINDS[kind]], ids=[kind], indirect=True)


def generate_freezing_the_drafter(
    coordinator: Coordinator, prompt: tuple[int, ...], params: SamplingParams, config: GenerationConfig
) -> tuple[GenerationResult, int]:
    """Stream one request and stop the drafter's process after the first chunk; the result and the stopped pid."""
    pid = pid_of(coordinator.replica.drafter)
    result = None
    with continued_afterwards(pid):
        for index, chunk in enumerate(coordinator.stream(prompt, params, config)):
            if index == 1:
                os.kill(pid, signal.SIGSTOP)
            result = chunk.result or result
    assert result is not None
    return result, pid


def test_greedy_request_survives_a_frozen_drafter(coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    prompt = pair.prompts[0]
    config = longest(pair, prompt)
    undisturbed = coordinator.generate(prompt, SamplingParams(), config)
    reference = greedy_reference(pair, prompt, config.max_new_tokens)
    assert undisturbed.output_ids[: len(reference)] == reference
    result, frozen = generate_freezing_the_drafter(coordinator, prompt, SamplingParams(), config)
    assert plain_cycles(result) > plain_cycles(undisturbed), "the stop came after the request ended: nothing tested"
    assert result.output_ids == undisturbed.output_ids and result.finish_reason == "length"

    wait_for_a_new_drafter(coordinator, frozen)  # the coordinator killed the frozen one; Ray restarted it
    coordinator.check_health(timeout_s=10)
    again = coordinator.generate(prompt, SamplingParams(), config)
    assert again.output_ids == undisturbed.output_ids
    assert plain_cycles(again) == plain_cycles(undisturbed) and again.stats.accepted_tokens > 0


@only("batched")
def test_drafter_invariant_request_emits_the_undisturbed_tokens(
    coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]
) -> None:
    prompt = tiny_pairs["llama"].prompts[1]
    params = SamplingParams(temperature=1.0, top_k=30, seed=11, drafter_invariant=True)
    config = longest(tiny_pairs["llama"], prompt)
    undisturbed = coordinator.generate(prompt, params, config)
    result, frozen = generate_freezing_the_drafter(coordinator, prompt, params, config)
    assert plain_cycles(result) > plain_cycles(undisturbed), "the stop came after the request ended: nothing tested"
    assert result.output_ids == undisturbed.output_ids
    wait_for_a_new_drafter(coordinator, frozen)
    coordinator.check_health(timeout_s=10)  # the coordinator sees its drafter back


@only("batched")
def test_concurrent_requests_survive_one_frozen_drafter(
    coordinator: Coordinator, tiny_pairs: dict[str, TinyPair], caplog: pytest.LogCaptureFixture
) -> None:
    """Batched: two requests stall on the one drafter; both finish exactly, and the drafter is killed once (a second
    kill would cost Ray another restart)."""
    assert coordinator.max_concurrency == 2
    pair = tiny_pairs["llama"]
    prompts = (pair.prompts[0], pair.prompts[1])
    configs = [longest(pair, prompt) for prompt in prompts]
    undisturbed = [coordinator.generate(p, SamplingParams(), c) for p, c in zip(prompts, configs, strict=True)]
    pid = pid_of(coordinator.replica.drafter)
    lock = threading.Lock()
    stopped: list[bool] = []
    results: list[GenerationResult | BaseException | None] = [None, None]

    def run(i: int) -> None:
        try:
            for index, chunk in enumerate(coordinator.stream(prompts[i], SamplingParams(), configs[i])):
                if index == 1:
                    with lock:  # the first of the two to get here stops the drafter
                        if not stopped:
                            os.kill(pid, signal.SIGSTOP)
                            stopped.append(True)
                results[i] = chunk.result or results[i]
        except BaseException as exc:
            results[i] = exc

    caplog.set_level(logging.WARNING, logger="specserve.actors.coordinator")
    with continued_afterwards(pid):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    for result, before in zip(results, undisturbed, strict=True):
        assert isinstance(result, GenerationResult), result
        assert plain_cycles(result) > plain_cycles(before), "the stop came after the request ended: nothing tested"
        assert result.output_ids == before.output_ids
    kills = [r for r in caplog.records if "killing it" in r.getMessage()]
    assert len(kills) == 1, [r.getMessage() for r in kills]
    wait_for_a_new_drafter(coordinator, pid)
    coordinator.check_health(timeout_s=10)


@only("one-at-a-time")
def test_health_check_restarts_a_frozen_idle_drafter(coordinator: Coordinator) -> None:
    """A drafter is an optimisation: one that does not answer the health check is killed (Ray restarts it), and the
    check passes."""
    pid = pid_of(coordinator.replica.drafter)
    with continued_afterwards(pid):
        os.kill(pid, signal.SIGSTOP)
        coordinator.check_health(timeout_s=3)
        wait_for_a_new_drafter(coordinator, pid)
    coordinator.check_health(timeout_s=10)
    assert coordinator.lost is None


# ---- the target


@pytest.fixture
def tp2_coordinator(ray_cluster: Any, saved_pairs: dict[str, Path]) -> Iterator[Coordinator]:
    """A TP 2 replica of its own (the test breaks it), collectives timing out soon after a rank stops answering."""
    case = Case("llama", 2, "model", "colocated", False)
    config = config_for(case, saved_pairs["llama"], stall_timeout_s=STALL_TIMEOUT_S, collective_timeout_s=10.0)
    coordinator = Coordinator.spawn(config)
    try:
        yield coordinator
    finally:
        coordinator.shutdown()


def assert_lost_for_good(coordinator: Coordinator, prompt: tuple[int, ...], config: GenerationConfig) -> None:
    """The coordinator remembers: its health check and a new request raise ``ReplicaLost`` at once."""
    assert coordinator.lost is not None and "rank 1" in coordinator.lost
    with pytest.raises(ReplicaLost, match="rank 1"):
        coordinator.check_health(timeout_s=10)
    with pytest.raises(ReplicaLost, match="rank 1"):
        coordinator.stream(prompt, SamplingParams(), config)  # raises here, before the first chunk is asked for


def test_a_dead_shard_loses_the_replica(tp2_coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]) -> None:
    import ray

    pair = tiny_pairs["llama"]
    prompt = pair.prompts[0]
    config = longest(pair, prompt)
    with pytest.raises(ReplicaLost, match="rank 1") as lost:
        for index, _ in enumerate(tp2_coordinator.stream(prompt, SamplingParams(), config)):
            if index == 1:
                ray.kill(tp2_coordinator.replica.shards[1])
    assert "died" in str(lost.value)
    assert_lost_for_good(tp2_coordinator, prompt, config)


def test_a_frozen_shard_loses_the_replica(tp2_coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    prompt = pair.prompts[0]
    config = longest(pair, prompt)
    pid = pid_of(tp2_coordinator.replica.shards[1])
    with continued_afterwards(pid):
        with pytest.raises(ReplicaLost, match="rank 1") as lost:
            for index, _ in enumerate(tp2_coordinator.stream(prompt, SamplingParams(), config)):
                if index == 1:
                    os.kill(pid, signal.SIGSTOP)
        assert "does not answer" in str(lost.value)
        assert_lost_for_good(tp2_coordinator, prompt, config)


def corrupt_drafts_from_cycle(actor: Any, cycle: int) -> None:
    """Make the drafter actor send drafts whose tokens lie outside the vocabulary from ``cycle`` on (the verifier
    refuses them); :func:`restore_drafts` undoes it."""
    import ray

    def corrupt(self: Any, start: int) -> None:
        import specserve.actors.drafter as module

        original = getattr(module, "_honest_encode_draft", module.encode_draft)
        module._honest_encode_draft = original  # type: ignore[attr-defined]

        def garbage(request_id: str, at: int, proposal: Any) -> Any:
            message = original(request_id, at, proposal)
            if at >= start:
                message.token_ids[:] = [2**31 - 1] * len(message.token_ids)
            return message

        module.encode_draft = garbage

    ray.get(actor.__ray_call__.remote(corrupt, cycle), timeout=30)


def restore_drafts(actor: Any) -> None:
    import ray

    def restore(self: Any) -> None:
        import specserve.actors.drafter as module

        module.encode_draft = getattr(module, "_honest_encode_draft", module.encode_draft)

    ray.get(actor.__ray_call__.remote(restore), timeout=30)


def test_a_drafter_sending_garbage_costs_speed_not_the_request(
    coordinator: Coordinator, tiny_pairs: dict[str, TinyPair]
) -> None:
    """From its third cycle the drafter sends drafts the verifier refuses (tokens outside the vocabulary): the request
    finishes without speculation, with the undisturbed tokens; the replica stays healthy."""
    pair = tiny_pairs["llama"]
    prompt = pair.prompts[0]
    config = longest(pair, prompt)
    undisturbed = coordinator.generate(prompt, SamplingParams(), config)
    corrupt_drafts_from_cycle(coordinator.replica.drafter, 2)
    try:
        result = coordinator.generate(prompt, SamplingParams(), config)
    finally:
        restore_drafts(coordinator.replica.drafter)
    assert plain_cycles(result) > plain_cycles(undisturbed)
    assert result.output_ids == undisturbed.output_ids and result.finish_reason == "length"
    assert coordinator.lost is None
    coordinator.check_health(timeout_s=10)
