# Two commands do all set-up on a fresh machine:
#   make demo   compile an example gpt-oss-20b-shaped MoE layer for the CPU, run it, check it
#   make test   run the test suite (pytest + lit/FileCheck pass tests)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mxmoe-installed

.PHONY: demo test test-all install clean gpu-plans gpu-test

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[torch,test]'
	touch $@

install: $(STAMP)

# The main job: compile the example gpt-oss-20b-shaped layer (random MXFP4 weights) for the CPU into
# one artifact, then run it on random tokens and check it against the reference from its own weights.
demo: $(STAMP)
	mkdir -p build
	$(VENV)/bin/mxmoe compile --preset gpt-oss-20b --target cpu -o build/gpt-oss-20b-layer.mxmoe
	$(VENV)/bin/mxmoe run build/gpt-oss-20b-layer.mxmoe --tokens 4 --check

# Default suite: everything except gpt-oss-sized runs (-m slow) and GPU tests (skip without CUDA). Test files
# spread over the cores (pytest-xdist, one file per worker so a file's compiled fixtures are built once); the
# slowest tests are listed at the end.
PYTEST_PARALLEL ?= -n auto --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_PARALLEL) --durations=15

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=15

# GPU work (docs/nvidia.md "Tests"). The GPU machines here have torch and triton but no IREE, so what the GPU tests and
# benchmarks/gpu_moe.py compile is built on a machine with the compiler (no GPU needed) and carried over as one file:
#   make gpu-plans   (here: kernel bundles, sharded and test artifacts, the tests' modules and templates; ~10 min)
#   make gpu-test    (on the GPU machine, from the repository root with build/gpu_carry.tar.xz: pytest -m gpu)
GPU_PLANS ?= build/gpu_plans
gpu-plans: $(STAMP)
	$(PY) -P benchmarks/gpu_moe.py --build $(GPU_PLANS) --models 'gpt-oss-20b;gpt-oss-120b;16,3,384,320,256'
	$(PY) -P benchmarks/gpu_moe.py --build $(GPU_PLANS) --activations mxfp8 --models 'gpt-oss-20b;8,3,512,352'
	$(PY) -P -c "import sys; sys.path[:0] = ['tests/mxmoe']; import test_distributed as t; t.write_cuda_artifacts('$(GPU_PLANS)')"
	$(VENV)/bin/mxmoe compile --preset tiny --seed 12 --target cuda:sm_90 -o $(GPU_PLANS)/tiny-sm90.mxmoe
	$(PY) -P tests/write_gpu_modules.py $(GPU_PLANS)
	tar cf - $(GPU_PLANS) | xz -T0 > build/gpu_carry.tar.xz

# NVLink multicast off (the lent machines' NCCL cannot use it); PYTHON: the GPU machine's interpreter
PYTHON ?= python
gpu-test: SHELL := /bin/bash
gpu-test:
	tar xJf build/gpu_carry.tar.xz
	. benchmarks/_devpath.sh && PYTHONPATH="$$PYTHONPATH:$(CURDIR)" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
	  NVSHMEM_DISABLE_NVLS=1 MXMOE_GPU_PLANS=$(CURDIR)/$(GPU_PLANS) MXMOE_TEMPLATES=$(CURDIR)/$(GPU_PLANS)/templates \
	  MXMOE_TEST_SM90_ARTIFACT=$(CURDIR)/$(GPU_PLANS)/tiny-sm90.mxmoe \
	  $(PYTHON) -P -m pytest -q -m gpu -p no:cacheprovider -n 8 --dist loadfile -rfEs --durations=10 tests

clean:
	rm -rf $(VENV) build *.egg-info
