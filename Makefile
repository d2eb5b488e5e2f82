# Set-up and the two commands README.md promises. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/pip
PY     := $(VENV)/bin/python
DEMO   ?= demo

.PHONY: setup demo test lint bench completions docs

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The demo's own set-up: the package and transformers, not every test extra (3 GB).
$(VENV)/.demo: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[demo]'
	touch $@

# Writes a real 2-rank FSDP2 checkpoint of a tiny Llama on CPU, then merges it.
demo: $(VENV)/.demo
	rm -rf $(DEMO)
	$(PY) examples/fsdp2_checkpoint.py $(DEMO)/checkpoint-500 --kind llama
	$(VENV)/bin/ckpttool merge $(DEMO)/checkpoint-500 $(DEMO)/merged

# On every core: pytest-xdist's -n auto counts physical cores (2 here; fewer workers than cores
# would leave one idle, more would crowd the gloo ranks that the tests spawn; set
# PYTEST_XDIST_AUTO_NUM_WORKERS to choose). The slow tests start first (tests/conftest.py) and
# an idle worker takes tests queued on a busy one (worksteal), so no long test ends the run alone.
# Fixture writers run once for all workers (tests/fixture_cache.py).
test: setup
	$(PY) -m pytest -q -n auto --dist worksteal

# The guards CI runs beside the tests: ruff, and mypy --strict (configured in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check ckpttool tests benchmarks examples
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/merge.py

completions: setup
	$(PY) -m ckpttool.cli.completions completions

# Rewrite the generated tables in README.md and docs/ from the code, then fail on a stale
# table or a broken link (tests/test_docs.py checks the same).
docs: setup
	$(PY) -m ckpttool.cli.docs
	$(PY) -m ckpttool.cli.docs --check
