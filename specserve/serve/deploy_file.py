"""Reading a Serve config YAML (``deploy/serve.yaml``) the way Ray's ``serve run`` / ``serve deploy`` would.

The file is Ray's own format, checked with Ray's own schema (``ServeDeploySchema``). The one
application whose ``import_path`` is :data:`IMPORT_PATH` is specserve's: its ``args`` must be a
valid :class:`~specserve.serve.config.ServeConfig`, and its ``deployments`` may only name this
application's deployments. ``specserve serve --config`` and the manifest tests use this; Ray's
CLI reads the same file without it. Does not start anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from specserve.core.errors import UserError
from specserve.serve.config import ServeConfig

IMPORT_PATH = "specserve.serve.app:build_app"


class DeployFileError(UserError):
    """A Serve config file that Ray or specserve would refuse; the message says where and why."""


@dataclass
class ServeFile:
    config: ServeConfig
    app_name: str = "specserve"
    route_prefix: str = "/"
    host: str = "127.0.0.1"
    port: int = 8000
    deployment_options: dict[str, dict[str, Any]] = field(default_factory=dict)


def load_serve_file(path: str | Path) -> ServeFile:
    from ray.serve.schema import ServeDeploySchema

    from specserve.serve.app import DEPLOYMENTS  # Ray Serve: imported when a file is read, not for the defaults

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise DeployFileError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise DeployFileError(f"{path} is not valid YAML: {exc}") from exc
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except Exception as exc:  # Ray's schema (pydantic) error: already names the field
        raise DeployFileError(f"{path} is not a valid Serve config: {exc}") from exc
    apps = [app for app in schema.applications if app.import_path == IMPORT_PATH]
    if len(apps) != 1:
        raise DeployFileError(f"{path} must have exactly one application with import_path {IMPORT_PATH!r}")
    app = apps[0]
    try:
        config = ServeConfig.model_validate(app.args or {})
    except ValidationError as exc:
        raise DeployFileError(f"{path}: application {app.name!r} args: {exc}") from exc
    options: dict[str, dict[str, Any]] = {}
    for deployment in app.deployments:
        if deployment.name not in DEPLOYMENTS:
            raise DeployFileError(
                f"{path}: deployment {deployment.name!r} does not exist; this application has {list(DEPLOYMENTS)}"
            )
        options[deployment.name] = deployment.model_dump(exclude_unset=True, exclude={"name"})
    http = schema.http_options
    return ServeFile(
        config=config,
        app_name=app.name,
        route_prefix=app.route_prefix or "/",
        host=http.host or "127.0.0.1",
        port=http.port or 8000,
        deployment_options=options,
    )
