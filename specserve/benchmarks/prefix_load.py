"""Load benchmark of the prefix cache over HTTP: traffic that resends its history, with the cache off and on.

``specserve bench-serve --workload W`` (W: ``conversations``, ``system-prompt``, ``agent`` or ``prefix`` for all
three). Each workload is a set of *sessions*; a client runs one session at a time, turn after turn (a turn's prompt
is built from the answers before it), and ``c`` clients run concurrently until every session is done:

* **conversations** (:func:`conversations`): 16 chats of 4 turns; turn k's prompt is turn k − 1's, its answer and a
  new user message of about 150 tokens;
* **system-prompt** (:func:`system_prompt`): 32 one-turn requests that share a system prompt of about 600 tokens,
  each with its own 60-token question (measured at 8 and 16 clients);
* **agent** (:func:`agent_loop`): 8 agents of 5 steps; each step resends the trajectory with the last answer and a
  tool's output of about 80 tokens appended.

Every workload runs against deployments with the cache on and off (``no_prefix_cache``), each with the drafters
chosen per request (none, the draft model, suffix) and a deployment whose drafter is the EAGLE head. Each mode and
round sends its own ``cache_salt``, so no mode finds another's entries: a hit is always from the same mode's traffic.
The texts come from held-out standard-library files, cut to token counts with the target's tokenizer; answers are
greedy and stop only at ``max_tokens`` (EOS ignored), so cache off and on do the same work.

Per row: TTFT p50/p99, throughput (completion tokens / wall time), mean accepted length, and the hit rate (prompt
tokens served from the cache / prompt tokens, from each answer's ``usage.prompt_tokens_details.cached_tokens``);
per workload and drafter, cache on over off. Writes ``prefix_load.json``, ``.md`` and ``.png`` under ``--out``.
Does not assert anything: BENCHMARKS.md records what it measured.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specserve import defaults
from specserve.benchmarks.arguments import RUNS_DIR
from specserve.benchmarks.serve_load import RequestTiming, percentile, stream_completion
from specserve.benchmarks.tally import save_report

WORKLOADS = ("conversations", "system-prompt", "agent")
Turn = Callable[[list[str]], str | None]  # the answers so far -> the next prompt, or None when the session ends


@dataclass(frozen=True)
class PrefixLoadConfig:
    target: str = str(defaults.DEFAULT_TARGET)
    draft: str = str(defaults.DEFAULT_DRAFT)
    eagle: str = str(defaults.MODELS_DIR / "eagle")  # the EAGLE deployment's head ("" = no EAGLE deployment)
    workloads: tuple[str, ...] = WORKLOADS
    gamma: int = defaults.DEFAULT_GAMMA
    max_tokens: int = 48  # per answer (EOS ignored)
    rounds: int = 2  # per workload and mode, the order of the modes reversed every other
    scale: float = 1.0  # sessions of each workload (a quick run: fewer)
    warmup_s: float = 20.0
    port: int = 8123
    threads_per_shard: int = 1
    out_dir: Path = RUNS_DIR / "bench-serve"


@dataclass
class Session:
    """One client's sequence of turns."""

    turn: Turn
    answers: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Workloads


class Texts:
    """Held-out text cut to token counts with the target's tokenizer (different text at every call)."""

    def __init__(self, target: str, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        from specserve.benchmarks.prompts import heldout_prompts

        self.tokenizer = AutoTokenizer.from_pretrained(target)
        self.ids: list[int] = []
        for text in heldout_prompts(64):
            self.ids += self.tokenizer.encode(text + "\n", add_special_tokens=False)
        self.rng = random.Random(seed)

    def take(self, tokens: int) -> str:
        start = self.rng.randrange(max(len(self.ids) - tokens, 1))
        return str(self.tokenizer.decode(self.ids[start : start + tokens]))


def conversations(texts: Texts, sessions: int = 16, turns: int = 4, tokens: int = 150) -> list[Session]:
    def chat() -> Turn:
        messages = [texts.take(tokens) for _ in range(turns)]

        def turn(answers: list[str]) -> str | None:
            k = len(answers)
            if k == turns:
                return None
            history = "".join(f"User: {messages[i]}\nAssistant:{answers[i]}\n" for i in range(k))
            return f"{history}User: {messages[k]}\nAssistant:"

        return turn

    return [Session(chat()) for _ in range(sessions)]


def system_prompt(texts: Texts, sessions: int = 32, shared: int = 600, own: int = 60) -> list[Session]:
    system = texts.take(shared)

    def one(question: str) -> Turn:
        return lambda answers: None if answers else f"{system}\nQuestion: {question}\nAnswer:"

    return [Session(one(texts.take(own))) for _ in range(sessions)]


def agent_loop(texts: Texts, sessions: int = 8, steps: int = 5, task: int = 100, tool: int = 80) -> list[Session]:
    def agent() -> Turn:
        goal = texts.take(task)
        outputs = [texts.take(tool) for _ in range(steps)]

        def turn(answers: list[str]) -> str | None:
            if len(answers) == steps:
                return None
            trajectory = "".join(f"Action:{a}\nObservation: {o}\n" for a, o in zip(answers, outputs, strict=False))
            return f"Task: {goal}\n{trajectory}Action:"

        return turn

    return [Session(agent()) for _ in range(sessions)]


def build(workload: str, texts: Texts, scale: float) -> tuple[list[Session], tuple[int, ...]]:
    """A workload's sessions (``scale``: the share of its sessions) and the client counts it runs at."""

    def n(count: int) -> int:
        return max(2, round(count * scale))

    if workload == "conversations":
        return conversations(texts, n(16)), (n(16),)
    if workload == "system-prompt":
        return system_prompt(texts, n(32)), tuple(sorted({n(8), n(16)}))
    if workload == "agent":
        return agent_loop(texts, n(8)), (n(8),)
    raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")


# ---------------------------------------------------------------------------------------------
# Running


def run_sessions(
    url: str, sessions: list[Session], clients: int, body: dict[str, Any], progress: tqdm | None = None
) -> tuple[list[RequestTiming], float]:
    """``clients`` clients take sessions in order and run each to its end; every request's timing, the wall time."""
    lock = threading.Lock()
    pending = list(reversed(sessions))
    timings: list[RequestTiming] = []
    start = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                session = pending.pop()
            while (prompt := session.turn(session.answers)) is not None:
                timing = stream_completion(url, {**body, "prompt": prompt})
                session.answers.append(timing.text)
                with lock:
                    timings.append(timing)
                    if progress is not None:
                        progress.update(1)
                if timing.error is not None:
                    break

    with ThreadPoolExecutor(max_workers=clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return timings, time.perf_counter() - start


def summarise(timings: list[RequestTiming], wall_s: float) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    accepted = [t.mean_accepted_length for t in ok if t.mean_accepted_length is not None]
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "errors_seen": sorted({t.error for t in timings if t.error})[:3],
        "tokens": sum(t.tokens for t in ok),
        "wall_s": wall_s,
        "throughput_tok_s": sum(t.tokens for t in ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "mean_accepted_length": float(np.mean(accepted)) if accepted else None,
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "hit_rate": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
    }


@dataclass(frozen=True)
class Deployment:
    label: str  # "cache on" / "cache off", with the EAGLE deployment's drafter
    settings: dict[str, Any]
    modes: tuple[tuple[str, dict[str, Any]], ...]  # (drafter label, speculation object)


def deployments(cfg: PrefixLoadConfig) -> list[Deployment]:
    gamma = cfg.gamma
    modes = (
        ("none", {"enabled": False}),
        ("draft model", {"drafter": "default", "gamma": gamma}),
        ("suffix", {"drafter": "suffix", "gamma": gamma}),
    )
    out = []
    for cache in ("off", "on"):
        settings: dict[str, Any] = {"no_prefix_cache": cache == "off"}
        out.append(Deployment(f"cache {cache}", {**settings, "draft": cfg.draft}, modes))
        if cfg.eagle:
            eagle = (("EAGLE", {"drafter": "default", "gamma": gamma}),)
            out.append(Deployment(f"cache {cache}", {**settings, "draft": f"eagle:{cfg.eagle}"}, eagle))
    return out


@contextmanager
def deployed(cfg: PrefixLoadConfig, settings: dict[str, Any], clients: int) -> Iterator[str]:
    from specserve.serve.config import ServeConfig
    from specserve.serve.deploy_file import ServeFile
    from specserve.serve.launch import serving

    config = ServeConfig(
        model_name="bench",
        target=cfg.target,
        default_max_tokens=cfg.max_tokens,
        max_num_seqs=16,
        max_ongoing_requests=max(clients, 16),
        max_queue=clients,
        threads_per_shard=cfg.threads_per_shard,
        **settings,
    )
    with serving(ServeFile(config=config, port=cfg.port)) as where:
        yield where["url"].removesuffix("/v1")


def run(cfg: PrefixLoadConfig) -> dict[str, Any]:
    texts = Texts(cfg.target)
    plans = {workload: build(workload, texts, cfg.scale) for workload in cfg.workloads}
    rows: list[dict[str, Any]] = []
    for deployment in deployments(cfg):
        clients = max(max(levels) for _, levels in plans.values())
        with deployed(cfg, deployment.settings, clients) as url:
            body = {"model": "bench", "max_tokens": cfg.max_tokens, "temperature": 0.0, "ignore_eos": True}
            warm_until = time.perf_counter() + cfg.warmup_s
            while time.perf_counter() < warm_until:
                for _, speculation in deployment.modes:
                    stream_completion(url, {**body, "prompt": texts.take(200), "speculation": speculation})
            for workload, (sessions, levels) in plans.items():
                for clients in levels:
                    total = cfg.rounds * len(deployment.modes) * sum(len(_turns(s)) for s in sessions)
                    desc = f"{deployment.label} {workload} c{clients}"
                    pooled: dict[str, tuple[list[RequestTiming], float]] = {}
                    with tqdm(total=total, desc=desc, unit="req", file=sys.stderr) as progress:
                        for round_ in range(cfg.rounds):
                            order = deployment.modes if round_ % 2 == 0 else deployment.modes[::-1]
                            for label, speculation in order:
                                salt = f"{workload}/{clients}/{label}/{round_}"  # no level sees another's entries
                                fresh = [replace(s, answers=[]) for s in sessions]
                                request = {**body, "speculation": speculation, "cache_salt": salt}
                                timings, wall = run_sessions(url, fresh, clients, request, progress)
                                before, before_wall = pooled.get(label, ([], 0.0))
                                pooled[label] = (before + timings, before_wall + wall)
                    for label, (timings, wall) in pooled.items():
                        row = summarise(timings, wall)
                        rows.append(
                            {"workload": workload, "clients": clients, "cache": deployment.label, "drafter": label}
                            | row
                        )
    report = {"config": {**asdict(cfg), "out_dir": str(cfg.out_dir)}, "rows": rows, "comparison": compare(rows)}
    save_report(cfg.out_dir, "prefix_load", report, markdown(report), lambda path: plot(report, path))
    return report


def _turns(session: Session) -> list[str]:
    """The turns a session makes (answers stand in as empty strings: only their number matters)."""
    answers: list[str] = []
    while session.turn(answers) is not None:
        answers.append("")
    return answers


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, clients and drafter: cache on over off (TTFT p50 as off ÷ on: > 1 is faster)."""
    out = []
    for on in rows:
        if on["cache"] != "cache on":
            continue
        key = (on["workload"], on["clients"], on["drafter"])
        off = next(r for r in rows if r["cache"] == "cache off" and (r["workload"], r["clients"], r["drafter"]) == key)
        out.append(
            {
                "workload": on["workload"],
                "clients": on["clients"],
                "drafter": on["drafter"],
                "ttft_p50_on_over_off": _ratio(on["ttft_p50_s"], off["ttft_p50_s"]),
                "throughput_x": _ratio(on["throughput_tok_s"], off["throughput_tok_s"]),
                "accepted_length_x": _ratio(on["mean_accepted_length"], off["mean_accepted_length"]),
                "hit_rate": on["hit_rate"],
            }
        )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| workload | clients | cache | drafter | requests | tok/s | TTFT p50 ms | TTFT p99 ms | mean acc. len "
        "| hit rate | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['workload']} | {r['clients']} | {r['cache']} | {r['drafter']} | {r['requests']} "
            f"| {r['throughput_tok_s']:.1f} | {_f(r['ttft_p50_s'], 0, 1000)} | {_f(r['ttft_p99_s'], 0, 1000)} "
            f"| {_f(r['mean_accepted_length'])} | {100 * r['hit_rate']:.0f}% | {r['errors']} |"
        )
    lines += [
        "",
        "| workload | clients | drafter | TTFT p50 on ÷ off | throughput on ÷ off | acc. len on ÷ off | hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["comparison"]:
        lines.append(
            f"| {c['workload']} | {c['clients']} | {c['drafter']} | {_f(c['ttft_p50_on_over_off'], 3)} "
            f"| {_f(c['throughput_x'])}× | {_f(c['accepted_length_x'], 3)} | {100 * c['hit_rate']:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    groups = list(dict.fromkeys((r["workload"], r["clients"]) for r in rows))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups), 6.4), squeeze=False)
    for column, (workload, clients) in enumerate(groups):
        for row_index, (key, title, scale) in enumerate(
            [("ttft_p50_s", "TTFT p50 (ms)", 1000.0), ("throughput_tok_s", "throughput (tok/s)", 1.0)]
        ):
            ax = axes[row_index][column]
            for offset, cache in ((-0.2, "cache off"), (0.2, "cache on")):
                values = []
                for drafter in drafters:
                    match = [
                        r[key]
                        for r in rows
                        if (r["workload"], r["clients"], r["cache"], r["drafter"])
                        == (workload, clients, cache, drafter)
                    ]
                    values.append(match[0] * scale if match and match[0] is not None else 0.0)
                ax.bar([i + offset for i in range(len(drafters))], values, width=0.4, label=cache)
            ax.set_xticks(range(len(drafters)), drafters, rotation=30, fontsize=8)
            ax.set_title(f"{workload}, {clients} clients: {title}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
