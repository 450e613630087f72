# specserve — set-up and everyday commands. Everything lives in a project-local virtualenv (.venv).
#
#   make demo   install everything, then generate with the shipped default models
#   make test   install everything, then lint, type-check and run the whole test suite
#
# torch is installed first and pinned (TORCH_SPEC) so that nothing pulls a multi-GB CUDA build
# on a CPU machine. GPU users: make install TORCH_INDEX=https://download.pytorch.org/whl/cu128 (this replaces a CPU
# build already installed: the torch step is keyed by TORCH_SPEC and TORCH_INDEX).
# Everything else comes from the lock, requirements/lock.txt: every runtime and development dependency, transitive
# ones included, at an exact version with its hashes (make lock regenerates it; docs/usage.md#the-lock).

PYTHON ?= python3
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# The installer, pinned like everything it installs.
PIP_SPEC := pip==26.3
PROMPT ?= def parse_args(argv):
LOCK := requirements/lock.txt
# Where `make lock` finds torch's CPU build to resolve torch's own dependencies against (not CUDA's): this machine's
# local wheel if it has one, otherwise PyTorch's CPU index.
LOCK_TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)

export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install lock check-lock demo test test-quick lint typecheck pytest bench bench-batch bench-chaos train datastore protos clean

# The torch step is keyed by TORCH_SPEC and TORCH_INDEX: changing either (a CUDA build after a CPU one) reinstalls
# torch, then the rest; a change of the lock or of pyproject.toml reinstalls the rest only.
TORCH_KEY := $(shell printf '%s %s' '$(TORCH_SPEC)' '$(TORCH_INDEX)' | cksum | cut -d' ' -f1)
TORCH_STAMP := $(VENV)/.torch-$(TORCH_KEY)

# One line per step: pip runs at -qq (errors still shown; its package lists and the mirror's warnings are not).
# VERBOSE=1 shows pip's own output and the commands.
PIP_QUIET := $(if $(VERBOSE),--progress-bar on,-qq)
Q := $(if $(VERBOSE),,@)

$(TORCH_STAMP):
	@echo "==> [1/2] torch ($(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX), CPU build)) into $(VENV)/: about 1 minute"
	$(Q)test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(Q)$(BIN)/python -m pip install -qq "$(PIP_SPEC)"
	$(Q)$(BIN)/python -m pip install $(PIP_QUIET) --force-reinstall "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(Q)rm -f $(VENV)/.torch-* $(VENV)/.installed
	$(Q)touch $@

$(VENV)/.installed: pyproject.toml $(LOCK) $(TORCH_STAMP)
	@echo "==> [2/2] the locked dependencies ($(LOCK): transformers, Ray Serve, gRPC, test tools), then specserve: about 2 minutes"
	$(Q)$(BIN)/python -m pip install $(PIP_QUIET) --require-hashes --no-deps -r $(LOCK)
	$(Q)$(BIN)/python -m pip install -qq --no-deps --no-build-isolation -e .
	$(Q)$(BIN)/python -m pip check > /dev/null || $(BIN)/python -m pip check
	$(Q)$(BIN)/python -c "import specserve, torch, transformers, ray; print('==> installed: torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
	$(Q)touch $@

install: $(VENV)/.installed

# Regenerate the lock from pyproject.toml's ranges and requirements/lock.in (newest releases that fit, for Python 3.11
# on x86-64 Linux, torch's CPU build): an upgrade is its own commit stating the suite's time before and after.
# UPGRADE="--upgrade-package ray" moves one package; the default keeps every pin the ranges still allow.
lock: install
	$(BIN)/uv pip compile pyproject.toml requirements/lock.in --extra dev --constraint <(echo "$(TORCH_SPEC)+cpu") \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 $(LOCK_TORCH_SOURCE) --no-emit-package torch \
		--generate-hashes --no-header --annotation-style line $(UPGRADE) --output-file $(LOCK)

# Does this .venv hold exactly what the lock says (make test runs it too)?
check-lock: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_lock.py

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
#
# Two tiers at once by default (what CI runs; tests/conftest.py marks them): in front, the tests that need Ray (marker
# `ray`), one after the other against one cluster, which alone keep about 60 % of the two cores busy, the rest spent
# waiting on actor starts, restarts and timeouts; beside them, at nice 19, the in-process tests on two xdist workers
# (whole files each, one torch thread each), which take what the Ray tier leaves idle. Ray's own workers keep Ray's
# default niceness (15). Measured from fresh clones: 26:18 and 29:21 against 39:52 for one pytest. SERIAL=1 runs one
# pytest instead. The in-process report follows the Ray tier's. JUNIT=PREFIX writes PREFIX.xml (one pytest), or
# PREFIX-ray.xml and PREFIX-in-process.xml (every test's time). The tiers and their workers share one scratch
# directory (SPECSERVE_TEST_CACHE, removed after): what one process trains for the tests (an EAGLE head per tiny
# target) the others load instead of training it again.
IN_PROCESS_LOG := $(VENV)/pytest-in-process.log
pytest: install
	$(BIN)/python -m compileall -q -j 0 specserve tests
ifdef SERIAL
	$(BIN)/python -m pytest -q --durations=60 $(if $(JUNIT),--junitxml=$(JUNIT).xml)
else
	@echo "==> two tiers at once: the Ray tier here, the in-process tier (nice 19, 2 workers) into $(IN_PROCESS_LOG)"
	@start=$$(date +%s); export SPECSERVE_TEST_CACHE=$$(mktemp -d -t specserve-tests.XXXXXX); \
	nice -n 19 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not ray" -n 2 --dist loadfile --durations=30 \
		$(if $(JUNIT),--junitxml=$(JUNIT)-in-process.xml) > $(IN_PROCESS_LOG) 2>&1 & in_process=$$!; \
	$(BIN)/python -m pytest -q -m ray --durations=30 $(if $(JUNIT),--junitxml=$(JUNIT)-ray.xml); ray=$$?; \
	echo "==> the Ray tier ended after $$(( $$(date +%s) - start )) s"; \
	wait $$in_process; in_process_status=$$?; \
	echo "==> the in-process tier (not ray), ended after $$(( $$(date +%s) - start )) s:"; cat $(IN_PROCESS_LOG); \
	echo "==> both tiers: $$(( $$(date +%s) - start )) s; exit status: Ray tier $$ray, in-process tier $$in_process_status"; \
	rm -rf "$$SPECSERVE_TEST_CACHE"; exit $$(( ray || in_process_status ))
endif

# The edit-test loop (about 5 minutes): the exactness core in process, marker `quick` (tests/conftest.py's QUICK_LOOP):
# acceptance rules, the engines against generate, every drafter's greedy equality, the wire codec, the import order.
test-quick: install
	$(BIN)/python -m compileall -q -j 0 specserve tests
	$(BIN)/python -m pytest -q -m "quick and not ray and not slow" --durations=20

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
