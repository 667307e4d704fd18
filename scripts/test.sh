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
# verl in its own environment (verl 0.9.1 pins transformers<5.11): scripts/verl_env.sh builds .venv-verl once (about
# 1.5 min from scratch on the team machine, reused while its requirements and pyproject.toml are unchanged) and runs
# tests/verl_engine there (about 1-3 min on 2 busy cores). Budget: 10 min for both; MESHRL_SKIP_VERL=1 skips it.
if [ "$#" -eq 0 ] && [ "${MESHRL_SKIP_VERL:-0}" != "1" ]; then
  verl_start=$(date +%s)
  timeout 600 bash scripts/verl_env.sh
  echo "verl step: $(( $(date +%s) - verl_start )) s"
fi
