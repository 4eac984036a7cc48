#!/usr/bin/env bash
# Creates .venv with pinned dependencies. Idempotent; `make` calls it when needed.
set -euo pipefail
TORCH_PIN=""
cd "$(dirname "$0")/.."
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # A machine with a CUDA torch keeps it: the venv sees the system packages.
  python3 -m venv --system-site-packages .venv
else
  python3 -m venv .venv
  # Pinned: on the CPU machines this resolves to a local CPU wheel; plain `torch`
  # would pull gigabytes of CUDA packages.
  TORCH_PIN="torch==2.13.0"
fi
# one resolve for everything: each pip call costs seconds of start-up and index reads
# requirements-test.txt: the optional extras the tests exercise (experiment trackers), not the base install
.venv/bin/pip install -q ${TORCH_PIN:-} -r requirements.txt -r requirements-test.txt
.venv/bin/pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python -c "import torch, tessel; print('tessel ready: torch', torch.__version__)"
