"""The killer of ``specserve bench-chaos``: at each scheduled time, ``SIGKILL`` to the replica's drafter or a shard.

:func:`chaos` waits for each scheduled kill, picks the victim's pid (:func:`victim`: the drafter, or the shard of the
last rank; a replica batching in process offers only its own process) from the replica's processes, read from its
status through the Serve handle (:func:`replica_processes`) or, when that read fails, from the last reading of the
same replica, sends the signal and records what happened (when, which pid and role, or why it failed). The reads
and the signal are passed in, so a test can script both. Does not: kill anything on another machine (the kills are
signals to local process ids), fault the network, the ingress or Ray itself, or measure what a kill did to the
clients (:mod:`specserve.benchmarks.chaos_report`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from specserve.core.errors import UserError

PROCESSES_LIMIT_S = 60.0  # how long a kill may wait to read the replica's processes (a replica being replaced)
PROCESSES_TIMEOUT_S = 2.0  # one read of them (a replica's status waits for a drafter Ray is restarting)
DRAFTER, SHARD = "drafter", "shard"


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
