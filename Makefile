# The two set-up commands of the README. Each installs what it needs, idempotently.
SHELL := /bin/bash
VENV := .venv
PYTEST_ARGS ?=
# two pytest-xdist workers, a test file at a time, the files with the most tests first (docs/TESTING.md
# "Suite time"); PYTEST_WORKERS=0 runs serially
PYTEST_WORKERS ?= 2

.PHONY: demo test bench setup clean

demo:
	@bash scripts/setup.sh
	@bash scripts/demo.sh

test:
	@bash scripts/setup.sh --test
	@bash scripts/lint.sh
	@$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench:
	@bash scripts/setup.sh --test
	@for b in tests/bench/bench_*.py; do echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .synapse-venv build *.egg-info .pytest_cache demo-captures
