"""``specserve cluster up | down | status``: the arguments and entry point of the local multi-node Ray cluster.

What the cluster is and how it is started and stopped is :mod:`specserve.cluster.local` (reading
its status: :mod:`specserve.cluster.cluster_status`); this only parses the command line and prints
what ``up``, ``down`` and ``status`` report.
"""

from __future__ import annotations

import argparse
import json

from specserve.cluster import cluster_status, local


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="cluster_command", required=True)
    up = actions.add_parser("up", help="start a head (large resource) and workers (cheap resource) on this machine")
    up.add_argument("--workers", type=int, default=2, help="worker nodes beside the head")
    up.add_argument("--large", type=int, default=4, help="units of the 'large' resource on the head (target shards)")
    up.add_argument("--cheap", type=int, default=1, help="units of the 'cheap' resource per worker (drafters)")
    up.add_argument("--port", type=int, default=local.DEFAULT_PORT, help="GCS port of the head (port + 1 is used too)")
    actions.add_parser("down", help="stop the local cluster (only it: other Ray sessions keep running)")
    stat = actions.add_parser("status", help="nodes, resources and actors of the local cluster")
    stat.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run_command(args: argparse.Namespace) -> int:
    if args.cluster_command == "up":
        spec = local.LocalClusterSpec(workers=args.workers, large=args.large, cheap=args.cheap, port=args.port)
        cluster = local.up(spec)
        workers = f"{spec.workers} worker{'s' if spec.workers != 1 else ''} ({spec.cheap_resource}: {spec.cheap} each)"
        print(f"local Ray cluster up at {cluster.address}: head ({spec.large_resource}: {spec.large}) + {workers}")
        print(f"state: {cluster.state_file}; stop it with `specserve cluster down`")
    elif args.cluster_command == "down":
        report = local.down()
        if report.was_running:
            print(f"stopped the local Ray cluster at {report.address} ({report.nodes} nodes)")
        else:
            print(f"the local Ray cluster at {report.address} had already stopped; cleaned up its state")
        if report.killed:
            print(f"needed SIGKILL after the grace: {', '.join(report.killed)}")
    else:
        status = cluster_status.status()
        print(json.dumps(status.to_dict()) if args.json else cluster_status.format_status(status))
    return 0
