"""``specserve serve``: every serving setting a flag, flags over the ``--config`` YAML over the defaults, and a real
process serving a checkpoint with no YAML.

The flag tests start nothing. The process test runs ``specserve serve --target DIR --draft ngram`` on a saved tiny
Llama checkpoint: it starts its own Ray and Serve on 127.0.0.1, answers the official ``openai`` client with
transformers' own greedy text, and stops cleanly on Ctrl-C (SIGINT) with exit status 0, printing none of the
lines Ray would print by itself (its token-auth notice, "new http_options ... will not be applied", a retried
``graceful_shutdown``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
import yaml
from conftest import EOS_ID, PAD_ID
from test_config import SAMPLES, TARGET
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve import cli
from specserve.core.errors import UserError
from specserve.serve.command import NOT_FLAGS, add_arguments, serve_file
from specserve.serve.config import ServeConfig
from specserve.serve.deploy_file import IMPORT_PATH

pytestmark = pytest.mark.timeout(600)

# the serving-only fields: a valid value other than the default (the replica fields' are test_config's SAMPLES)
SERVE_SAMPLES: dict[str, Any] = {
    "model_name": "tiny",
    "gamma": 5,
    "policy": "adaptive",
    "default_max_tokens": 64,
    "max_ongoing_requests": 32,
    "max_body_bytes": 4096,
    "body_timeout_s": 2.5,
    "request_timeout_s": 30.0,
    "resume_timeout_s": 45.0,
    "api_docs": "off",
    "drafter_invariant": True,
    "shadow_fraction": 0.25,
    "shadow_dir": "/tmp/specserve-shadow-elsewhere",
}
# What Ray prints by itself on a clean run, and specserve avoids.
NOISE = ("Token authentication", "will not be applied", "graceful_shutdown", "retries remaining")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def flags(settings: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in settings.items():
        flag = ServeConfig.flag(name)
        argv += [flag if value else flag.replace("--", "--no-", 1)] if isinstance(value, bool) else [flag, str(value)]
    return argv


def config_file(tmp_path: Path, args: dict[str, Any], port: int = 8000) -> Path:
    raw = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "cli", "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# ---------------------------------------------------------------------------------------------
# Flags


def test_every_serving_setting_is_a_flag_except_the_api_key() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    assert set(SAMPLES) | set(SERVE_SAMPLES) | NOT_FLAGS == set(ServeConfig.model_fields)
    assert "api_key" not in actions and "--api-key" not in parser.format_help()
    assert "$SPECSERVE_API_KEY" in parser.format_help()
    for name, field in ServeConfig.model_fields.items():
        if name in NOT_FLAGS:
            continue
        action = actions[name]
        assert action.option_strings[0] == ServeConfig.flag(name)
        assert action.default is argparse.SUPPRESS  # left out, a flag does not override the YAML
        assert action.help and action.help.startswith((field.description or "").replace("%", "%%"))
        assert "(default: the --config file's value, else " in action.help


@pytest.mark.parametrize("name", [*SAMPLES, *SERVE_SAMPLES])
def test_each_flag_sets_its_field(name: str) -> None:
    value, needs = SAMPLES[name] if name in SAMPLES else (SERVE_SAMPLES[name], {})
    config = serve_file(parse(flags({"target": TARGET, **needs, name: value}))).config
    assert getattr(config, name) == value


def test_a_flag_given_beats_the_config_file_which_beats_the_default(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"target": TARGET, "draft": "ngram", "gamma": 5, "max_queue": 3, "overlap": True})
    file = serve_file(parse(["--config", str(path), "--gamma", "7", "--no-overlap", "--port", "9001"]))
    assert (file.config.gamma, file.config.overlap) == (7, False)  # flags given
    assert (file.config.max_queue, file.config.target, file.config.draft) == (3, TARGET, "ngram")  # the YAML's
    assert file.config.dtype == ServeConfig.model_fields["dtype"].default  # neither: the field's default
    assert (file.host, file.port) == ("127.0.0.1", 9001)
    plain = serve_file(parse(["--target", TARGET, "--draft", "ngram"])).config  # no YAML at all
    assert plain == ServeConfig(target=TARGET, draft="ngram")


def test_a_negated_switch_reads_both_ways(tmp_path: Path) -> None:
    """``--no-cuda-graphs`` sets its field (argparse's own optional switch would read any ``--no-`` flag as false);
    ``--cuda-graphs`` sets it back over a configuration file."""
    assert serve_file(parse(["--target", TARGET, "--no-cuda-graphs"])).config.no_cuda_graphs is True
    path = config_file(tmp_path, {"target": TARGET, "no_cuda_graphs": True})
    assert serve_file(parse(["--config", str(path)])).config.no_cuda_graphs is True
    assert serve_file(parse(["--config", str(path), "--cuda-graphs"])).config.no_cuda_graphs is False


def test_max_num_seqs_raises_max_ongoing_requests_unless_that_is_given(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"target": TARGET, "max_ongoing_requests": 8})
    fitted = serve_file(parse(["--config", str(path), "--max-num-seqs", "16"])).config
    assert (fitted.max_num_seqs, fitted.max_ongoing_requests) == (16, 16)
    with pytest.raises(UserError, match="max_ongoing_requests 4 < max_num_seqs 16"):
        serve_file(parse(["--config", str(path), "--max-num-seqs", "16", "--max-ongoing-requests", "4"]))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1, got 0"),
        (["--gamma", "0"], "--gamma: "),
        (["--tp", "3"], "--tp"),
        (["--port", "0"], "--port must be between 1 and 65535"),
        (["--target", "/nowhere/at/all"], "/nowhere/at/all"),
    ],
)
def test_bad_values_are_one_error_line_naming_the_flag(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *argv]) == 2  # refused before Ray starts
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


# ---------------------------------------------------------------------------------------------
# A real process


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def transformers_greedy_text(directory: Path, prompt: str, max_new_tokens: int) -> str:
    """transformers' own greedy continuation of ``prompt`` on the checkpoint, decoded as the server decodes."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float64).eval()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    return str(tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True))


def wait_until_serving(process: subprocess.Popen[str], timeout_s: float) -> str:
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while not any("Press Ctrl-C" in line for line in lines):
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise AssertionError(f"serve exited early: {process.stderr.read() if process.stderr else ''}")
        lines.append(line)
        assert time.monotonic() < deadline, f"serve did not come up within {timeout_s:.0f} s"
    return "".join(lines)


@pytest.mark.slow
@pytest.mark.ray  # starts a private Ray of its own
def test_serve_a_checkpoint_without_yaml_then_stop_on_ctrl_c(tmp_path: Path, saved_pairs: dict[str, Path]) -> None:
    target = saved_pairs["llama"] / "target"  # a random-initialised tiny Llama with its tokenizer
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env |= {
        "SPECSERVE_CLUSTER_DIR": str(tmp_path / "no-cluster"),
        "SPECSERVE_API_KEY": "sk-cli",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    argv = ["--target", str(target), "--draft", "ngram", "--dtype", "float64", "--model-name", "tiny"]
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", *argv, "--max-num-seqs", "4", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # Ctrl-C goes to this process alone, as in a terminal
    )
    try:
        started = time.time()
        printed = wait_until_serving(process, timeout_s=240)
        assert f"at http://127.0.0.1:{port}/v1" in printed
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli", max_retries=0, timeout=120)
        (model,) = client.models.list()
        assert model.id == "tiny" and started - 1 <= model.created <= time.time()
        answer = client.completions.create(model="tiny", prompt="abcabc", max_tokens=12, temperature=0)
        want = transformers_greedy_text(target, "abcabc", 12)
        assert want and answer.choices[0].text == want
        assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 12

        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        assert "stopped" in stderr
        output = printed + stdout + stderr
        assert not [line for line in output.splitlines() if any(noise in line for noise in NOISE)], output
        # the start said what it did, with its seconds: Ray, Serve's proxy, the deployment, ready
        steps = [line for line in stderr.splitlines() if re.match(r"\[ *\d+\.\d s\] ", line)]
        assert [re.sub(r"^\[ *\d+\.\d s\] ", "", line).split(":")[0] for line in steps][:3] == [
            "Ray",
            "Serve's HTTP proxy on 127.0.0.1",
            "deploying",
        ], steps
        assert steps[-1].endswith("] ready"), steps
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_the_start_says_each_step_with_its_seconds_and_reminds_while_one_runs() -> None:
    from specserve.serve.launch import Progress

    lines: list[str] = []
    progress = Progress(lines.append, every_s=0.05)
    progress.step("Ray: here")
    with progress.waiting("deploying: the replica loads ..."):
        deadline = time.monotonic() + 30
        while not any("still" in line for line in lines):  # a reminder comes while the step runs
            assert time.monotonic() < deadline, lines
            time.sleep(0.01)
    reminders = len(lines)
    time.sleep(0.2)
    assert len(lines) == reminders  # and stops with it
    progress.step("ready")
    stamp = r"\[ *\d+\.\d s\] "
    assert re.fullmatch(stamp + "Ray: here", lines[0])
    assert re.fullmatch(stamp + r"deploying: the replica loads \.\.\.", lines[1])
    assert all(re.fullmatch(stamp + "still deploying: the replica loads", line) for line in lines[2:-1]), lines
    assert re.fullmatch(stamp + "ready", lines[-1])
