#!/usr/bin/env bash
# meshrl's trainer against TRL's GRPOTrainer on one GPU (benchmarks/gpu_check.py says what is measured and how), in
# under 8 minutes: Qwen2.5-0.5B-shaped, then 1.5B-shaped while the time allows, bf16 autocast, models built from
# their config. Results: $OUT/gpu_decode.json and $OUT/gpu_check.json (or under runs/, git-ignored) and the tables.
#
# On the GPU machine (no network; torch, transformers, accelerate there; TRL and datasets not): first, here, with
# network, `bash scripts/gpu_wheels.sh` puts their wheels into .whl/ (1.8 MB); carry `.whl` and run
#     bash benchmarks/gpu_check.sh
# meshrl is imported from this tree (src/), not installed. On a CPU: `bash benchmarks/gpu_check.sh --dry-run` (a tiny
# shape, a few seconds; CI runs it in tests/integration/test_gpu_check.py). Extra arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import trl, datasets" >/dev/null 2>&1 && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/meshrl-site .whl/*.whl
  export PYTHONPATH="/tmp/meshrl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# First the decoder alone (benchmarks/gpu_decode.py: dynamic loop against the static decoder and its CUDA graphs,
# tokens/s, bandwidth use, graph = eager bit for bit), then the trainers; a failing decode check does not stop them.
DECODE_ARGS=()
for a in "$@"; do [[ $a == --dry-run ]] && DECODE_ARGS+=(--dry-run); done
timeout 140 "$PY" benchmarks/gpu_decode.py --json "${OUT:-runs}/gpu_decode.json" \
  ${DECODE_ARGS[@]+"${DECODE_ARGS[@]}"} || echo "gpu_decode.py: exit status $?" >&2
timeout 330 "$PY" benchmarks/gpu_check.py --budget-s 300 --json "${OUT:-runs}/gpu_check.json" "$@"
