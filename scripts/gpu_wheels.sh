#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_check.sh needs on the GPU machine and that it lacks (TRL and datasets with the
# two small packages datasets needs; torch, transformers, accelerate, pyarrow, pandas are there already) into .whl/
# for Python 3.12 on x86-64 (that machine's Python). About 1.8 MB; .whl/ is ignored by git. Needs network.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh .whl
