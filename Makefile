# Two commands set everything up on a fresh clone:
#   make serve   - create .venv (building llama-cpp-python for this CPU), write the
#                  bundled model, start the daemon on 127.0.0.1:8080
#   make test    - the same environment plus test tools, then the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default native build turns on AMX on these CPUs and segfaults at the first decode.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF
ARGS ?=

.PHONY: serve test test-fast bench venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[$*]'
	touch $@

venv: $(VENV)/.installed-test

serve: $(VENV)/.installed-test
	$(BIN)/dormouse serve $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -ra --durations=15 $(ARGS)

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -ra -m "not e2e and not reliability" $(ARGS)

bench: $(VENV)/.installed-test $(VENV)/.installed-bench
	$(BIN)/python -m bench.report $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
