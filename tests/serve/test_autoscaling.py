"""Serve autoscaling on the local cluster: load grows the ModelServer replicas to the maximum, idleness shrinks them.

Each ModelServer replica places its own target shard and drafter, so the cluster's free "large"
resource (one unit per TP shard) counts the replicas' placement groups: it must fall by one unit
per added replica and come back when a replica is removed (its shards and drafter are freed
with it). Short delays make the test quick; the tiny float64 models keep each replica light.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from serve_helpers import quick_shutdown

from specserve.serve.app import MODEL, application
from specserve.serve.config import ServeConfig

pytestmark = [
    pytest.mark.timeout(600),
    # Ray 2.60 deprecates the per-deployment interval in favour of process-wide environment variables; the
    # field still works, and short intervals are what make this test take one minute instead of two
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field in AutoscalingConfig is deprecated"),
]

APP = "autoscale"
MAX_REPLICAS = 2
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": MAX_REPLICAS,
    "target_ongoing_requests": 1,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 4,
}


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments[MODEL]
    return int(deployment.replica_states.get("RUNNING", 0))


def free_large(ray: Any) -> float:
    return float(ray.available_resources().get("large", 0.0))


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def url(serve_url: str, saved_pairs: dict[str, Path]) -> Iterator[str]:
    from ray import serve

    models = saved_pairs["llama"]
    config = ServeConfig(
        model_name="tiny",
        target=str(models / "target"),
        draft=str(models / "draft"),
        dtype="float64",
        default_max_tokens=100,
        max_num_seqs=1,  # one request at a time per replica: each client's request is one replica's whole load
        max_ongoing_requests=4,
    )
    options = quick_shutdown({MODEL: {"autoscaling_config": AUTOSCALING}})
    serve.run(application(config, options), name=APP, route_prefix="/")
    yield serve_url
    serve.delete(APP)


def test_replicas_follow_the_load(url: str, ray_cluster: Any) -> None:
    assert running_replicas() == 1
    one_replica_free = free_large(ray_cluster)
    stop = threading.Event()
    failures: list[str] = []
    peak = 0

    def client() -> None:
        body = {"model": "tiny", "prompt": "abcabc", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        while not stop.is_set():
            answer = requests.post(f"{url}/v1/completions", json=body, timeout=120)
            if answer.status_code != 200:
                failures.append(answer.text)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:

        def grown() -> bool:
            nonlocal peak
            peak = max(peak, running_replicas())
            return peak >= MAX_REPLICAS

        wait_for(grown, 180, f"{MAX_REPLICAS} replicas under load")
        # the new replica's shard holds one more unit of "large"
        wait_for(lambda: free_large(ray_cluster) == one_replica_free - 1, 30, "the new replica's placement group")
        for _ in range(8):  # load continues: never beyond the maximum
            peak = max(peak, running_replicas())
            time.sleep(0.5)
        assert peak == MAX_REPLICAS
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not failures, failures[:3]
    wait_for(lambda: running_replicas() == 1, 180, "the deployment to shrink back to 1 replica when idle")
    # the removed replica's shard and drafter are gone with it
    wait_for(lambda: free_large(ray_cluster) == one_replica_free, 60, "the removed replica's resources")
    answer = requests.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200
