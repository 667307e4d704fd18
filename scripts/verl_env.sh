#!/usr/bin/env bash
# Build .venv-verl (verl's own environment) if needed and run the verl integration tests (tests/integration/verl_engine) in it.
#
# verl 0.9.1 pins transformers<5.11 while .venv carries a newer transformers, so verl gets a virtual environment
# of its own. torch==2.13.0 goes first so pip takes the CPU wheel; then verl with the light part of its
# `verl-core` extra that the v1 trainer imports (TransferQueue, pyzmq, msgspec, cachetools, fastapi, uvicorn),
# meshrl's runtime dependencies and pytest; meshrl itself last, --no-deps and editable, which also installs its
# `verl.plugins` entry point (the tests check that `import verl` finds it).
# A stamp file records the requirement set: the environment is rebuilt only when it changes (or is broken).
# Arguments are passed to pytest (default: tests/integration/verl_engine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ENV_DIR=.venv-verl
REQS=(
  "torch==2.13.0"
  "verl==0.9.1" "transformers>=5.5.3,<5.11"
  "TransferQueue>=0.1.10" pyzmq msgspec cachetools fastapi uvicorn
  "numpy>=1.26" "pyyaml>=6" "rich>=13" "safetensors>=0.4" "tokenizers>=0.20" "pyarrow>=19"
  "pytest>=8"
)
STAMP="$ENV_DIR/.meshrl-verl-env"
WANT="${REQS[*]}"
if [ ! -x "$ENV_DIR/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] \
    || ! "$ENV_DIR/bin/python" -c "import verl, meshrl" >/dev/null 2>&1; then
  start=$(date +%s)
  rm -rf "$ENV_DIR"
  "$PY" -m venv "$ENV_DIR"
  # The machine's pip config names index folders that may not exist; pip warns about each on every call.
  pip() { { "$ENV_DIR/bin/python" -m pip install -q "$@" 2>&1; } | { grep -v "^WARNING: Location" || true; }; }
  rm -f "$ENV_DIR/.meshrl-pyproject"
  pip --upgrade pip
  pip "${REQS[0]}"
  pip "${REQS[@]:1}"
  echo "$WANT" > "$STAMP"
  echo "verl_env.sh: built $ENV_DIR in $(( $(date +%s) - start )) s"
fi
# meshrl's metadata (its verl.plugins entry point) follows pyproject.toml: reinstall it when that file changes.
META_STAMP="$ENV_DIR/.meshrl-pyproject"
if [ "$(cat "$META_STAMP" 2>/dev/null)" != "$(sha256sum pyproject.toml)" ]; then
  { "$ENV_DIR/bin/python" -m pip install -q --no-deps -e . 2>&1; } | { grep -v "^WARNING: Location" || true; }
  sha256sum pyproject.toml > "$META_STAMP"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# verl probes for an accelerator at import and warns when it finds none; the tests run on the CPU on purpose.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"
if [ "$#" -eq 0 ]; then set -- tests/integration/verl_engine; fi
"$ENV_DIR/bin/python" -m pytest -q -p no:cacheprovider "$@"
