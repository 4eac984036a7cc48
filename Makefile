PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup test demo clean hf-matrix

setup: .venv/.ready

.venv/.ready: requirements.txt requirements-test.txt pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

# the 15 slowest tests close the log (CI's too: .ci/run runs this), so a test that grows is seen
test: setup
	$(PY) -m pytest --durations=15

# the parity sweep over every cell of the support matrix that tessel's rules accept (minutes to an hour on two
# cores), its record committed, and docs/support.md regenerated from it
hf-matrix: setup
	$(PY) -m tests.hf_matrix.sweep --out docs/support_parity.json
	$(PY) -m tessel support --out docs/support.md

demo: setup
	$(PY) -m tessel train recipes/hybrid_demo.toml

clean:
	rm -rf .venv runs
