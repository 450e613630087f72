# specserve — set-up and everyday commands. Everything lives in a project-local virtualenv (.venv).
#
#   make demo   install everything, then generate with the shipped default models
#   make test   install everything, then lint, type-check and run the whole test suite
#
# torch is installed first and pinned (TORCH_SPEC) so that nothing pulls a multi-GB CUDA build
# on a CPU machine. GPU users: make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PROMPT ?= def parse_args(argv):

export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test lint typecheck pytest bench bench-batch train protos clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/specserve generate --prompt "$(PROMPT)" --max-new-tokens 96

lint: install
	$(BIN)/ruff check specserve tests bench
	$(BIN)/ruff format --check specserve tests bench

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

bench: install
	$(BIN)/specserve bench
	$(BIN)/specserve bench-trees
	$(BIN)/specserve experiment
	$(BIN)/specserve bench-distributed
	$(BIN)/specserve bench-serve
	$(BIN)/specserve bench-batch

# Batched serving in process by concurrency (BENCHMARKS.md §8); ARGS="--concurrency 1,4 --requests 4" for a smoke run.
bench-batch: install
	$(BIN)/specserve bench-batch $(ARGS)

train: install
	$(BIN)/specserve train

# Regenerate the protobuf message classes in specserve/rpc/gen/ from protos/ (checked in; never edit them).
protos: install
	rm -rf build/protos && mkdir -p build/protos
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=build/protos --pyi_out=build/protos \
		protos/specserve/v1/speculation.proto
	cp build/protos/specserve/v1/speculation_pb2.py build/protos/specserve/v1/speculation_pb2.pyi specserve/rpc/gen/

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
