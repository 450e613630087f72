"""The analysis of a ``specserve bench-chaos`` soak: its numbers, the issue's targets beside them, the table, the plot.

Pure over what the soak gathered: the clients' records (:class:`~specserve.benchmarks.chaos_client.StreamRecord`),
the reference texts and the kills' records in; requests by outcome (exact, wrong count, lost), errors and the fast-500
window, each kill's impact (the requests in flight at it, the longest stall and silence a client saw, the
recovery), throughput before, during and after the kills (and per 1 s bin), each request's record as JSON, and the
targets, met or not (:func:`analyse`); then :func:`markdown` (the tables) and :func:`plot` (throughput with each
kill and its recovery marked). The measures are defined in :mod:`specserve.benchmarks.chaos`'s docstring. Does not:
run or time anything, talk to the server, kill anything, or write files other than the plot it is given a path for
(:func:`~specserve.benchmarks.tally.save_report` writes the report).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.benchmarks.chaos_client import StreamRecord
from specserve.benchmarks.chaos_kill import DRAFTER, SHARD

STALL_TARGETS_S = {DRAFTER: (5.0, 1.0), SHARD: (30.0, None)}  # (target, goal) for the longest stall at a kill


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
    """What the requests in flight at one kill saw, and how long until service came back (defined in
    :mod:`specserve.benchmarks.chaos`'s docstring)."""
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
