#!/usr/bin/env bash
# GRPO vs Mesh Learning inside TRL, one GPU (Qwen2.5-1.5B-Instruct) or one 8-GPU node (Qwen2.5-7B-Instruct).
# UNTESTED ON A GPU: the pieces run on a CPU with a tiny model in tests/integration/test_integration_trl.py only.
#
#   pip install "meshrl[trl,math]" "trl[vllm]>=1.16,<2"      # trl[vllm] pins vllm>=0.22,<=0.31
#   huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir models/qwen2.5-1.5b
#   COACH_URL=http://127.0.0.1:8000/v1 COACH_MODEL=Qwen/Qwen2.5-72B-Instruct bash examples/trl/launch.sh 1gpu
#
# TASK is any meshrl task spec (README "Training"), e.g. a MATH-style training file:
#   TASK="jsonl:data/math_train.jsonl?problem=problem&answer=answer&kind=math"
set -euo pipefail
SIZE=${1:?usage: launch.sh 1gpu|8gpu}
TASK=${TASK:-gsm8k}
OUT=${OUT:-runs/trl}
case "$SIZE" in
  1gpu) MODEL=${MODEL:-models/qwen2.5-1.5b}; ACCEL=examples/trl/accelerate_1gpu.yaml; QUERIES=${QUERIES:-32} ;;
  8gpu) MODEL=${MODEL:-models/qwen2.5-7b}; ACCEL=examples/trl/accelerate_8gpu_zero3.yaml; QUERIES=${QUERIES:-4} ;;
  *) echo "usage: launch.sh 1gpu|8gpu" >&2; exit 2 ;;
esac
mkdir -p "$OUT"

# 1. Coach prefixes, once, offline (validated, cached; re-running resumes). Any OpenAI-compatible endpoint.
meshrl coach --task "$TASK" --backend openai --base-url "${COACH_URL:?set COACH_URL}" \
  --model "${COACH_MODEL:?set COACH_MODEL}" --m 4 --out "$OUT/prefixes.jsonl"
# 2. The dataset TRL reads: one row per query with its 4 prefixes and ids.
meshrl export trl --task "$TASK" --prefixes "$OUT/prefixes.jsonl" --out "$OUT/data" --m 4
# 3. MEI threshold of the untrained model at the run's G = 16 and temperature 1 (never reuse the paper's 1.013).
meshrl mei calibrate --model "$MODEL" --task "$TASK" --n-queries 64 --group-size 16 --feature bias \
  --max-new-tokens 2048 --temperature 1.0 --device cuda --out "$OUT/threshold.json"
# 4. The two arms at the same 16 rollouts per query (matched budget: Mesh runs 4 prefix groups of 4).
for ARM in grpo mesh; do
  accelerate launch --config_file "$ACCEL" examples/trl/grpo_vs_mesh.py --arm "$ARM" --model "$MODEL" \
    --task "$TASK" --data "$OUT/data" --prefixes "$OUT/prefixes.jsonl" --threshold "$OUT/threshold.json" \
    --queries-per-step "$QUERIES" --num-generations 16 --m 4 --mu 1e-5 --out "$OUT/$ARM"
done
