"""``specserve serve``: its arguments and entry point — settings from flags over a Serve config, then serve.

Every serving setting has a flag, derived from :class:`~specserve.serve.config.ServeConfig` as
``generate``'s replica flags are (:meth:`ReplicaConfig.add_arguments
<specserve.cluster.replica_config.ReplicaConfig.add_arguments>`: ``--target``, ``--draft``,
``--tp``, ``--max-num-seqs``, ``--gamma``, ...), except ``api_key``: a secret does not belong on
a command line, so it comes from ``$SPECSERVE_API_KEY`` or the YAML. Precedence: a flag given,
else the ``--config`` YAML's value, else the field's default; ``--max-num-seqs`` also raises a
``max_ongoing_requests`` the file sets to fit, unless that is given too. The serving itself is
:mod:`specserve.serve.launch`. Prints where the API answers and blocks until Ctrl-C. Does not
daemonise.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from specserve.core.errors import UserError
from specserve.serve.config import API_KEY_ENV, ServeConfig

if TYPE_CHECKING:  # the module reads Ray's schema: imported when the command runs, not when flags are parsed
    from specserve.serve.deploy_file import ServeFile

# Every ServeConfig field is a flag except these (a secret on a command line shows in `ps` and shell history).
NOT_FLAGS = frozenset({"api_key"})
OVER = "the --config file's"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help="Serve config YAML (as deploy/serve.yaml); the flags below override its values (default: none, every "
        "setting from the flags or their defaults: the shipped models)",
    )
    parser.add_argument(
        "--host",
        default=argparse.SUPPRESS,
        help="interface for the HTTP proxy (default: the config's http_options, else 127.0.0.1)",
    )
    parser.add_argument(
        "--port", type=int, default=argparse.SUPPRESS, help="HTTP port (default: the config's http_options, else 8000)"
    )
    parser.add_argument(
        "--ray-address",
        default=argparse.SUPPRESS,
        help="Ray cluster to join (default: the `specserve cluster up` cluster if running, else a private local one)",
    )
    settings = parser.add_argument_group(
        "serving settings",
        f"the Serve config's args, one flag each (docs/usage.md#replica-settings); the API key is not a flag: set "
        f"${API_KEY_ENV} or api_key in the --config file",
    )
    ServeConfig.add_arguments(settings, [name for name in ServeConfig.model_fields if name not in NOT_FLAGS], OVER)


def run_command(args: argparse.Namespace) -> int:
    file = serve_file(args)
    file.config.check_local_models()  # before Ray starts: a typo costs a second, not a cluster
    return serve_until_interrupted(file, getattr(args, "ray_address", None))


def serve_file(args: argparse.Namespace) -> ServeFile:
    """What to serve: the ``--config`` file (or the defaults) with every flag given put over it."""
    from specserve.serve.deploy_file import ServeFile, load_serve_file

    config_path = getattr(args, "config", None)
    file = load_serve_file(config_path) if config_path else ServeFile(config=ServeConfig())
    gamma_given = "gamma" in file.config.model_fields_set or hasattr(args, "gamma")
    file.config = ServeConfig.from_args(args, base=fitted_settings(file.config, args)).with_suggested_gamma(gamma_given)
    file.host = getattr(args, "host", file.host)
    file.port = checked_port(getattr(args, "port", file.port))
    return file


def fitted_settings(config: ServeConfig, args: argparse.Namespace) -> dict[str, Any]:
    """``config``'s settings, with a ``max_ongoing_requests`` the file sets raised to a ``--max-num-seqs`` given
    without it: Serve must be allowed to send a replica as many requests as it generates at once (0, the default,
    is derived from ``max_num_seqs`` anyway)."""
    settings = config.model_dump()
    wanted = getattr(args, "max_num_seqs", None)
    if isinstance(wanted, int) and settings["max_ongoing_requests"] and not hasattr(args, "max_ongoing_requests"):
        settings["max_ongoing_requests"] = max(settings["max_ongoing_requests"], wanted)
    return settings


def checked_port(port: int) -> int:
    if not 0 < port < 65536:
        raise UserError(f"--port must be between 1 and 65535, got {port}")
    return port


def serve_until_interrupted(file: ServeFile, ray_address: str | None) -> int:
    from specserve.serve.launch import serving, wait_for_interrupt

    config = file.config
    print(f"starting {config.model_name!r} (target {config.target}, draft {config.draft}) ...", file=sys.stderr)
    with serving(file, ray_address, say=lambda line: print(line, file=sys.stderr, flush=True)) as where:
        print(f"specserve: serving {where['model']!r} at {where['url']}  ({where['ray']})", flush=True)
        print(f"  health: {where['health']}", flush=True)
        if where["metrics"]:
            print(f"  Prometheus metrics: {where['metrics']}", flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        wait_for_interrupt()
        print("stopping ...", file=sys.stderr, flush=True)
    print("stopped", file=sys.stderr, flush=True)
    return 0
