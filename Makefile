# Two commands from a fresh clone: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
RUN    ?= runs/quickstart

.PHONY: demo test test-fast lint docs bench gpu-check clean-venv

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)

# Re-install only when the package metadata changes.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/activate
	$(PIP) install --upgrade --quiet pip
	$(PIP) install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m proteus weights fetch mobilenet_v2
	$(PY) -m proteus quickstart --out $(RUN)
	@# the quickstart is compare's proteus run (same config but report settings): reuse it, not run it again
	@mkdir -p runs/demo-compare/proteus; d=runs/demo-compare/proteus/seed0; \
	    if [ -L $$d ] || [ ! -e $$d ]; then ln -sfn $(abspath $(RUN)) $$d; fi
	@echo "== where each method stands on the quickstart (seed 0; finished runs are reused)"
	$(PY) -m proteus compare --benchmark quickstart --seeds 0 --out runs/demo-compare \
	    --methods proteus,proteus-lda,ranpac,frozen --set report.figures=false --set report.latency=false

# one pytest worker per core (pytest-xdist); a test file runs on one worker (its module fixtures built once),
# the files of end-to-end tests handed out first (tests/conftest.py orders them; xdist would put the files of
# many tests first)
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

test: $(VENV)/.installed
	$(PYTEST)

# the suite without the end-to-end runs marked slow: the loop while developing
test-fast: $(VENV)/.installed
	$(PYTEST) -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests tools
	$(VENV)/bin/ruff format --check src tests tools
	$(VENV)/bin/mypy src/proteus

# the docs site (MkDocs): guides, and references generated from the code; offline, warnings are errors
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: $(VENV)/.installed
	$(PY) tools/perf/run.py --out runs/bench.json

# What a user with a GPU runs first (tools/gpu_check.py); without a GPU it says so and exits 0.
# `make gpu-check SYSTEM_PYTHON=1` uses python3 as it is (an image that already has torch, timm, torchvision
# and scikit-learn, after `python3 -m pip install --no-deps -e .`) instead of creating .venv.
ifeq ($(SYSTEM_PYTHON),1)
gpu-check:
	$(PYTHON) tools/gpu_check.py --out runs/gpu-check.json
else
gpu-check: $(VENV)/.installed
	$(PY) tools/gpu_check.py --out runs/gpu-check.json
endif

clean-venv:
	rm -rf $(VENV)
