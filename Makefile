PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test lint demo schema bench-overhead clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check gateway tests loadtest
	$(BIN)/ruff format --check gateway tests loadtest
	$(BIN)/mypy gateway
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check --fix gateway tests loadtest
	$(BIN)/ruff format gateway tests loadtest
	$(BIN)/mypy gateway

schema: $(STAMP)
	$(BIN)/llm-gateway schema > policies/schema.json

demo: $(STAMP)
	$(BIN)/python -m loadtest.demo

bench-overhead: $(STAMP)
	$(BIN)/python -m loadtest.bench_overhead

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
