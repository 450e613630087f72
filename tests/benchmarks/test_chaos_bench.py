"""`specserve bench-chaos`: its flags, its client, its numbers on synthetic timings, and one short real soak.

The flags: defaults, ``--quick`` (changes only what the user left unset), and one clear ``error:`` line for a
bad value. The client against a scripted SSE server: text events, the final usage, error events, a 500, a
stream cut short. The analysis on hand-made timings whose answers are worked out here: outcomes, stalls, each
kill's recovery (a chunk already on its way at the kill is not a recovery), throughput before / during /
after, the targets and the table. Then a real soak on the tiny llama pair in the session's Ray Serve: a few
clients, the drafter killed (SIGKILL) during it; every request completes with its undisturbed text, no HTTP
error, and Ray restarted the drafter. Times are measured, never asserted.
"""

from __future__ import annotations

import argparse
import http.server
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from serve_helpers import quick_shutdown

from specserve import cli
from specserve.benchmarks import chaos, chaos_client, chaos_kill, chaos_report
from specserve.benchmarks.chaos_client import StreamRecord
from specserve.benchmarks.chaos_kill import DRAFTER, SHARD
from specserve.core.errors import UserError


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["bench-chaos"]).parse_args(["bench-chaos", *argv])


# ---------------------------------------------------------------------------------------------
# Flags


def test_defaults_are_the_issues_soak() -> None:
    cfg = chaos.config_from_args(parse())
    assert (cfg.clients, cfg.duration_s, cfg.max_tokens, cfg.num_prompts) == (64, 60.0, 48, 8)
    assert cfg.kills() == [(15.0, DRAFTER), (35.0, SHARD)]
    assert cfg.settings["tp_degree"] == 2 and cfg.settings["max_num_seqs"] == 8
    assert cfg.out_dir == Path("runs/bench-chaos") and cfg.prompts_file is None
    served = chaos.serve_config(cfg)
    assert served.max_queue == 64 and served.max_ongoing_requests == 8 + 64 and served.tp_degree == 2
    assert not served.batches_in_process  # the distributed runtime: a drafter actor and shard actors to kill


def test_quick_changes_only_the_flags_left_unset() -> None:
    quick = chaos.config_from_args(parse("--quick"))
    assert (quick.clients, quick.duration_s, quick.max_tokens) == (8, 20.0, 24)
    assert quick.kills() == [(5.0, DRAFTER), (10.0, SHARD)]
    mine = chaos.config_from_args(parse("--quick", "--clients", "3", "--drafter-kill-at", "0", "--tp", "1"))
    assert (mine.clients, mine.duration_s, mine.kills()) == (3, 20.0, [(10.0, SHARD)])
    assert mine.settings["tp_degree"] == 1 and mine.settings["max_num_seqs"] == 8  # batched in process: no drafter
    assert chaos.config_from_args(parse("--max-num-seqs", "1", "--tp", "1")).settings["max_num_seqs"] == 1
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    assert "a smoke run in about a minute" in " ".join(parser.format_help().split())


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--clients", "0"], "--clients"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--duration", "inf"], "--duration must be > 0"),
        (["--drain-limit", "-1"], "--drain-limit >= 0"),
        (["--drafter-kill-at", "-1"], "--drafter-kill-at must be 0 (no kill) or a time within the soak"),
        (["--shard-kill-at", "60"], "--shard-kill-at must be 0 (no kill) or a time within the soak"),
        (["--quick", "--shard-kill-at", "25"], "0 < t < --duration 20"),
        (["--port", "0"], "--port"),
        (["--tp", "3"], "--tp"),
        (["--tp", "1"], "--drafter-kill-at needs a drafter process"),
    ],
)
def test_a_bad_value_is_one_error_line(
    argv: list[str], words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(chaos, "run", lambda cfg: pytest.fail("a bad value must stop the command before it runs"))
    assert cli.main(["bench-chaos", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and words in captured.err


def test_stdout_carries_the_table_or_one_json_document(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = {"config": {"duration_s": 40.0}, **synthetic_report()}

    def run(cfg: chaos.ChaosConfig) -> dict[str, Any]:
        print("noise from a library")
        return report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(chaos, "run", run)
    assert cli.main(["bench-chaos", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == report and captured.out.count("\n") == 1
    assert "noise from a library" in captured.err and "results: runs/bench-chaos/chaos.json" in captured.err
    assert cli.main(["bench-chaos"]) == 0
    out = capsys.readouterr().out
    assert out == chaos_report.markdown(report) + "results: runs/bench-chaos/chaos.json, chaos.md, chaos.png\n"


# ---------------------------------------------------------------------------------------------
# The client, against a scripted SSE server


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


SCRIPTS: dict[str, tuple[int, bytes]] = {
    "ok": (
        200,
        sse(
            {"choices": [{"text": "ab"}]},
            {"choices": [{"text": ""}]},
            {"choices": [{"text": "cd"}], "usage": {"completion_tokens": 4}},
            b"[DONE]",
        ),
    ),
    "error event": (200, sse({"choices": [{"text": "ab"}]}, {"error": {"message": "boom"}}, b"[DONE]")),
    "500": (500, b'{"error": {"message": "internal"}}'),
    "cut short": (200, sse({"choices": [{"text": "ab"}]})),
}


class Scripted(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, payload = SCRIPTS[body["prompt"]]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def stream(url: str, prompt: str) -> StreamRecord:
    record = StreamRecord(client=0, prompt=0, sent=0.0)
    start = time.perf_counter()
    with requests.Session() as session:
        chaos_client.stream_into(
            session,
            url,
            chaos_client.request_body("m", prompt, 4),
            record,
            lambda: time.perf_counter() - start,
            threading.Event(),
        )
    return record


def test_the_client_records_text_events_the_usage_and_every_kind_of_failure(scripted_url: str) -> None:
    ok = stream(scripted_url, "ok")
    assert ok.completed and ok.text == "abcd" and len(ok.events) == 2 and ok.tokens == 4 and ok.status == 200
    assert ok.ended is not None and ok.ended >= ok.events[-1][0] >= ok.events[0][0] >= 0
    event = stream(scripted_url, "error event")
    assert event.failed and event.error == "boom" and event.error_event and event.server_error
    status = stream(scripted_url, "500")
    assert status.failed and status.status == 500 and status.server_error and not status.events
    short = stream(scripted_url, "cut short")
    assert short.failed and short.error == "the stream ended without [DONE]" and not short.server_error


def test_a_stop_cuts_a_stream_at_its_next_line(scripted_url: str) -> None:
    record = StreamRecord(client=0, prompt=0, sent=0.0)
    stop = threading.Event()
    stop.set()
    with requests.Session() as session:
        chaos_client.stream_into(
            session, scripted_url, chaos_client.request_body("m", "ok", 4), record, time.perf_counter, stop
        )
    assert record.cut and record.unfinished and not record.failed and record.ended is None


# ---------------------------------------------------------------------------------------------
# The kills


def test_the_victims() -> None:
    distributed = {"shards": [101, 102], "drafter": 103}
    assert chaos_kill.victim(distributed, DRAFTER) == (103, "drafter")
    assert chaos_kill.victim(distributed, SHARD) == (102, "shard rank 1")
    assert chaos_kill.victim({"engine": 7}, SHARD) == (7, "engine (the replica's own process)")
    with pytest.raises(UserError, match="no drafter process"):
        chaos_kill.victim({"engine": 7}, DRAFTER)


class Readings:
    """The replica's processes, one answer per read: a dict, or an exception to raise."""

    def __init__(self, *answers: dict[str, Any] | Exception) -> None:
        self.answers = list(answers)
        self.reads = 0

    def __call__(self) -> dict[str, Any]:
        answer = self.answers[min(self.reads, len(self.answers) - 1)]
        self.reads += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def kill_all(
    kills: list[tuple[float, str]], readings: Readings, known: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    signals: list[tuple[int, int]] = []
    done: list[dict[str, Any]] = []
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    chaos_kill.chaos(
        kills, clock, threading.Event(), readings, lambda pid, sig: signals.append((pid, sig)), done, known
    )
    return done, signals


def test_chaos_kills_on_schedule_with_the_replicas_latest_pids() -> None:
    # the second read (at the shard kill) times out, as a status waiting for a restarting drafter does: the reading of
    # the same replica taken at the drafter kill gives the shard's pid
    readings = Readings({"shards": [201, 202], "drafter": 203}, TimeoutError("the drafter is restarting"))
    done, signals = kill_all([(0.05, DRAFTER), (0.1, SHARD)], readings)
    assert signals == [(203, signal.SIGKILL), (202, signal.SIGKILL)] and readings.reads == 2
    assert [(k["kind"], k["pid"], k["role"], k["error"]) for k in done] == [
        (DRAFTER, 203, "drafter", None),
        (SHARD, 202, "shard rank 1", None),
    ]
    assert 0.05 <= done[0]["at_s"] <= done[1]["at_s"] and done[1]["at_s"] >= 0.1


def test_after_a_shard_kill_the_next_kill_waits_for_the_new_replica() -> None:
    old, new = {"shards": [1, 2], "drafter": 3}, {"shards": [4, 5], "drafter": 6}
    readings = Readings(old, RuntimeError("no replica"), RuntimeError("no replica"), new)
    done, signals = kill_all([(0.0, SHARD), (0.01, DRAFTER)], readings, known=old)
    assert signals == [(2, signal.SIGKILL), (6, signal.SIGKILL)] and readings.reads == 4
    assert [k["error"] for k in done] == [None, None]


def test_a_kill_that_cannot_happen_is_recorded_not_raised() -> None:
    done: list[dict[str, Any]] = []
    chaos_kill.chaos(
        [(0.0, DRAFTER)], lambda: 1.0, threading.Event(), lambda: {"engine": 5}, lambda pid, sig: None, done
    )
    assert done[0]["at_s"] is None and "no drafter process" in done[0]["error"]


# ---------------------------------------------------------------------------------------------
# The analysis, on synthetic timings

REFERENCE = "abcde"
MAX_TOKENS = 5
KILLS = [
    {"kind": DRAFTER, "scheduled_s": 10.0, "at_s": 10.0, "pid": 11, "role": "drafter", "error": None},
    {"kind": SHARD, "scheduled_s": 20.0, "at_s": 20.0, "pid": 12, "role": "shard rank 1", "error": None},
]


def rec(
    sent: float,
    times: list[float],
    ended: float | None,
    text: str = REFERENCE,
    tokens: int | None = MAX_TOKENS,
    status: int = 200,
    error: str | None = None,
) -> StreamRecord:
    """A request whose text arrives in ``len(times)`` events: one character each, the last the rest."""
    pieces = [*text[: len(times) - 1], text[len(times) - 1 :]] if times else []
    record = StreamRecord(client=0, prompt=0, sent=sent, events=list(zip(times, pieces, strict=True)), status=status)
    record.tokens, record.ended, record.error = tokens, ended, error
    record.error_event = status == 200 and error is not None
    record.cut = ended is None
    return record


def synthetic_records() -> dict[str, StreamRecord]:
    return {
        # streaming at the drafter kill; the chunk at 10.05 was on its way: it resumed at 11.5
        "A": rec(8.0, [9.0, 9.5, 10.05, 11.5, 12.0], 12.1),
        "B": rec(9.0, [9.8, 12.3, 12.6], 12.7),  # streaming at the drafter kill: resumed at 12.3
        "C": rec(9.5, [13.0, 13.2], 13.3),  # queued at the drafter kill: a first-token wait of 3.5 s
        "D": rec(10.5, [11.0, 13.9], 14.0),  # sent after the drafter kill: the first new completion, 4 s after
        "E": rec(18.0, [19.0, 19.5, 33.0, 33.2], 33.3),  # streaming at the shard kill: a 13.5 s stall
        "F": rec(19.9, [], 20.1, tokens=None, status=503, error="HTTP 503"),  # in flight at the shard kill: a 503
        "G": rec(21.0, [], 22.0, tokens=None, error="boom"),  # an error event
        "H": rec(25.0, [34.0, 34.5], 35.0, text="abcdX"),  # completed, inexact; the longest first-token wait
        "I": rec(26.0, [30.0], None, tokens=None),  # still running at the drain limit
        "J": rec(21.5, [30.0, 35.5], 36.0, tokens=4),  # completed with one token too few
    }


def synthetic_report() -> dict[str, Any]:
    records = list(synthetic_records().values())
    summary = chaos_report.analyse(records, [REFERENCE], KILLS, duration_s=40.0, max_tokens=MAX_TOKENS)
    return {"summary": summary, "kills": KILLS, "requests": [chaos_report.record_json(r, [REFERENCE]) for r in records]}


def test_outcomes_errors_and_stalls() -> None:
    summary = synthetic_report()["summary"]
    assert summary["requests"] == {
        "started": 10,
        "completed": 7,  # A B C D E H J
        "failed": 2,  # F G
        "unfinished": 1,  # I
        "lost": 3,
        "exact": 6,
        "inexact": 1,  # H
        "wrong_token_count": 1,  # J
    }
    assert summary["errors"]["http"] == {"503": 1} and summary["errors"]["error_events"] == 1
    assert summary["fast_500"] == {"requests": 2, "window_s": 1.9}  # F at 20.1 .. G at 22.0
    assert summary["longest_stall_s"] == 13.5  # E
    assert summary["longest_first_token_s"] == 9.0  # H


def test_each_kills_impact_and_recovery() -> None:
    drafter, shard = synthetic_report()["summary"]["kills"]
    assert (drafter["in_flight"], drafter["streaming"], drafter["in_flight_failed"]) == (3, 2, 0)  # A B C; A B
    assert drafter["longest_stall_s"] == drafter["longest_client_stall_s"] == 2.5  # B: 9.8 -> 12.3
    assert drafter["longest_silence_s"] == 0.95  # no text anywhere from 10.05 to 11.0 (13.9 .. 19.0: none in flight)
    assert drafter["longest_first_token_s"] == 3.5  # C
    assert drafter["first_resumed_s"] == 1.5  # A at 11.5, not its chunk on the way at 10.05
    assert drafter["last_resumed_s"] == 2.3  # B at 12.3
    assert drafter["first_new_completion_s"] == 4.0  # D at 14.0
    assert drafter["recovered_at_s"] == 12.3
    assert (shard["in_flight"], shard["streaming"], shard["in_flight_failed"]) == (2, 1, 1)  # E F; E; F
    assert shard["longest_stall_s"] == shard["longest_client_stall_s"] == 13.5
    assert shard["longest_silence_s"] == 10.5  # 19.5 .. 30.0, E in flight throughout
    assert shard["first_resumed_s"] == shard["last_resumed_s"] == 13.0
    assert shard["first_new_completion_s"] == 15.0  # H at 35.0 (completed, if inexact)
    assert shard["recovered_at_s"] == 33.0 and shard["pid"] == 12 and shard["role"] == "shard rank 1"


def test_throughput_spreads_each_requests_tokens_over_its_events() -> None:
    records = list(synthetic_records().values())
    summary = synthetic_report()["summary"]
    bins = summary["bins_tok_s"]
    assert len(bins) == 36  # 0 .. 35.5 in 1 s bins
    assert sum(bins) == pytest.approx(sum(r.tokens or 0 for r in records if r.events), abs=0.2)  # bins: 2 decimals
    assert bins[9] == pytest.approx(5 / 5 * 2 + 5 / 3, abs=0.01)  # A's 9.0 and 9.5, B's 9.8
    throughput = summary["throughput"]
    assert throughput["before"] == {"from_s": 0.0, "to_s": 10.0, "tok_s": round((2 + 5 / 3) / 10, 2)}
    assert (throughput["during"]["from_s"], throughput["during"]["to_s"]) == (10.0, 33.0)  # to the shard's recovery
    assert (throughput["after"]["from_s"], throughput["after"]["to_s"]) == (33.0, 40.0)
    after = 5 / 4 * 2 + 5 / 2 * 2 + 4 / 2 * 1  # E at 33.0 and 33.2, H at 34.0 and 34.5, J at 35.5
    assert throughput["after"]["tok_s"] == round(after / 7, 2)


def test_the_targets_and_the_table() -> None:
    report = synthetic_report()
    verdicts = {row["measure"]: (row["value"], row["met"], row.get("goal_met")) for row in report["summary"]["targets"]}
    assert verdicts == {
        "requests completed": ("7 of 10", False, None),
        "requests with exact tokens (text = the undisturbed answer)": ("6 of 10", False, None),
        "tokens lost or duplicated (inexact or wrong-count requests)": ("2", False, None),
        "longest stall a client saw, drafter kill": ("2.50 s", True, False),
        "longest stall a client saw, shard kill": ("13.50 s", True, None),
        "fast 500s (5xx or error events) and their window": ("2 (1.9 s)", False, None),
    }
    table = chaos_report.markdown(report)
    assert "| longest stall a client saw, drafter kill | 2.50 s | ≤ 5 s (goal ≤ 1 s) | met, goal not met |" in table
    assert "| requests completed | 7 of 10 | 100 % | **not met** |" in table
    assert "| shard rank 1 | 20.0 | 12 | 2 | 1 | 1 | 13.50 | 10.50 | – | 13.00 | 13.00 | 15.00 |" in table
    assert "| during | 10.0 | 33.0 |" in table
    assert "| 10 | 7 | 2 | 1 | 6 | 1 | 1 | 1× 503 | 1 | 13.50 | 9.00 |" in table
    json.dumps(report)  # the report is plain JSON


def test_when_nothing_streams_at_a_kill_the_services_silence_is_the_stall() -> None:
    """Every request in flight at the shard kill still waits for its first token: no mid-stream gap shows the
    outage, but R2's client waited through the 21.1 s in which no stream got text."""
    records = [
        rec(0.0, [1.0, 2.0, 3.0], 3.1),
        rec(3.2, [3.5, 3.9], 3.95),
        rec(2.5, [25.0, 25.5], 26.0),  # R2: queued at the kill, its first token on the new replica
        rec(3.8, [25.2, 26.5], 27.0),
    ]
    kill = {**KILLS[1], "at_s": 4.0}
    summary = chaos_report.analyse(records, [REFERENCE], [kill], duration_s=5.0, max_tokens=MAX_TOKENS)
    (impact,) = summary["kills"]
    assert (impact["in_flight"], impact["streaming"], impact["longest_stall_s"]) == (2, 0, 1.3)
    assert impact["longest_silence_s"] == impact["longest_client_stall_s"] == 21.1
    assert impact["first_resumed_s"] is None and impact["recovered_at_s"] == 25.0  # the service spoke again
    row = next(r for r in summary["targets"] if r["measure"] == "longest stall a client saw, shard kill")
    assert (row["value"], row["met"]) == ("21.10 s", True)


def test_an_undisturbed_soak_meets_every_target_it_measured(tmp_path: Path) -> None:
    records = [rec(0.0, [0.5, 1.0, 1.5], 1.6), rec(0.2, [0.7, 1.1], 1.2)]
    summary = chaos_report.analyse(records, [REFERENCE], [], duration_s=2.0, max_tokens=MAX_TOKENS)
    assert summary["throughput"]["during"] is None and summary["throughput"]["after"] is None
    assert summary["throughput"]["before"] == {"from_s": 0.0, "to_s": 2.0, "tok_s": 5.0}
    rows = {row["measure"]: row for row in summary["targets"]}
    drafter = rows["longest stall a client saw, drafter kill"]
    assert drafter["value"] == "not killed" and drafter["met"] is None
    assert all(row["met"] for row in summary["targets"] if row["met"] is not None)
    report = {"config": {"duration_s": 2.0}, "summary": summary}
    assert "| longest stall a client saw, shard kill | not killed | ≤ 30 s | – |" in chaos_report.markdown(report)
    chaos_report.plot(report, tmp_path / "quiet.png")
    assert (tmp_path / "quiet.png").stat().st_size > 0


def test_a_failed_kill_is_listed_and_measures_nothing(tmp_path: Path) -> None:
    failed = {"kind": SHARD, "scheduled_s": 1.0, "at_s": None, "pid": None, "error": "could not read"}
    summary = chaos_report.analyse(
        [rec(0.0, [0.5, 1.5], 1.6)], [REFERENCE], [failed], duration_s=2.0, max_tokens=MAX_TOKENS
    )
    assert summary["kills"] == [failed] and summary["throughput"]["during"] is None
    report = {"summary": summary}
    assert "| shard | – | – | failed: could not read |" in chaos_report.markdown(report)
    chaos_report.plot({"config": {"duration_s": 2.0}, **synthetic_report()}, tmp_path / "kills.png")
    assert (tmp_path / "kills.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# A real soak: the tiny pair on the session's Ray Serve, the drafter and then a shard killed during it

APP = "chaos-bench"
PREFIX = "/chaos-bench"
PROMPTS = ["abcabcabc", "hello wor", "def f(x): return x"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_short_soak_with_the_drafter_and_a_shard_killed(serve_url: str, long_context_pair: Path) -> None:
    from ray import serve

    from specserve.serve.app import application

    cfg = chaos.ChaosConfig(
        settings={
            "target": str(long_context_pair / "target"),
            "draft": str(long_context_pair / "draft"),
            "dtype": "float64",
            "tp_degree": 2,
            "max_num_seqs": 2,  # the distributed runtime, batching: shard actors and a drafter actor to kill
        },
        clients=4,
        duration_s=8.0,
        max_tokens=24,
        drafter_kill_at_s=2.0,
        shard_kill_at_s=4.0,
        drain_s=120.0,  # the replica's replacement and the resumed requests
    )
    config = chaos.serve_config(cfg)
    serve.run(application(config, quick_shutdown()), name=APP, route_prefix=PREFIX)
    try:
        report = chaos.run_soak(f"{serve_url}{PREFIX}", config.model_name, PROMPTS, cfg, app_name=APP)
    finally:
        serve.delete(APP)
    summary = report["summary"]
    counts = summary["requests"]
    assert counts["started"] >= cfg.clients
    assert counts["completed"] == counts["exact"] == counts["started"], summary["errors"]
    assert counts["wrong_token_count"] == 0 and summary["errors"]["http"] == {}
    assert summary["errors"]["error_events"] == 0 and summary["fast_500"]["requests"] == 0
    assert all(r["outcome"] == "completed" and r["exact"] for r in report["requests"])
    before, after = report["processes"]["before"], report["processes"]["after"]
    assert [(k["kind"], k["pid"], k["error"]) for k in report["kills"]] == [
        (DRAFTER, before["drafter"], None),
        (SHARD, before["shards"][-1], None),
    ]
    assert set(after["shards"]).isdisjoint(before["shards"]) and after["drafter"] != before["drafter"]  # replaced
    assert all(k["in_flight"] >= 1 for k in summary["kills"])
