# Two commands set everything up on a fresh clone:
#   make serve   - create .venv with what the daemon needs to run and nothing else
#                  (building llama-cpp-python for this CPU compiles llama.cpp: a few
#                  minutes the first time), write the bundled model, start the daemon
#                  on 127.0.0.1:8080
#   make test    - the same environment plus the test tools (the `test` extra:
#                  pytest, client libraries, linters), then the whole test suite
# Needs Python 3.11 or later with its venv module and a C++ toolchain; on Debian or
# Ubuntu: apt install python3-venv python3-dev build-essential cmake. Another
# interpreter: make serve PYTHON=python3.12 (any Python 3.11+).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default native build turns on AMX on these CPUs and segfaults at the first decode.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF
ARGS ?=

.PHONY: serve test test-fast soak bench docs venv clean

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "make: '$(PYTHON) -m venv' failed: on Debian or Ubuntu \
	install python3-venv (apt install python3-venv), or name another Python 3.11+ with PYTHON=..."; exit 1; }
	$(BIN)/pip install --quiet --upgrade pip

# The runtime: pyproject's dependencies only. pip is quiet, so say what the long step is.
$(VENV)/.installed-runtime: pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)" \
	|| echo "Installing llama-cpp-python: this compiles llama.cpp for this CPU and takes a few minutes, with no output until it is done..."
	$(BIN)/pip install --quiet -e .
	touch $@

# An extra (test, bench) on top of the runtime.
$(VENV)/.installed-%: $(VENV)/.installed-runtime
	$(BIN)/pip install --quiet -e '.[$*]'
	touch $@

venv: $(VENV)/.installed-runtime

serve: $(VENV)/.installed-runtime
	$(BIN)/dormouse serve $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -ra --durations=15 $(ARGS)

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -ra -m "not e2e and not reliability" $(ARGS)

# The end-to-end and reliability tests with their long loops at their long counts
# (tests/soak.py: about twice as many rounds; not part of `make test`).
soak: $(VENV)/.installed-test
	DORMOUSE_SOAK=1 $(BIN)/python -m pytest -ra --durations=15 -m "e2e or reliability" $(ARGS)

bench: $(VENV)/.installed-test $(VENV)/.installed-bench
	$(BIN)/python -m bench.report $(ARGS)

# The documentation site (mkdocs.yml, docs/) on http://127.0.0.1:8000, rebuilt on each edit;
# `make docs ARGS=build` writes it to site/ instead.
docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs $(or $(ARGS),serve) --strict

clean:
	rm -rf $(VENV) .pytest_cache site
