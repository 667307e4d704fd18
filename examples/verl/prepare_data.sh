#!/usr/bin/env bash
# Coach prefixes + verl parquet for both arms (GRPO: bare queries; Mesh: one row per query x prefix).
# Runs in meshrl's own environment (no verl needed). UNTESTED ON A GPU MACHINE (the export is tested on CPU).
#
#   TASK=rg:basic_arithmetic COACH_URL=http://127.0.0.1:8000/v1 COACH_MODEL=Qwen/Qwen2.5-7B-Instruct \
#     bash examples/verl/prepare_data.sh data/verl
#
# COACH_BACKEND=rule uses a task's built-in strategies instead of a coach model (tasks that have them).
set -euo pipefail
OUT=${1:-data/verl}
TASK=${TASK:-rg:basic_arithmetic}
M=${M:-4}                    # prefixes per query (the paper's m = 4)
mkdir -p "$OUT"
if [ "${COACH_BACKEND:-openai}" = "rule" ]; then
  meshrl coach --task "$TASK" --backend rule --m "$M" --out "$OUT/prefixes.jsonl"
else
  meshrl coach --task "$TASK" --backend openai --base-url "${COACH_URL:?set COACH_URL}" \
    --model "${COACH_MODEL:?set COACH_MODEL}" --m "$M" --out "$OUT/prefixes.jsonl"
fi
meshrl export verl --task "$TASK" --out "$OUT/grpo"
meshrl export verl --task "$TASK" --prefixes "$OUT/prefixes.jsonl" --m "$M" --out "$OUT/mesh"
