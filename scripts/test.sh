#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, lint included. Used verbatim by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check src tests benchmarks
python -m pytest -q "$@"
# The CI-sized demo end to end (warm start, three arms, evaluation, report); skipped when pytest args are given.
if [ "$#" -eq 0 ]; then
  demo_out="$(mktemp -d)"
  meshrl demo --quick --out "$demo_out/demo" --no-progress
  test -f "$demo_out/demo/report/index.html"
fi
