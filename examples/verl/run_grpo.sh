#!/usr/bin/env bash
# GRPO baseline in verl: bare queries, 16 rollouts each. UNTESTED ON A GPU MACHINE.
#   NGPUS=1 bash examples/verl/run_grpo.sh          # one GPU, Qwen2.5-1.5B-Instruct
#   NGPUS=8 TP=2 MODEL=Qwen/Qwen3-8B bash examples/verl/run_grpo.sh   # one 8-GPU node
# Extra Hydra overrides may follow on the command line.
source "$(dirname "$0")/common.sh"
# MEI for the baseline too: the meshrl trainer mode with balancing off (mu = 0) only adds the MEI metrics.
MEI_ARGS=()
if [ "$MEI_SKETCH" -gt 0 ]; then
  MEI_ARGS=(trainer.v1.trainer_mode=meshrl +meshrl.mu=0 +meshrl.subtract_ref=false +meshrl.mei_sketch="$MEI_SKETCH")
fi
# shellcheck disable=SC2046
python -m verl.trainer.main_ppo $(common_overrides) \
  data.train_files="$DATA/grpo/train.parquet" data.val_files="$DATA/grpo/val.parquet" \
  reward.custom_reward_function.path="$DATA/grpo/reward.py" \
  data.train_batch_size="$QUERIES" actor_rollout_ref.rollout.n="$G" \
  actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_Q" \
  actor_rollout_ref.actor.use_kl_loss=false \
  "${MEI_ARGS[@]}" trainer.experiment_name="grpo-$(basename "$MODEL")" "$@"
