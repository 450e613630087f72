"""`specserve bench-chaos`: a bounded soak of the HTTP API with a drafter kill and a target-shard kill during it.

One question: while a steady load runs, what does a client see when a replica's drafter dies, and when
one of its target shards dies — is every request still answered, with exactly the tokens it would have
had, and how long do the streams pause? The issue's targets are printed beside what was measured: 100 %
of requests complete with exact tokens (none lost or duplicated), the longest stall a client saw ≤ 5 s
for a drafter loss (goal ≤ 1 s) and ≤ 30 s for a shard loss, and no fast-500 window.

**How.** :func:`run` deploys the application on loopback (:func:`~specserve.serve.launch.serving`: one
ModelServer replica of ``--tp`` shards batching ``--max-num-seqs`` requests, the shipped pair by
default; ``max_queue`` = ``--clients`` and ``max_ongoing_requests`` = ``max_num_seqs`` + ``--clients``,
so that nothing is refused for capacity). First, one undisturbed non-streamed request per prompt gives
each prompt's reference text (and warms the replica up). Then :func:`run_soak`: ``--clients`` threads
in a closed loop stream greedy completions (``temperature`` 0, ``ignore_eos``: every request generates
``--max-tokens`` tokens), client ``i``'s ``k``-th request on prompt ``(i + k) mod P``; no request starts
after ``--duration``. Meanwhile a chaos thread kills, with ``SIGKILL`` on this machine, the drafter actor
at ``--drafter-kill-at`` and the shard of rank ``tp − 1`` at ``--shard-kill-at`` (seconds after the soak
starts; 0 = no such kill; a replica batching in process has no separate drafter, and its "shard" is the
replica's own process). It takes the pid from the replica's processes, read from its status through the
Serve handle at the kill; when that read fails (the status of a replica whose drafter Ray is restarting
waits for it), from the last reading of the same replica, whose pids stay until it is replaced; after a
shard kill it waits for the new replica's answer. Every kill is logged to stderr with its time, which
may be later than scheduled by that read. Ray restarts a killed drafter and its requests go on without
speculation; a killed shard loses the replica (``ReplicaLost``), Serve replaces it, and the ingress
resumes each request on the new replica from the tokens its client has.

**Per request** the client records the send time, each event carrying text (arrival time and text),
the HTTP status, any error event, and the final ``completion_tokens``. A request **completed** when it
got status 200, no error event, and its final event; **failed** on another status, an error event, a
broken connection or a stream that ended early; **unfinished** when still running at ``--duration`` +
``--drain-limit`` (it is then cut); **lost** = started − completed. **Exact** = completed with the text
of the prompt's reference; **wrong count** = completed with ``completion_tokens`` ≠ ``--max-tokens``
(tokens lost or duplicated would show in one or the other). A **fast 500** is a request that failed
with a 5xx status or an error event (the in-stream form of a 500); the **fast-500 window** spans the
first to the last of them.

**Stalls and recovery.** A request's stalls are the gaps between its consecutive text events after its
first (the wait for a first token, queueing included, is reported apart as the longest first-token
wait). A **silence** is an interval in which no stream got any text while some request was in flight
throughout: its client waited at least that long, before its first token or after (under a saturated
closed loop there is none without a fault). Per kill, over the requests **in flight** at it (sent before
it, not ended): the longest stall and the longest silence that ended after the kill (and by the next
kill); the **longest stall a client saw** — the larger of the two, which the targets judge (a shard
killed while every request in flight still waits for its first token shows in the silence alone); the
longest first-token wait; and the recovery — from the kill to the first and to the last moment a
request that was streaming at the kill (its first token before the kill) resumed, a request's
resumption being the event that ends its longest pause after the kill (by the next kill), so that a
chunk already on its way when the kill landed does not count as recovery; and from the kill to the
first completion of a request sent after it (in a saturated closed loop this includes a whole
request's queueing). A kill's service is back (``recovered_at_s``) when its last streaming request
resumed and its longest silence ended, else at its first new completion. **Throughput** (tokens/s)
before the first kill, during (first kill → the latest kill's recovery) and after (→ ``--duration``):
each request's ``completion_tokens`` are attributed evenly to its text events' arrival times (the
stream carries text, not token counts); the plot shows the same per 1 s bin, with each kill and its
recovery marked.

**Where.** This module holds the configuration, the soak that runs the clients and the killer together
(:func:`run_soak`, :func:`soak`) and the command; the streaming client and its per-request record are
:mod:`~specserve.benchmarks.chaos_client`, the killer :mod:`~specserve.benchmarks.chaos_kill`, and the analysis,
tables and plot :mod:`~specserve.benchmarks.chaos_report`.

Writes ``chaos.json`` (the report: summary, kills, per-request records, bins), ``chaos.md`` and
``chaos.png`` under ``--out`` (default ``runs/bench-chaos/``); stdout carries the table and a
``results:`` line, or with ``--json`` the report alone; progress and kills go to stderr. Bounded in
count and time: every HTTP call has a timeout (a stream may pause ``READ_TIMEOUT_S`` at most), no
request starts after ``--duration``, and ``--drain-limit`` seconds later the requests still running are
cut (at their next event, or when their read times out). Does not: kill anything on another machine
(the kills are signals to local process ids), run more than one replica (the replacement waits for the
lost replica's resources, as on a full cluster), fault the network, the ingress or Ray itself, or
assert anything: BENCHMARKS.md records what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
from tqdm import tqdm

from specserve import defaults
from specserve.benchmarks.arguments import (
    RUNS_DIR,
    Quick,
    add_output_arguments,
    add_prompt_arguments,
    print_results,
    stdout_to_stderr,
)
from specserve.benchmarks.chaos_client import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    StreamRecord,
    reference_texts,
    request_body,
    stream_into,
)
from specserve.benchmarks.chaos_kill import (
    DRAFTER,
    PROCESSES_LIMIT_S,
    PROCESSES_TIMEOUT_S,
    SHARD,
    chaos,
    read_processes,
    replica_processes,
)
from specserve.benchmarks.chaos_report import analyse, markdown, plot, record_json
from specserve.benchmarks.tally import report_paths, save_report
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.errors import UserError

if TYPE_CHECKING:
    from specserve.serve.config import ServeConfig

STEM = "chaos"
APP_NAME = "specserve"  # the application serving() deploys (ServeFile's default)
MODEL_NAME = "bench-chaos"
REPLICA_FLAGS = ("target", "draft", "dtype", "device", "tp_degree", "max_num_seqs")

QUICK = Quick(
    {"clients": 8, "duration": 20.0, "drafter_kill_at": 5.0, "shard_kill_at": 10.0, "max_tokens": 24},
    "8 clients for 20 s, 24 tokens per request, the drafter killed at 5 s and a shard at 10 s",
)


@dataclass(frozen=True)
class ChaosConfig:
    settings: dict[str, Any] = field(
        default_factory=lambda: {
            "target": str(defaults.DEFAULT_TARGET),
            "draft": str(defaults.DEFAULT_DRAFT),
            "tp_degree": 2,
            "max_num_seqs": 8,
        }
    )  # the replica's settings (ServeConfig fields)
    clients: int = 64
    duration_s: float = 60.0  # no request starts after it
    max_tokens: int = 48
    drafter_kill_at_s: float = 15.0  # seconds after the soak starts; 0 = no drafter kill
    shard_kill_at_s: float = 35.0  # 0 = no shard kill
    num_prompts: int = 8
    prompts_file: str | None = None
    drain_s: float = 120.0  # requests still running at duration_s get this long, then are cut
    port: int = 8123
    out_dir: Path = RUNS_DIR / "bench-chaos"

    def kills(self) -> list[tuple[float, str]]:
        """The scheduled kills, ``(seconds after the soak starts, kind)``, in time order."""
        planned = [(self.drafter_kill_at_s, DRAFTER), (self.shard_kill_at_s, SHARD)]
        return sorted((at, kind) for at, kind in planned if at > 0)


# ---------------------------------------------------------------------------------------------
# The soak


def run_soak(
    url: str,
    model: str,
    prompts: Sequence[str],
    cfg: ChaosConfig,
    app_name: str = APP_NAME,
    processes: Callable[[], dict[str, Any]] | None = None,
    kill: Callable[[int, int], None] = os.kill,
) -> dict[str, Any]:
    """References, then the soak with its kills against a running application at ``url`` (its ModelServer's status
    read through ``app_name``, unless ``processes`` is given); the report without the config."""
    read = processes or (lambda: replica_processes(app_name, PROCESSES_TIMEOUT_S))
    references = reference_texts(url, model, prompts, cfg.max_tokens)
    before = read_processes(read, PROCESSES_LIMIT_S)
    records, kills = soak(url, model, prompts, cfg, read, kill, before)
    try:
        after: dict[str, Any] | None = read_processes(read, PROCESSES_LIMIT_S)
    except Exception as exc:  # reported, not fatal: the soak's numbers stand
        tqdm.write(f"could not read the replica's processes after the soak: {exc!r}", file=sys.stderr)
        after = None
    summary = analyse(records, references, kills, cfg.duration_s, cfg.max_tokens)
    return {
        "summary": summary,
        "kills": kills,
        "processes": {"before": before, "after": after},
        "references": [{"prompt": p, "text": t} for p, t in zip(prompts, references, strict=True)],
        "requests": [record_json(r, references) for r in records],
    }


def soak(
    url: str,
    model: str,
    prompts: Sequence[str],
    cfg: ChaosConfig,
    processes: Callable[[], dict[str, Any]],
    kill: Callable[[int, int], None],
    known: dict[str, Any] | None = None,
) -> tuple[list[StreamRecord], list[dict[str, Any]]]:
    """``cfg.clients`` closed-loop streaming clients for ``cfg.duration_s``, the kills meanwhile; every request's
    record and every kill's."""
    records: list[StreamRecord] = []
    kills: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    def client(index: int) -> None:
        with requests.Session() as session:
            for k in itertools.count():
                if clock() >= cfg.duration_s or stop.is_set():
                    return
                which = (index + k) % len(prompts)
                record = StreamRecord(client=index, prompt=which, sent=clock())
                with lock:
                    records.append(record)
                stream_into(session, url, request_body(model, prompts[which], cfg.max_tokens), record, clock, stop)

    threads = [
        threading.Thread(target=client, args=(i,), daemon=True, name=f"chaos-client-{i}") for i in range(cfg.clients)
    ]
    chaos_thread = threading.Thread(
        target=chaos, args=(cfg.kills(), clock, stop, processes, kill, kills, known), daemon=True, name="chaos"
    )
    for thread in [*threads, chaos_thread]:
        thread.start()
    cut_at = cfg.duration_s + cfg.drain_s
    with tqdm(total=round(cfg.duration_s), desc="soak", unit="s", file=sys.stderr) as progress:
        while any(t.is_alive() for t in threads) and clock() < cut_at:
            time.sleep(0.5)
            with lock:
                done = sum(r.completed for r in records)
                bad = sum(r.failed for r in records)
                running = sum(r.ended is None for r in records)
            progress.n = min(progress.total, int(clock()))
            progress.set_postfix(completed=done, failed=bad, in_flight=running, refresh=False)
            progress.refresh()
    stop.set()  # cut what still runs (a stream notices at its next event, or its read timeout)
    deadline = time.monotonic() + READ_TIMEOUT_S + CONNECT_TIMEOUT_S
    for thread in [*threads, chaos_thread]:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    with lock:  # a copy: a stream stuck past the join may still append to its record
        for record in records:
            if record.ended is None:
                record.cut = True
        return [replace(r, events=list(r.events)) for r in records], [dict(k) for k in kills]


# ---------------------------------------------------------------------------------------------


def serve_config(cfg: ChaosConfig) -> ServeConfig:
    """The application's configuration: the replica settings, and queues that refuse nothing for capacity."""
    from specserve.serve.config import SERVE_MAX_NUM_SEQS, ServeConfig

    seqs = int(cfg.settings.get("max_num_seqs", SERVE_MAX_NUM_SEQS))
    return ServeConfig(
        model_name=MODEL_NAME,
        default_max_tokens=cfg.max_tokens,
        max_queue=cfg.clients,  # a closed loop never holds more requests than clients
        max_ongoing_requests=seqs + cfg.clients,  # every client's request reaches the replica (and the status call)
        **cfg.settings,
    )


def soak_prompts(cfg: ChaosConfig) -> list[str]:
    from specserve.benchmarks.prompts import heldout_prompts, load_prompts

    return load_prompts(cfg.prompts_file)[: cfg.num_prompts] if cfg.prompts_file else heldout_prompts(cfg.num_prompts)


def run(cfg: ChaosConfig) -> dict[str, Any]:
    from specserve.serve.deploy_file import ServeFile
    from specserve.serve.launch import serving

    config = serve_config(cfg)
    config.check_local_models()
    prompts = soak_prompts(cfg)
    with serving(ServeFile(config=config, app_name=APP_NAME, port=cfg.port)) as where:
        url = where["url"].removesuffix("/v1")
        body = run_soak(url, config.model_name, prompts, cfg, app_name=APP_NAME)
    report = {"config": {**asdict(cfg), "out_dir": str(cfg.out_dir)}, **body}
    save_report(cfg.out_dir, STEM, report, markdown(report), lambda path: plot(report, path))
    return report


# ---------------------------------------------------------------------------------------------
# `specserve bench-chaos`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ReplicaConfig.add_arguments(parser, [name for name in REPLICA_FLAGS if name != "max_num_seqs"])
    parser.set_defaults(tp_degree=2)
    parser.add_argument(
        "--max-num-seqs",
        dest="max_num_seqs",
        type=int,
        default=8,
        help="requests the replica generates at once (with --tp 1 and more than 1 it batches in process: no drafter "
        "process to kill)",
    )
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (a closed loop)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of soak; no request starts after")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request (greedy, EOS ignored)")
    parser.add_argument(
        "--drafter-kill-at", type=float, default=15.0, help="seconds into the soak to SIGKILL the drafter (0 = never)"
    )
    parser.add_argument(
        "--shard-kill-at",
        type=float,
        default=35.0,
        help="seconds into the soak to SIGKILL the shard of rank tp-1 (0 = never)",
    )
    parser.add_argument(
        "--drain-limit",
        type=float,
        default=120.0,
        help="seconds the requests still running at --duration get to finish; then they are cut (and count as lost)",
    )
    add_prompt_arguments(parser, 8)
    parser.add_argument("--port", type=int, default=8123, help="HTTP port on 127.0.0.1")
    add_output_arguments(parser, "bench-chaos", f"{STEM}.json/.md/.png")
    QUICK.add_argument(parser)


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    """The configuration the flags describe (``--quick`` applied); raises :class:`UserError` for a bad value."""
    QUICK.apply(args)
    if args.clients < 1 or args.max_tokens < 1 or args.num_prompts < 1:
        raise UserError(
            f"--clients, --max-tokens and --num-prompts must be >= 1, got {args.clients}, {args.max_tokens} and "
            f"{args.num_prompts}"
        )
    if not 0 < args.duration < math.inf or not 0 <= args.drain_limit < math.inf:
        raise UserError(f"--duration must be > 0 and --drain-limit >= 0, got {args.duration} and {args.drain_limit}")
    for flag, at in (("--drafter-kill-at", args.drafter_kill_at), ("--shard-kill-at", args.shard_kill_at)):
        if not 0 <= at < args.duration:
            raise UserError(
                f"{flag} must be 0 (no kill) or a time within the soak, 0 < t < --duration {args.duration:g}; "
                f"got {at:g}"
            )
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port must be between 1 and 65535, got {args.port}")
    replica = ReplicaConfig.from_args(args)  # raises InvalidSetting naming the flag
    if args.drafter_kill_at and replica.batches_in_process:
        raise UserError(
            f"--drafter-kill-at needs a drafter process: with --tp 1 and --max-num-seqs {replica.max_num_seqs} the "
            "replica batches in process, its drafter inside it; use --tp 2 or --max-num-seqs 1, or --drafter-kill-at 0"
        )
    return ChaosConfig(
        settings=replica.model_dump(include=set(REPLICA_FLAGS)),
        clients=args.clients,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        drafter_kill_at_s=args.drafter_kill_at,
        shard_kill_at_s=args.shard_kill_at,
        num_prompts=args.num_prompts,
        prompts_file=args.prompts,
        drain_s=args.drain_limit,
        port=args.port,
        out_dir=Path(args.out),
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with stdout_to_stderr():
        report = run(cfg)
    print_results(args, report, markdown(report), report_paths(cfg.out_dir, STEM))
    return 0
