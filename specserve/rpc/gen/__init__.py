"""Generated protobuf classes (`make protos`); never edit by hand. Excluded from ruff and mypy."""
