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
import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
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
from specserve.benchmarks.tally import report_paths, save_report
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.errors import UserError

if TYPE_CHECKING:
    from specserve.serve.config import ServeConfig

STEM = "chaos"
APP_NAME = "specserve"  # the application serving() deploys (ServeFile's default)
MODEL_NAME = "bench-chaos"
REPLICA_FLAGS = ("target", "draft", "dtype", "device", "tp_degree", "max_num_seqs")
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # the longest a stream may pause: beyond the ingress's resume_timeout_s (60 s by default)
REFERENCE_TIMEOUT_S = 300.0  # a reference request (the first one pays for lazy initialisation)
PROCESSES_LIMIT_S = 60.0  # how long a kill may wait to read the replica's processes (a replica being replaced)
PROCESSES_TIMEOUT_S = 2.0  # one read of them (a replica's status waits for a drafter Ray is restarting)
DRAFTER, SHARD = "drafter", "shard"
STALL_TARGETS_S = {DRAFTER: (5.0, 1.0), SHARD: (30.0, None)}  # (target, goal) for the longest stall at a kill

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


@dataclass
class StreamRecord:
    """What one client saw of one request; times are seconds since the soak started."""

    client: int
    prompt: int  # index into the prompts
    sent: float
    events: list[tuple[float, str]] = field(default_factory=list)  # (arrival, text) of each event carrying text
    status: int | None = None
    error: str | None = None  # an error event, a non-200 answer, a transport error, a stream that ended early
    error_event: bool = False  # the stream carried an error event
    tokens: int | None = None  # completion_tokens of the final event
    ended: float | None = None  # None: still running when the soak was cut
    cut: bool = False  # stopped at the drain limit

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.events)

    @property
    def first(self) -> float | None:
        return self.events[0][0] if self.events else None

    @property
    def unfinished(self) -> bool:
        return self.cut or self.ended is None

    @property
    def failed(self) -> bool:
        return not self.unfinished and (self.error is not None or self.status != 200 or self.tokens is None)

    @property
    def completed(self) -> bool:
        return not self.unfinished and not self.failed

    @property
    def server_error(self) -> bool:
        """A fast 500: a 5xx status, or an error event in the stream."""
        return (self.status is not None and self.status >= 500) or self.error_event

    def gaps(self) -> list[tuple[float, float]]:
        """``(length, end)`` of each pause between consecutive text events."""
        times = [t for t, _ in self.events]
        return [(b - a, b) for a, b in itertools.pairwise(times)]

    @property
    def longest_stall(self) -> float:
        return max((length for length, _ in self.gaps()), default=0.0)

    def in_flight(self, at: float) -> bool:
        return self.sent <= at and (self.ended is None or self.ended > at)

    def streaming(self, at: float) -> bool:
        first = self.first
        return self.in_flight(at) and first is not None and first <= at


# ---------------------------------------------------------------------------------------------
# The client


def request_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def reference_texts(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """Each prompt's answer, undisturbed and not streamed (this also warms the replica up)."""
    texts = []
    for prompt in tqdm(prompts, desc="references", unit="req", file=sys.stderr):
        answer = requests.post(
            f"{url}/v1/completions",
            json=request_body(model, prompt, max_tokens),
            timeout=(CONNECT_TIMEOUT_S, REFERENCE_TIMEOUT_S),
        )
        if answer.status_code != 200:
            raise RuntimeError(f"a reference request failed before any fault: HTTP {answer.status_code}: {answer.text}")
        texts.append(answer.json()["choices"][0]["text"])
    return texts


def stream_into(
    session: requests.Session,
    url: str,
    body: dict[str, Any],
    record: StreamRecord,
    clock: Callable[[], float],
    stop: threading.Event,
) -> None:
    """Stream one completion into ``record``; once ``stop`` is set, cut it (``record.cut``) at its next line."""
    finished = False  # the answer ended, one way or another (else it was cut)
    try:
        with session.post(
            f"{url}/v1/completions",
            json={**body, "stream": True},
            stream=True,
            timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        ) as answer:
            record.status = answer.status_code
            if answer.status_code != 200:
                record.error = f"HTTP {answer.status_code}: {answer.text[:200]}"
                finished = True
                return
            for line in answer.iter_lines():
                now = clock()
                if stop.is_set():
                    return
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    finished = True
                    return
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    record.error_event = True
                    record.error = str(event["error"].get("message"))
                    continue
                text = event["choices"][0].get("text") or ""
                if text:
                    record.events.append((now, text))
                if event.get("usage"):
                    record.tokens = int(event["usage"]["completion_tokens"])
            record.error = record.error or "the stream ended without [DONE]"
            finished = True
    except requests.RequestException as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        finished = not stop.is_set()
    except (ValueError, KeyError, IndexError, TypeError) as exc:  # an event that is not what the API sends
        record.error = f"malformed event: {exc!r}"
        finished = True
    finally:
        if finished:
            record.ended = clock()
        else:
            record.cut = True
            record.error = record.error or "still running at the drain limit"


# ---------------------------------------------------------------------------------------------
# The chaos


def replica_processes(app_name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The process ids of the application's ModelServer replica (``{"shards": [...], "drafter": pid}`` on the
    distributed runtime, ``{"engine": pid}`` batched in process), from its status through the Serve handle."""
    from ray import serve

    from specserve.serve.app import MODEL

    handle = serve.get_deployment_handle(MODEL, app_name=app_name)
    return dict(handle.status.remote().result(timeout_s=timeout_s)["processes"])


def victim(processes: dict[str, Any], kind: str) -> tuple[int, str]:
    """The pid to kill for ``kind`` and what it is: the drafter, or the shard of the last rank (a replica batching in
    process has one process, the engine: its "shard")."""
    if kind == DRAFTER:
        if "drafter" not in processes:
            raise UserError(f"this replica has no drafter process to kill (its processes: {processes})")
        return int(processes["drafter"]), "drafter"
    shards = processes.get("shards")
    if shards:
        return int(shards[-1]), f"shard rank {len(shards) - 1}"
    if "engine" in processes:
        return int(processes["engine"]), "engine (the replica's own process)"
    raise UserError(f"this replica reports no shard process to kill (its processes: {processes})")


def read_processes(
    processes: Callable[[], dict[str, Any]], limit_s: float, stop: threading.Event | None = None
) -> dict[str, Any]:
    """The replica's processes, asking again every half second for up to ``limit_s`` (a replica being replaced has no
    answer yet); raises the last failure after that."""
    give_up = time.monotonic() + limit_s
    while True:
        try:
            return processes()
        except Exception:
            if time.monotonic() > give_up or (stop is not None and stop.is_set()):
                raise
            time.sleep(0.5)


def chaos(
    kills: Sequence[tuple[float, str]],
    clock: Callable[[], float],
    stop: threading.Event,
    processes: Callable[[], dict[str, Any]],
    kill: Callable[[int, int], None],
    done: list[dict[str, Any]],
    known: dict[str, Any] | None = None,
) -> None:
    """At each scheduled time, SIGKILL the victim and append what happened to ``done``.

    The victim's pid comes from the replica's processes read then. When that read fails (a replica's status waits for
    a drafter Ray is restarting), the last reading of the same replica (``known``: taken before the soak, or at an
    earlier kill) stands in, since a replica's pids do not change until it is replaced — except its restarted
    drafter's, which is forgotten when it is killed. After a shard kill the replica is replaced: the next kill waits
    (``PROCESSES_LIMIT_S`` at most) for the new replica's answer."""
    for scheduled, kind in kills:
        if stop.wait(max(0.0, scheduled - clock())):
            return
        entry: dict[str, Any] = {"kind": kind, "scheduled_s": scheduled, "at_s": None, "pid": None, "error": None}
        try:
            try:
                known = processes()
            except Exception:
                if known is None:  # no reading of this replica: wait for one
                    known = read_processes(processes, PROCESSES_LIMIT_S, stop)
            pid, role = victim(known, kind)
            at = clock()
            kill(pid, signal.SIGKILL)
            entry.update(at_s=at, pid=pid, role=role)
        except UserError as exc:
            entry["error"] = str(exc)
        except OSError as exc:
            entry["error"] = f"kill: {exc}"
        except Exception as exc:
            entry["error"] = f"could not read the replica's processes: {exc!r}"
        if kind == SHARD:
            known = None  # Serve replaces the replica: other pids
        elif known is not None:
            known = {name: pid for name, pid in known.items() if name != "drafter"}  # Ray restarts it: another pid
        if entry["error"]:
            tqdm.write(f"[{clock():6.1f} s] {kind} kill failed: {entry['error']}", file=sys.stderr)
        else:
            tqdm.write(f"[{entry['at_s']:6.1f} s] killed the {entry['role']} (pid {entry['pid']})", file=sys.stderr)
        done.append(entry)


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
# Analysis (pure: records in, numbers out)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def resumption(record: StreamRecord, at: float, until: float) -> float | None:
    """When a request streaming at a kill at ``at`` resumed: the end of its longest pause that ends after the kill
    (and by ``until``, the next kill); None when no text came in that time."""
    gaps = [(length, end) for length, end in record.gaps() if at < end <= until]
    return max(gaps)[1] if gaps else None


def silence(records: Sequence[StreamRecord], at: float, until: float) -> tuple[float, float] | None:
    """The longest interval, ending after ``at`` and by ``until``, in which no stream got text while some request was
    in flight throughout (its client waited at least that long, whether or not its first token had come):
    ``(length, end)``, or None when there is none."""
    times = sorted(t for r in records for t, _ in r.events)
    gaps = sorted(((b - a, a, b) for a, b in itertools.pairwise(times) if at < b <= until), reverse=True)
    for length, a, b in gaps:  # the longest first: usually the first one qualifies
        if any(r.sent <= a and (r.ended is None or r.ended >= b) for r in records):
            return length, b
    return None


def kill_impact(records: Sequence[StreamRecord], kill: dict[str, Any], until: float) -> dict[str, Any]:
    """What the requests in flight at one kill saw, and how long until service came back (module docstring)."""
    at = kill["at_s"]
    flying = [r for r in records if r.in_flight(at)]
    streaming = [r for r in flying if r.streaming(at)]
    resumed = [t for t in (resumption(r, at, until) for r in streaming) if t is not None]
    waits = [r.first - r.sent for r in flying if r.first is not None and r.first > at]
    new = [r.ended for r in records if r.sent > at and r.completed and r.ended is not None]
    quiet = silence(records, at, until)
    # pauses of the requests in flight that ended after this kill and by the next (a later kill's pause is its own)
    stall = max((length for r in flying for length, end in r.gaps() if at < end <= until), default=0.0)
    first_resumed = min(resumed) - at if resumed else None
    last_resumed = max(resumed) - at if resumed else None
    first_new = min(new) - at if new else None
    back = [t - at for t in (*resumed, *([quiet[1]] if quiet else []))]  # streams resumed, the service spoke again
    recovery = max(back) if back else first_new
    return {
        **kill,
        "in_flight": len(flying),
        "streaming": len(streaming),
        "in_flight_failed": sum(not r.completed for r in flying),
        "longest_stall_s": _round(stall),
        "longest_silence_s": _round(quiet[0] if quiet else None),
        "longest_client_stall_s": _round(max(stall, quiet[0] if quiet else 0.0)),
        "longest_first_token_s": _round(max(waits, default=None)),
        "first_resumed_s": _round(first_resumed),
        "last_resumed_s": _round(last_resumed),
        "first_new_completion_s": _round(first_new),
        "recovered_at_s": _round(None if recovery is None else at + recovery),
    }


def token_times(records: Sequence[StreamRecord]) -> list[tuple[float, float]]:
    """``(time, tokens)``: each request's completion tokens spread evenly over its text events."""
    out: list[tuple[float, float]] = []
    for r in records:
        if r.tokens and r.events:
            share = r.tokens / len(r.events)
            out.extend((t, share) for t, _ in r.events)
    return out


def bins(samples: Sequence[tuple[float, float]], width: float = 1.0) -> list[float]:
    """Tokens/s in consecutive ``width``-second bins from 0 to the last sample."""
    if not samples:
        return []
    count = max(1, math.ceil(max(t for t, _ in samples) / width + 1e-9))
    out = [0.0] * count
    for t, tokens in samples:
        out[min(count - 1, max(0, int(t // width)))] += tokens
    return [tokens / width for tokens in out]


def window(samples: Sequence[tuple[float, float]], start: float, end: float | None) -> dict[str, Any] | None:
    if end is None or end <= start:
        return None
    tokens = sum(n for t, n in samples if start <= t < end)
    return {"from_s": round(start, 3), "to_s": round(end, 3), "tok_s": round(tokens / (end - start), 2)}


def throughput(
    samples: Sequence[tuple[float, float]], kills: Sequence[dict[str, Any]], duration_s: float
) -> dict[str, Any]:
    """Tokens/s before the first kill, during (first kill → the latest recovery) and after (→ the duration)."""
    landed = [k for k in kills if k.get("at_s") is not None]
    if not landed:
        return {"before": window(samples, 0.0, duration_s), "during": None, "after": None}
    first = landed[0]["at_s"]
    recovered = [k.get("recovered_at_s") for k in landed]
    during_end = duration_s if None in recovered else min(duration_s, max(r for r in recovered if r is not None))
    return {
        "before": window(samples, 0.0, first),
        "during": window(samples, first, during_end),
        "after": window(samples, during_end, duration_s),
    }


def analyse(
    records: Sequence[StreamRecord],
    references: Sequence[str],
    kills: Sequence[dict[str, Any]],
    duration_s: float,
    max_tokens: int,
) -> dict[str, Any]:
    """The report's numbers: requests by outcome, errors, stalls, each kill's impact, throughput, the targets."""
    completed = [r for r in records if r.completed]
    exact = [r for r in completed if r.text == references[r.prompt]]
    wrong_count = [r for r in completed if r.tokens != max_tokens]
    statuses = Counter(str(r.status) for r in records if r.status is not None and r.status != 200)
    server_errors = sorted(r.ended for r in records if r.server_error and r.ended is not None)
    landed = sorted((k for k in kills if k.get("at_s") is not None), key=lambda k: k["at_s"])
    impacts = [
        kill_impact(records, k, landed[i + 1]["at_s"] if i + 1 < len(landed) else math.inf)
        for i, k in enumerate(landed)
    ]
    waits = [r.first - r.sent for r in records if r.first is not None]
    samples = token_times(records)
    summary: dict[str, Any] = {
        "requests": {
            "started": len(records),
            "completed": len(completed),
            "failed": sum(r.failed for r in records),
            "unfinished": sum(r.unfinished for r in records),
            "lost": len(records) - len(completed),
            "exact": len(exact),
            "inexact": len(completed) - len(exact),
            "wrong_token_count": len(wrong_count),
        },
        "errors": {
            "http": dict(sorted(statuses.items())),
            "error_events": sum(r.error_event for r in records),
            "examples": sorted({r.error for r in records if r.error and not r.cut})[:5],
        },
        "fast_500": {
            "requests": len(server_errors),
            "window_s": round(server_errors[-1] - server_errors[0], 3) if server_errors else 0.0,
        },
        "longest_stall_s": _round(max((r.longest_stall for r in records), default=0.0)),
        "longest_first_token_s": _round(max(waits, default=None)),
        "kills": impacts + [k for k in kills if k.get("at_s") is None],  # kills that failed are listed too
        "throughput": throughput(samples, impacts, duration_s),
        "bins_tok_s": [round(b, 2) for b in bins(samples)],
    }
    summary["targets"] = targets(summary)
    return summary


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets beside the measured numbers; ``met`` is None where nothing was measured."""
    req = summary["requests"]
    started = req["started"]
    rows = [
        {
            "measure": "requests completed",
            "value": f"{req['completed']} of {started}",
            "target": "100 %",
            "met": started > 0 and req["completed"] == started,
        },
        {
            "measure": "requests with exact tokens (text = the undisturbed answer)",
            "value": f"{req['exact']} of {started}",
            "target": "100 %",
            "met": started > 0 and req["exact"] == started,
        },
        {
            "measure": "tokens lost or duplicated (inexact or wrong-count requests)",
            "value": str(req["inexact"] + req["wrong_token_count"]),
            "target": "0",
            "met": req["inexact"] + req["wrong_token_count"] == 0,
        },
    ]
    for kind, (limit, goal) in STALL_TARGETS_S.items():
        impact = next((k for k in summary["kills"] if k["kind"] == kind and k.get("at_s") is not None), None)
        wording = f"≤ {limit:g} s" + (f" (goal ≤ {goal:g} s)" if goal is not None else "")
        row: dict[str, Any] = {"measure": f"longest stall a client saw, {kind} kill", "target": wording}
        if impact is None:
            row.update(value="not killed", met=None)
        else:
            stall = impact["longest_client_stall_s"]
            row.update(value=f"{stall:.2f} s", met=stall <= limit)
            if goal is not None:
                row["goal_met"] = stall <= goal
        rows.append(row)
    fast = summary["fast_500"]
    rows.append(
        {
            "measure": "fast 500s (5xx or error events) and their window",
            "value": f"{fast['requests']} ({fast['window_s']:.1f} s)",
            "target": "0",
            "met": fast["requests"] == 0,
        }
    )
    return rows


def record_json(record: StreamRecord, references: Sequence[str]) -> dict[str, Any]:
    return {
        "client": record.client,
        "prompt": record.prompt,
        "sent_s": _round(record.sent),
        "first_s": _round(record.first),
        "ended_s": _round(record.ended),
        "events": len(record.events),
        "tokens": record.tokens,
        "status": record.status,
        "error": record.error,
        "outcome": "completed" if record.completed else "unfinished" if record.unfinished else "failed",
        "exact": record.completed and record.text == references[record.prompt],
        "longest_stall_s": _round(record.longest_stall),
    }


# ---------------------------------------------------------------------------------------------
# Report


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _verdict(row: dict[str, Any]) -> str:
    if row["met"] is None:
        return "–"
    verdict = "met" if row["met"] else "**not met**"
    if "goal_met" in row:
        verdict += ", goal met" if row["goal_met"] else ", goal not met"
    return verdict


def markdown(report: dict[str, Any]) -> str:
    summary = report["summary"]
    lines = ["| measure | measured | target | |", "|---|---|---|---|"]
    lines += [f"| {r['measure']} | {r['value']} | {r['target']} | {_verdict(r)} |" for r in summary["targets"]]
    lines += [
        "",
        "| kill | at s | pid | in flight | streaming | in flight failed | longest stall s | longest silence s "
        "| longest first-token wait s | first resumed s | last resumed s | first new completion s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in summary["kills"]:
        if k.get("at_s") is None:
            lines.append(f"| {k['kind']} | – | – | failed: {k.get('error')} |" + " |" * 8)
            continue
        lines.append(
            f"| {k.get('role', k['kind'])} | {k['at_s']:.1f} | {k['pid']} | {k['in_flight']} | {k['streaming']} "
            f"| {k['in_flight_failed']} | {_s(k['longest_stall_s'])} | {_s(k['longest_silence_s'])} "
            f"| {_s(k['longest_first_token_s'])} "
            f"| {_s(k['first_resumed_s'])} | {_s(k['last_resumed_s'])} | {_s(k['first_new_completion_s'])} |"
        )
    lines += ["", "| throughput | from s | to s | tok/s |", "|---|---|---|---|"]
    for name in ("before", "during", "after"):
        w = summary["throughput"][name]
        if w is not None:
            lines.append(f"| {name} | {w['from_s']:.1f} | {w['to_s']:.1f} | {w['tok_s']:.1f} |")
    req, errors = summary["requests"], summary["errors"]
    lines += [
        "",
        "| started | completed | failed | unfinished | exact | inexact | wrong count | HTTP errors | error events "
        "| longest stall s | longest first-token wait s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {req['started']} | {req['completed']} | {req['failed']} | {req['unfinished']} | {req['exact']} "
        f"| {req['inexact']} | {req['wrong_token_count']} "
        f"| {', '.join(f'{n}× {s}' for s, n in errors['http'].items()) or '0'} | {errors['error_events']} "
        f"| {_s(summary['longest_stall_s'])} | {_s(summary['longest_first_token_s'])} |",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    rates = summary["bins_tok_s"]
    fig, ax = plt.subplots(figsize=(12, 3.8))
    ax.step(range(len(rates) + 1), [*rates, *rates[-1:]], where="post", label="tokens/s (1 s bins)")
    for k in summary["kills"]:
        if k.get("at_s") is None:
            continue
        color = "tab:orange" if k["kind"] == DRAFTER else "tab:red"
        what = k.get("role", k["kind"])
        ax.axvline(k["at_s"], color=color, linestyle="--", label=f"{what} killed")
        if k.get("recovered_at_s") is not None:
            ax.axvspan(k["at_s"], k["recovered_at_s"], color=color, alpha=0.1, label=f"{what}: kill → recovered")
    duration = report.get("config", {}).get("duration_s")
    if duration is not None:
        ax.axvline(duration, color="grey", linestyle=":", label="no request starts after")
    ax.set_xlabel("seconds since the soak started")
    ax.set_ylabel("tokens/s")
    req = summary["requests"]
    ax.set_title(f"{req['completed']} of {req['started']} requests completed, {req['exact']} exact")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def serve_config(cfg: ChaosConfig) -> ServeConfig:
    """The application's configuration: the replica settings, and queues that refuse nothing for capacity."""
    from specserve.serve.config import ServeConfig

    seqs = int(cfg.settings.get("max_num_seqs", 1))
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
