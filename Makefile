# Two commands do all set-up on a fresh machine:
#   make demo   compile an example gpt-oss-20b-shaped MoE layer for the CPU, run it, check it
#   make test   run the test suite (pytest + lit/FileCheck pass tests)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mxmoe-installed

.PHONY: demo test test-all install clean

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

clean:
	rm -rf $(VENV) build *.egg-info
