"""``specserve serve --config FILE --max-num-seqs 4``: a real process that starts its own Ray and Serve on 127.0.0.1,
answers from a batched replica, and stops cleanly on Ctrl-C (SIGINT) with exit status 0; a bad flag is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from specserve.serve.deploy_file import IMPORT_PATH

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_serve_command_answers_and_stops_on_ctrl_c(tmp_path: Path, saved_pairs: dict[str, Path]) -> None:
    models = saved_pairs["qwen2"]
    port = free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "cli",
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {
                    "model_name": "tiny",
                    "target": str(models / "target"),
                    "draft": "ngram",
                    "dtype": "float64",
                    "api_key": "sk-cli",
                },
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"SPECSERVE_CLUSTER_DIR": str(tmp_path / "no-cluster"), "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--config", str(path), "--max-num-seqs", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # Ctrl-C goes to this process alone, as in a terminal
    )
    try:
        lines = []
        assert process.stdout is not None
        deadline = time.monotonic() + 300
        while not any("Press Ctrl-C" in line for line in lines):
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                raise AssertionError(f"serve exited early: {process.stderr.read() if process.stderr else ''}")
            lines.append(line)
            assert time.monotonic() < deadline, "serve did not come up within 300 s"
        assert f"at http://127.0.0.1:{port}/v1" in "".join(lines)
        headers = {"Authorization": "Bearer sk-cli"}
        models_list = requests.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=60).json()
        assert [m["id"] for m in models_list["data"]] == ["tiny"]
        body = {"model": "tiny", "prompt": "abcabc", "max_tokens": 6, "temperature": 0}
        answer = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 6

        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr
        assert "stopped" in stderr
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_bad_batch_size_is_refused_before_anything_starts() -> None:
    import argparse

    from specserve.core.errors import UserError
    from specserve.serve.command import add_arguments, run_command

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match="--max-num-seqs must be >= 1"):
        run_command(parser.parse_args(["--max-num-seqs", "0"]))
