# Two lanes: the main lane is the torch line torch-neuronx 2.9 is built on (with
# torch-xla for real HLO lowering on the CPU); the latest lane keeps us honest on
# current torch. Each venv is created on first use.
PYTHON ?= python3
MAIN_TORCH := torch==2.9.0 torch-xla==2.9.0
LATEST_TORCH := torch==2.13.0
export PJRT_DEVICE ?= CPU
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-latest bench clean

.venv/.installed: setup.cfg pyproject.toml
	test -d .venv || $(PYTHON) -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q $(MAIN_TORCH) -e '.[test]'
	touch $@

.venv-latest/.installed: setup.cfg pyproject.toml
	test -d .venv-latest || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade pip
	.venv-latest/bin/pip install -q $(LATEST_TORCH) -e '.[test]'
	touch $@

demo: .venv/.installed
	.venv/bin/neuron-constrain demo

test: .venv/.installed
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

test-latest: .venv-latest/.installed
	.venv-latest/bin/python -m pytest -q $(PYTEST_ARGS)

bench: .venv/.installed
	.venv/bin/python benchmarks/bench_kernels.py
	.venv/bin/python benchmarks/bench_logit_mask.py
	.venv/bin/python benchmarks/bench_processors.py
	.venv/bin/python benchmarks/bench_taps.py
	.venv/bin/python benchmarks/bench_compile.py
	.venv/bin/python benchmarks/bench_host.py

clean:
	rm -rf .venv .venv-latest build *.egg-info benchmarks/results
