"""Load benchmark of the HTTP API: throughput, time to first token and inter-token latency under concurrency.

A closed-loop load generator on loopback: at each concurrency level ``c``, ``c`` clients send
streaming completions (or, with ``--no-stream``, completions answered whole) back to back until the level's
request count is reached or its time limit passes (nothing new starts after it). Every level runs once per
*mode* against the same deployment — by default speculation off (``"speculation": {"enabled": false}``: the same
drafter loop with γ = 0), the deployment's draft model, and the n-gram drafter, chosen per
request through the ``speculation`` object — so the comparison is like for like. On a small
shared machine the speed drifts by tens of percent over minutes, so the levels run in
``rounds`` (short blocks) with the order of the modes reversed every other round, each mode's
numbers pool its rounds, and measuring starts after a warm-up. A run may measure several deployments
one after another (:class:`ReplicaSetup`; ``--batched N``: the one-at-a-time replica with speculation off
and at ``--gamma`` (the old default server), then a replica batching N requests with speculation off, each
fixed γ and the adaptive policy), each with its own modes; the first mode of the first deployment is the
baseline of the comparison, and each mode's greedy completions are compared with the baseline's for the same
requests (prompt and seed), at any level.

Per request: **TTFT** = send → first event carrying text; **ITL** = (last token time − first
token time) / (completion tokens − 1), i.e. the mean gap per token after the first (what
vLLM's benchmark calls TPOT). Speculation delivers tokens in bursts, so the raw gap between
events is not a per-token latency and is not reported. Per level: **throughput** = completion
tokens of all requests / wall time of the level; **mean γ** and **mean batch** = per request, the mean
budget it drafted with and the mean number of requests verified with it per cycle (from the response's
``speculation`` summary), averaged over the level's requests.

:func:`run_load` drives a URL (any running application); :func:`run` starts the application
itself (:func:`~specserve.serve.launch.serving`) and writes ``serve_load.json``, ``serve_load.md`` and
``serve_load.png`` under ``--out`` (default ``runs/bench-serve/``). stdout carries the table and a
``results:`` line, or with ``--json`` the report alone (:mod:`specserve.benchmarks.arguments`); progress
goes to stderr. Does not assert anything: BENCHMARKS.md records what it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import requests
from tqdm import tqdm

from specserve import defaults
from specserve.benchmarks.arguments import RUNS_DIR, add_output_arguments, number_list, print_results, stdout_to_stderr
from specserve.benchmarks.tally import report_paths, save_report
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.errors import UserError

DEFAULT_MODES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("off", {"enabled": False}),
    (f"draft model γ{defaults.DEFAULT_GAMMA}", {"drafter": "default", "gamma": defaults.DEFAULT_GAMMA}),
    ("n-gram γ8", {"drafter": "ngram", "gamma": 8}),
)


@dataclass(frozen=True)
class ReplicaSetup:
    """One deployment a run measures: its replica settings (``ServeConfig`` fields) and the modes sent to it."""

    label: str  # prefixes its modes' labels ("" for a run of one deployment)
    settings: dict[str, Any] = field(default_factory=dict)  # e.g. {"max_num_seqs": 32}
    modes: tuple[tuple[str, dict[str, Any]], ...] = DEFAULT_MODES  # (label, speculation object)


@dataclass(frozen=True)
class LoadConfig:
    target: str = str(defaults.DEFAULT_TARGET)
    draft: str = str(defaults.DEFAULT_DRAFT)
    max_tokens: int = 128
    temperature: float = 0.0
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests_per_level: tuple[int, ...] = (4, 8, 16)  # per round and mode; one count per concurrency level
    num_prompts: int = 8  # every level cycles over the same prompts, so levels compare like with like
    level_time_limit_s: float = 300.0  # no request starts after this; the level's numbers cover what ran
    modes: tuple[tuple[str, dict[str, Any]], ...] = DEFAULT_MODES  # (label, speculation object); first = baseline
    # deployments measured one after another (each runs its own modes); the first mode of the first is the baseline
    replicas: tuple[ReplicaSetup, ...] = ()  # () = one deployment with default settings running `modes`
    rounds: int = 4
    warmup_s: float = 30.0  # warm-up requests (every mode) for this long before measuring
    port: int = 8123
    out_dir: Path = RUNS_DIR / "bench-serve"
    threads_per_shard: int = 1  # torch threads of the model process (an in-process batched replica: its own)
    stream: bool = True  # streamed completions (TTFT and ITL measured), or whole ones (latency only: TTFT = it)


@dataclass
class RequestTiming:
    sent: float
    first: float | None = None  # first event with text
    last: float | None = None  # last event with text
    tokens: int = 0  # completion tokens (from usage)
    mean_accepted_length: float | None = None
    mean_budget: float | None = None  # mean γ (or tree nodes) the request drafted with, per cycle
    mean_batch_size: float | None = None  # mean requests verified with it, per cycle
    error: str | None = None
    key: str = ""  # the request's prompt and seed (digest): the same request in another mode or level
    text: str = ""  # the streamed completion
    prompt_tokens: int = 0  # from usage
    cached_tokens: int = 0  # of them, served from the prefix cache (usage.prompt_tokens_details.cached_tokens)

    def summarise(self, answer: dict[str, Any]) -> None:
        """Take the completion tokens and the speculation summary from an answer (or a stream's last event)."""
        usage = answer["usage"]
        self.tokens = int(usage["completion_tokens"])
        self.prompt_tokens = int(usage.get("prompt_tokens", 0))
        self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        speculation = answer.get("speculation", {})
        self.mean_accepted_length = speculation.get("mean_accepted_length")
        budgets, batches = speculation.get("budgets") or [], speculation.get("batch_sizes") or []
        self.mean_budget = float(np.mean(budgets)) if budgets else None
        self.mean_batch_size = float(np.mean(batches)) if batches else None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def itl(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def stream_completion(
    url: str, body: dict[str, Any], api_key: str | None = None, timeout_s: float = 600.0
) -> RequestTiming:
    """One streaming completion, timed event by event."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timing = RequestTiming(sent=time.perf_counter(), key=_digest(f"{body.get('seed')}\0{body.get('prompt')}"))
    try:
        with requests.post(
            f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, stream=True, timeout=timeout_s
        ) as r:
            if r.status_code != 200:
                timing.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return timing
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    timing.error = str(event["error"].get("message"))
                    continue
                now = time.perf_counter()
                if event["choices"][0].get("text"):
                    timing.first = timing.first if timing.first is not None else now
                    timing.last = now
                    timing.text += event["choices"][0]["text"]
                if "usage" in event:
                    timing.summarise(event)
    except requests.RequestException as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


def whole_completion(
    url: str, body: dict[str, Any], api_key: str | None = None, timeout_s: float = 600.0
) -> RequestTiming:
    """One completion answered whole (OpenAI's default, ``stream`` false): its text arrives at once, so its first
    token time is the answer's (TTFT is the request's latency) and it has no last one (no ITL)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timing = RequestTiming(sent=time.perf_counter(), key=_digest(f"{body.get('seed')}\0{body.get('prompt')}"))
    try:
        r = requests.post(f"{url}/v1/completions", json={**body, "stream": False}, headers=headers, timeout=timeout_s)
        if r.status_code != 200:
            timing.error = f"HTTP {r.status_code}: {r.text[:200]}"
            return timing
        answer = r.json()
        timing.first = time.perf_counter()
        timing.text = answer["choices"][0]["text"]
        timing.summarise(answer)
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise_level(timings: list[RequestTiming], wall_s: float) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    itl = [t.itl for t in ok if t.itl is not None]
    accepted = [t.mean_accepted_length for t in ok if t.mean_accepted_length is not None]
    budgets = [t.mean_budget for t in ok if t.mean_budget is not None]
    batches = [t.mean_batch_size for t in ok if t.mean_batch_size is not None]
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "tokens": tokens,
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "mean_accepted_length": float(np.mean(accepted)) if accepted else None,
        "mean_gamma": float(np.mean(budgets)) if budgets else None,
        "mean_batch_size": float(np.mean(batches)) if batches else None,
        "texts": {t.key: _digest(t.text) for t in ok},  # request -> digest of its completion
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_level(
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    time_limit_s: float,
    progress: tqdm | None = None,
    api_key: str | None = None,
    stream: bool = True,
) -> tuple[list[RequestTiming], float]:
    """``concurrency`` closed-loop clients work through ``bodies`` (streamed, or answered whole); returns every
    request's timing and the wall time."""
    send = stream_completion if stream else whole_completion
    lock = threading.Lock()
    pending = list(reversed(bodies))
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    deadline = start + time_limit_s

    def client() -> None:
        while True:
            with lock:
                if not pending or time.perf_counter() > deadline:
                    return
                body = pending.pop()
            timing = send(url, body, api_key)
            with lock:
                timings.append(timing)
                if progress is not None:
                    progress.update(1)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    return timings, time.perf_counter() - start


def request_bodies(
    model: str, prompts: list[str], count: int, cfg: LoadConfig, speculation: dict[str, Any], first: int = 0
) -> list[dict[str, Any]]:
    """``count`` requests over ``prompts`` in turn, from the ``first``-th (rounds continue where the last stopped)."""
    return [
        {
            "model": model,
            "prompt": prompts[(first + i) % len(prompts)],
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "seed": first + i,
            "ignore_eos": True,  # every request generates max_tokens: levels compare equal work
            "speculation": speculation,
        }
        for i in range(count)
    ]


def run_load(
    url: str, model: str, prompts: list[str], cfg: LoadConfig, api_key: str | None = None
) -> list[dict[str, Any]]:
    """Every level in every mode, for ``cfg.rounds`` rounds; one row per (level, mode), its rounds pooled."""
    if len(cfg.requests_per_level) != len(cfg.concurrency):
        raise ValueError("requests_per_level needs one count per concurrency level")
    if not cfg.modes or cfg.rounds < 1:
        raise ValueError("need at least one mode and one round")
    total = cfg.rounds * len(cfg.modes) * sum(cfg.requests_per_level)
    pooled: dict[tuple[int, str], tuple[list[RequestTiming], float]] = {}
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr) as progress:
        for concurrency, count in zip(cfg.concurrency, cfg.requests_per_level, strict=True):
            for round_ in range(cfg.rounds):
                modes = cfg.modes if round_ % 2 == 0 else tuple(reversed(cfg.modes))
                for label, speculation in modes:
                    bodies = request_bodies(model, prompts, count, cfg, speculation, first=round_ * count)
                    timings, wall = run_level(
                        url, bodies, concurrency, cfg.level_time_limit_s, progress, api_key, cfg.stream
                    )
                    before, before_wall = pooled.get((concurrency, label), ([], 0.0))
                    pooled[(concurrency, label)] = (before + timings, before_wall + wall)
    rows = []
    for concurrency in cfg.concurrency:
        for label, _ in cfg.modes:
            timings, wall = pooled[(concurrency, label)]
            row = summarise_level(timings, wall)
            row["concurrency"], row["mode"] = concurrency, label
            row["errors_seen"] = sorted({t.error for t in timings if t.error})[:3]
            rows.append(row)
    return rows


def compare(rows: list[dict[str, Any]], baseline: str = "off") -> list[dict[str, Any]]:
    """Per level and mode: the mode over the baseline (throughput up, latencies down => ratios > 1 are better), and
    how many of its completions equal the baseline's for the same request (prompt and seed) at any level."""
    base_texts: dict[str, str] = {}
    for row in rows:
        if row["mode"] == baseline:
            base_texts.update(row.get("texts", {}))
    out = []
    for row in rows:
        if row["mode"] == baseline:
            continue
        base = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["mode"] == baseline)
        shared = [key for key in row.get("texts", {}) if key in base_texts]
        out.append(
            {
                "concurrency": row["concurrency"],
                "mode": row["mode"],
                "throughput_x": _ratio(row["throughput_tok_s"], base["throughput_tok_s"]),
                "itl_p50_x": _ratio(base["itl_p50_s"], row["itl_p50_s"]),
                "ttft_p50_x": _ratio(base["ttft_p50_s"], row["ttft_p50_s"]),
                "same_texts": sum(row["texts"][key] == base_texts[key] for key in shared),
                "compared_texts": len(shared),
            }
        )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------


def run(cfg: LoadConfig) -> dict[str, Any]:
    from specserve.benchmarks.prompts import heldout_prompts

    prompts = heldout_prompts(cfg.num_prompts)
    setups = cfg.replicas or (ReplicaSetup("", {}, cfg.modes),)
    rows: list[dict[str, Any]] = []
    for setup in setups:
        modes = tuple((f"{setup.label} {label}".strip(), body) for label, body in setup.modes)
        rows += _run_deployment(replace(cfg, modes=modes), setup.settings, prompts)
    baseline = rows[0]["mode"]
    report = {
        "config": {**asdict(cfg), "out_dir": str(cfg.out_dir)},
        "rows": rows,
        "comparison": compare(rows, baseline),
    }
    save_report(cfg.out_dir, "serve_load", report, markdown(report), lambda path: plot(rows, path))
    return report


def _run_deployment(cfg: LoadConfig, settings: dict[str, Any], prompts: list[str]) -> list[dict[str, Any]]:
    """Deploy the application with ``settings``, warm it up, and run every level of ``cfg.modes`` against it."""
    from specserve.serve.config import SERVE_MAX_NUM_SEQS, ServeConfig
    from specserve.serve.deploy_file import ServeFile
    from specserve.serve.launch import serving

    clients = max(cfg.concurrency)
    config = ServeConfig(
        model_name="bench",
        target=cfg.target,
        draft=cfg.draft,
        default_max_tokens=cfg.max_tokens,
        max_ongoing_requests=max(clients, settings.get("max_num_seqs", SERVE_MAX_NUM_SEQS)),
        max_queue=clients,  # a closed loop never has more requests than clients: nothing is refused
        threads_per_shard=cfg.threads_per_shard,
        **settings,
    )
    with serving(ServeFile(config=config, port=cfg.port)) as where:
        url = where["url"].removesuffix("/v1")
        # Warm-up: the first requests pay for lazy initialisation, and a freshly started Ray keeps the cores
        # busy for a while (workers starting, agents settling), which would tax whichever level runs first.
        warm_until = time.perf_counter() + cfg.warmup_s
        while time.perf_counter() < warm_until:
            for _, speculation in cfg.modes:
                stream_completion(url, request_bodies("bench", prompts, 1, cfg, speculation)[0])
        return run_load(url, "bench", prompts, cfg)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.1f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| concurrency | mode | requests | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| mean acc. len | mean γ | mean batch | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        acc, gamma, batch = (
            "–" if r.get(key) is None else f"{r[key]:.2f}"
            for key in ("mean_accepted_length", "mean_gamma", "mean_batch_size")
        )
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {r['requests']} "
            f"| {r['throughput_tok_s']:.1f} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} "
            f"| {_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} | {acc} | {gamma} | {batch} | {r['errors']} |"
        )
    base = report["rows"][0]["mode"] if report["rows"] else "off"
    lines += [
        "",
        f"| concurrency | mode | throughput ÷ {base} | ITL p50: {base} ÷ mode | TTFT p50: {base} ÷ mode "
        f"| texts = {base}'s |",
        "|---|---|---|---|---|---|",
    ]
    for c in report["comparison"]:
        lines.append(
            f"| {c['concurrency']} | {c['mode']} | {_x(c['throughput_x'])} | {_x(c['itl_p50_x'])} "
            f"| {_x(c['ttft_p50_x'])} | {c.get('same_texts', 0)}/{c.get('compared_texts', 0)} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("throughput_tok_s", "throughput (tok/s)", 1.0),
        ("itl_p50_s", "inter-token latency p50 (ms)", 1000.0),
        ("ttft_p50_s", "time to first token p50 (ms)", 1000.0),
    ]
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
            points = sorted((r["concurrency"], r[key]) for r in rows if r["mode"] == mode)
            xs = [c for c, v in points if v is not None]
            ys = [v * scale for _, v in points if v is not None]
            ax.plot(xs, ys, "o--" if i == 0 else "s-", label=mode)
        levels = sorted({r["concurrency"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        if key.startswith("ttft"):
            ax.set_yscale("log")  # queueing makes it span orders of magnitude
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `specserve bench-serve`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ReplicaConfig.add_arguments(parser, ["target", "draft", "threads_per_shard"])
    parser.add_argument("--gamma", type=int, default=defaults.DEFAULT_GAMMA, help="γ of the draft-model mode")
    parser.add_argument("--ngram-gamma", type=int, default=8, help="γ of the n-gram mode (0 = no n-gram mode)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds per level, mode order reversed every other (default: 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request, EOS ignored (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", default="4,8,16", help="requests per round and mode, one per concurrency level")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per level; no request starts after")
    parser.add_argument(
        "--batched",
        type=int,
        default=0,
        help="N > 0: measure two deployments, the one-at-a-time replica (speculation off, and at --gamma) and a "
        "batched one with "
        "max_num_seqs N (off, each of --gammas, and the adaptive policy); 0: one deployment, the modes above",
    )
    parser.add_argument("--gammas", default="1,2,3,4", help="with --batched: the fixed γ modes of the batched replica")
    parser.add_argument("--port", type=int, default=8123, help="HTTP port on 127.0.0.1")
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="send completions answered whole (OpenAI's default) instead of streamed: the proxy carries one "
        "answer per request, not one event per step; TTFT is then each request's latency and ITL is not measured",
    )
    add_output_arguments(parser, "bench-serve", "serve_load.json/.md/.png")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The configuration the flags describe; raises :class:`UserError` for a bad value."""
    args.rounds = 4 if args.rounds is None else args.rounds
    args.max_tokens = 128 if args.max_tokens is None else args.max_tokens
    concurrency = number_list(args.concurrency, int, "--concurrency")
    counts = number_list(args.requests, int, "--requests")
    if not concurrency or any(c < 1 for c in concurrency) or len(counts) != len(concurrency):
        raise UserError("--concurrency needs positive integers and --requests one count per concurrency level")
    if any(n < 1 for n in counts) or args.max_tokens < 1 or args.time_limit <= 0 or args.rounds < 1:
        raise UserError("--requests, --max-tokens, --rounds and --time-limit must be positive")
    if not 1 <= args.gamma <= MAX_GAMMA or not 0 <= args.ngram_gamma <= MAX_GAMMA:
        raise UserError(f"--gamma must be between 1 and {MAX_GAMMA} and --ngram-gamma between 0 and {MAX_GAMMA}")
    modes: list[tuple[str, dict[str, Any]]] = [
        ("off", {"enabled": False}),
        (f"draft model γ{args.gamma}", {"drafter": "default", "gamma": args.gamma}),
    ]
    if args.ngram_gamma:
        modes.append((f"n-gram γ{args.ngram_gamma}", {"drafter": "ngram", "gamma": args.ngram_gamma}))
    replicas: tuple[ReplicaSetup, ...] = ()
    if args.batched < 0:
        raise UserError("--batched must be >= 0 (0 = no batched deployment)")
    if args.batched:
        gammas = number_list(args.gammas, int, "--gammas")
        if any(not 1 <= g <= MAX_GAMMA for g in gammas):
            raise UserError(f"--gammas must lie between 1 and {MAX_GAMMA}")
        off: tuple[str, dict[str, Any]] = ("off", {"enabled": False})
        batched_modes = (
            off,
            *((f"γ{g}", {"drafter": "default", "gamma": g}) for g in gammas),
            ("adaptive", {"drafter": "default", "gamma": args.gamma, "policy": "adaptive"}),
        )
        replicas = (
            ReplicaSetup("one-at-a-time", {"max_num_seqs": 1}, (off, (f"γ{args.gamma}", {"gamma": args.gamma}))),
            ReplicaSetup("batched", {"max_num_seqs": args.batched}, batched_modes),
        )
    return LoadConfig(
        target=args.target,
        draft=args.draft,
        modes=tuple(modes),
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        concurrency=tuple(concurrency),
        requests_per_level=tuple(counts),
        level_time_limit_s=args.time_limit,
        port=args.port,
        out_dir=Path(args.out),
        replicas=replicas,
        threads_per_shard=args.threads_per_shard,
        stream=not args.no_stream,
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), report_paths(cfg.out_dir, "serve_load"))
    return 0
