# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/mlp.py

# two pytest workers: the CI machine has two cores, and most of a test is single-threaded Python
test: $(STAMP)
	$(BIN)/ruff check shardsat tests examples benchmarks fuzz
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n 2 tests

lint: $(STAMP)
	$(BIN)/ruff check shardsat tests examples benchmarks fuzz

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

# Random realistic programs planned and checked against jax.jit (fuzz/campaign.py); the report
# lists every failure with its reproducer, `$(BIN)/python -m fuzz --only SEED`.
fuzz: $(STAMP)
	$(BIN)/python -m fuzz --programs 1000 --budget 5400 --out fuzz-report.md

clean:
	rm -rf $(VENV) build *.egg-info
