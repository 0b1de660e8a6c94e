# `make demo` and `make test` work from a fresh clone: each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo format-demo test test-newest test-slow test-interop bench gpu-aot lint clean

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

# The suite on Python 3.12 (or newer) with the newest jax, jaxlib and flax that PyPI offers
# (GPU machines ship jax 0.11 and newer), in its own venv; `make test` stays on Python 3.11 and
# jax 0.10.2. PYTHON_NEWEST names the interpreter where none of these is found.
NEWEST_VENV := .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed
PYTHON_NEWEST ?= $(shell for p in python3.13 python3.12 $$(pyenv root 2>/dev/null)/versions/3.1[23]*/bin/python3; do $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)

$(NEWEST_STAMP): pyproject.toml
	@test -n "$(PYTHON_NEWEST)" || { echo "make test-newest needs Python 3.12 or newer: set PYTHON_NEWEST=/path/to/python3.12"; exit 2; }
	test -x $(NEWEST_PY) || $(PYTHON_NEWEST) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	$(NEWEST_PY) -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev]"
	$(NEWEST_PY) -c "import lowbit.core.native as n; n.main()"
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -c "import sys, jax, flax; print('Python', sys.version.split()[0], '| jax', jax.__version__, '| flax', flax.__version__)"
	$(NEWEST_PY) -m pytest -q -n 2 --durations=15

test-slow: $(STAMP)
	LOWBIT_TEST_XLA_OPT=full $(PY) -m pytest -q -m slow

# The interop group: lowbit's imports and exports checked by transformers' PyTorch models, the
# compressed-tensors package and llama.cpp itself (llama-cpp-python, built from source: about
# 10 minutes on 2 cores); CPU torch 2.13.0 first, from this machine's disk.
test-interop: $(STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[interop]"
	$(PY) -m pytest -q -m interop

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/bench_quantize.py

# The Pallas kernels and a training step compiled for a device-less H100 and B200 by XLA's own
# GPU compiler (no GPU needed): registers, spills, shared memory per kernel into
# pallas_kernels/aot_report.md. Its own venv: the CUDA plugin is about 3 GB of wheels, pinned to
# the jax that the project installs.
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q -e .
	$(GPU_PY) -m pip install -q "jax[cuda12]==$$($(GPU_PY) -c 'import jax; print(jax.__version__)')"
	touch $(GPU_STAMP)

gpu-aot: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_PY) -m benchmarks.gpu_aot

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) $(GPU_VENV) $(NEWEST_VENV) .pytest_cache build *.egg-info
