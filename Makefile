PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup test demo clean

setup: .venv/.ready

.venv/.ready: requirements.txt requirements-test.txt pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

test: setup
	$(PY) -m pytest

demo: setup
	$(PY) -m tessel train recipes/hybrid_demo.toml

clean:
	rm -rf .venv runs
