# `make demo` and `make test` work from a fresh clone: each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo format-demo test test-slow bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -c "import lowbit.core.native as n; n.main()"
	touch $(STAMP)

# Trains the tiny GPT under six recipes on Shakespeare (fetched once into data_cache/), then
# writes runs/gpt-tiny/compare/curves.png and summary.md; two more seeds of the float run measure
# the noise floor the table's single-seed gaps are judged against. Finished runs are reused.
demo: $(STAMP)
	$(PY) -m experiments.compare --config configs/gpt.py:size=tiny \
		--recipes none,mxfp8,mxfp6,mxfp4,nvfp4,quartet --noise_seeds 1,2

format-demo: $(STAMP)
	$(PY) -m experiments.format_demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --durations=15

test-slow: $(STAMP)
	LOWBIT_TEST_XLA_OPT=full $(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/bench_quantize.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
