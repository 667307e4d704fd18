#!/usr/bin/env bash
# Mesh Learning in verl: m = 4 coach-prefix rows per query x 4 rollouts (16 per query), strategy balancing with
# mu = MU (default 1e-5, the paper's; the authors' GRPO launch scripts use 5e-5). UNTESTED ON A GPU MACHINE.
#   NGPUS=1 bash examples/verl/run_mesh.sh
#   NGPUS=8 TP=2 MODEL=Qwen/Qwen3-8B MU=5e-5 bash examples/verl/run_mesh.sh
# Needs meshrl installed in verl's environment (pip install "meshrl[verl]"): its entry point registers the
# trainer mode `meshrl` and the `meshrl_*` losses on `import verl` in every Ray worker.
source "$(dirname "$0")/common.sh"
MU=${MU:-1e-5}
ROWS=$(( QUERIES * M )); MINI_ROWS=$(( MINI_Q * M )); N=$(( G / M ))
# shellcheck disable=SC2046
python -m verl.trainer.main_ppo $(common_overrides) \
  data.train_files="$DATA/mesh/train.parquet" data.val_files="$DATA/mesh/val.parquet" \
  reward.custom_reward_function.path="$DATA/mesh/reward.py" \
  data.train_batch_size="$ROWS" data.shuffle=false actor_rollout_ref.rollout.n="$N" \
  actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_ROWS" \
  trainer.v1.trainer_mode=meshrl +meshrl.mu="$MU" +meshrl.subtract_ref=true +meshrl.reduction=mean \
  +meshrl.mei_sketch="$MEI_SKETCH" \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0 \
  trainer.experiment_name="mesh-mu${MU}-$(basename "$MODEL")" "$@"
