# specserve — set-up and everyday commands. Everything lives in a project-local virtualenv (.venv).
#
#   make demo   install everything, then generate with the shipped default models
#   make test   install everything, then lint, type-check and run the whole test suite
#
# torch is installed first and pinned (TORCH_SPEC) so that nothing pulls a multi-GB CUDA build
# on a CPU machine. GPU users: make install TORCH_INDEX=https://download.pytorch.org/whl/cu128 (this replaces a CPU
# build already installed: the torch step is keyed by TORCH_SPEC and TORCH_INDEX).

PYTHON ?= python3
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PROMPT ?= def parse_args(argv):

export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test lint typecheck pytest bench bench-batch bench-chaos train datastore protos clean

# The torch step is keyed by TORCH_SPEC and TORCH_INDEX: changing either (a CUDA build after a CPU one) reinstalls
# torch, then the rest; pyproject.toml changes reinstall the rest only.
TORCH_KEY := $(shell printf '%s %s' '$(TORCH_SPEC)' '$(TORCH_INDEX)' | cksum | cut -d' ' -f1)
TORCH_STAMP := $(VENV)/.torch-$(TORCH_KEY)

$(TORCH_STAMP):
	@echo "==> [1/2] torch ($(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX), CPU build)) into $(VENV)/: about 1 minute"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar on --force-reinstall "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	rm -f $(VENV)/.torch-* $(VENV)/.installed
	touch $@

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
	@echo "==> [2/2] specserve and its dependencies (transformers, Ray Serve, gRPC, test tools): about 2 minutes"
	$(BIN)/python -m pip install --progress-bar on -e ".[dev]" | { grep -v "^Requirement already satisfied" || true; }
	$(BIN)/python -c "import specserve, torch, transformers, ray; print('==> installed: torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
	touch $@

install: $(VENV)/.installed

# The shipped pair, greedy: the text, then the same request without drafting and the speedup.
demo: install
	$(BIN)/specserve generate --prompt "$(PROMPT)" --max-new-tokens 96 --compare-plain

lint: install
	$(BIN)/ruff check specserve tests bench
	$(BIN)/ruff format --check specserve tests bench

typecheck: install
	$(BIN)/mypy

# Bytecode first: with PYTHONDONTWRITEBYTECODE set, each of the run's ~100 Python processes (Ray workers, CLI runs)
# would compile specserve again, about a second each.
pytest: install
	$(BIN)/python -m compileall -q -j 0 specserve tests
	$(BIN)/python -m pytest -q --durations=60

test: lint typecheck pytest

# The benchmarks behind BENCHMARKS.md, rewriting the checked-in results under bench/results (about two hours on a
# 2-core CPU). Run by hand, each command writes under runs/<command>/ instead; --quick is a one-minute smoke run.
bench: install
	$(BIN)/specserve bench --out bench/results
	$(BIN)/specserve bench-trees --out bench/results
	$(BIN)/specserve experiment --out bench/results/experiment
	$(BIN)/specserve bench-distributed --out bench/results
	$(BIN)/specserve bench-serve --out bench/results
	$(BIN)/specserve bench-batch --out bench/results/batch.json

# Batched serving in process by concurrency (BENCHMARKS.md §8), into bench/results/batch.{json,md,png};
# a smoke run that leaves them alone: .venv/bin/specserve bench-batch --quick (writes runs/bench-batch/).
bench-batch: install
	$(BIN)/specserve bench-batch --out bench/results/batch.json $(ARGS)

# A 60 s soak of the HTTP API, 64 streaming clients, the drafter killed at 15 s and a target shard at 35 s, into
# bench/results/chaos.{json,md,png}; a smoke run that leaves them alone: .venv/bin/specserve bench-chaos --quick.
bench-chaos: install
	$(BIN)/specserve bench-chaos --out bench/results $(ARGS)

train: install
	$(BIN)/specserve train

# The REST drafter's token datastore (--draft rest:runs/datastore/stdlib.rest) over the shipped pair's training corpus:
# the standard library's train split, read from this interpreter (not stored in the repository), with the shipped
# target's tokenizer. About 3M tokens, 23 MiB, 20-30 s on a 2-core CPU. Other text: specserve datastore build --data.
datastore: install
	$(BIN)/specserve datastore build --tokenizer models/target --out runs/datastore/stdlib.rest

# Regenerate the protobuf message classes in specserve/rpc/gen/ from protos/ (checked in; never edit them).
protos: install
	rm -rf build/protos && mkdir -p build/protos
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=build/protos --pyi_out=build/protos \
		protos/specserve/v1/speculation.proto
	cp build/protos/specserve/v1/speculation_pb2.py build/protos/specserve/v1/speculation_pb2.pyi specserve/rpc/gen/

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
