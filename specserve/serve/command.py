"""``specserve serve``: its arguments and entry point — read the Serve config, override host and port, serve.

The serving itself is :mod:`specserve.serve.launch`; the configuration
:class:`~specserve.serve.config.ServeConfig` (the defaults when no ``--config`` is given). Prints
where the API answers and blocks until Ctrl-C. Does not daemonise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="Serve config YAML (as deploy/serve.yaml; default: the default models)")
    parser.add_argument("--host", help="interface for the HTTP proxy (default: the config's, else 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default: the config's, else 8000)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="requests one replica generates at once (default: the config's, else 1 = one at a time); > 1 batches "
        "them, one target forward per step (docs/usage.md#batched-or-one-at-a-time)",
    )
    parser.add_argument(
        "--ray-address",
        help="Ray cluster to join (default: the `specserve cluster up` cluster if running, else a private local one)",
    )


def run_command(args: argparse.Namespace) -> int:
    from specserve.serve.config import ServeConfig
    from specserve.serve.deploy_file import ServeFile, load_serve_file
    from specserve.serve.launch import serving, wait_for_interrupt

    file = load_serve_file(args.config) if args.config else ServeFile(config=ServeConfig())
    if args.host:
        file.host = args.host
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise UserError(f"--port must be between 1 and 65535, got {args.port}")
        file.port = args.port
    if args.max_num_seqs is not None:
        if args.max_num_seqs < 1:
            raise UserError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
        settings = file.config.model_dump()
        settings["max_num_seqs"] = args.max_num_seqs  # Serve must be allowed to send the replica that many
        settings["max_ongoing_requests"] = max(settings["max_ongoing_requests"], args.max_num_seqs)
        file.config = ServeConfig.model_validate(settings)
    if not Path(file.config.target).is_dir():
        raise UserError(f"model directory {file.config.target} does not exist")
    print(f"starting {file.config.model_name!r} (target {file.config.target}) ...", file=sys.stderr, flush=True)
    with serving(file, args.ray_address) as where:
        print(f"specserve: serving {where['model']!r} at {where['url']}  ({where['ray']})", flush=True)
        print(f"  health: {where['health']}", flush=True)
        if where["metrics"]:
            print(f"  Prometheus metrics: {where['metrics']}", flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        wait_for_interrupt()
        print("stopping ...", file=sys.stderr, flush=True)
    print("stopped", file=sys.stderr, flush=True)
    return 0
