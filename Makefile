# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out

.PHONY: setup demo test bench

$(BIN)/forgetful: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m memory.warmup
	touch $@

setup: $(BIN)/forgetful

# The demo's keyed-hash secret lives outside the workspace (as every deployment's must); made once.
DEMO_KEY ?= $(HOME)/.config/forgetful/demo-hash.key

demo: setup
	test -f $(DEMO_KEY) || $(BIN)/forgetful keygen $(DEMO_KEY)
	FORGETFUL_HASH_KEY_FILE=$(DEMO_KEY) $(BIN)/forgetful run --out $(OUT)

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/memory_bench.py
