#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels benchmarks/gpu_suite.py needs on a GPU machine without a package
# index, beside that machine's own torch (which is never carried): tessel's runtime imports (pydantic and its
# core for CPython 3.10-3.13, rich), and torchtitan 0.3.0 with the modules its Llama, parallelize and loss import
# (spmd_types, tyro and tyro's own). Run it here, from the repository root; benchmarks/gpu_carry.txt says the rest.
set -euo pipefail
PIP="${PIP:-python -m pip}"
mkdir -p .whl
$PIP download --no-deps -d .whl/ torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser typeguard \
    typing-extensions pydantic==2.14.3 annotated-types typing-inspection rich==15.0.0 markdown-it-py mdurl pygments \
    torchao==0.18.0
for py in 310 311 312 313; do
    $PIP download --no-deps -d .whl/ --only-binary=:all: --platform manylinux2014_x86_64 \
        --python-version "$py" --implementation cp pydantic_core==2.50.4
done
ls .whl/
