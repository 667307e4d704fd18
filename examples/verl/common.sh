# Shared settings of the GRPO and Mesh launchers (sourced; not run directly). UNTESTED ON A GPU MACHINE.
#
# Budget matched as in the paper: G = 16 rollouts per query. GRPO: one row per query, rollout.n = 16.
# Mesh: m = 4 rows per query (one per coach prefix), rollout.n = 4 each (verl normalises advantages per row,
# i.e. per prefix group, as the authors' release does), strategy balancing with mu from MU.
# Same queries per step and per mini-batch in both arms: the Mesh arm has m times the rows, 1/m the rollouts each.
set -euo pipefail
set -f  # the overrides hold [ ] (Hydra lists): no globbing when they are word-split
DATA=${DATA:-data/verl}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
NGPUS=${NGPUS:-1}                    # 1 (one GPU) or 8 (one node)
TP=${TP:-1}                          # vLLM tensor parallel size (2 for 7B+ models on 8 GPUs)
G=16                                 # rollouts per query (paper)
M=${M:-4}                            # coach prefixes per query (paper)
if [ "$NGPUS" -ge 8 ]; then QUERIES=${QUERIES:-128}; MINI_Q=${MINI_Q:-32}; MICRO=${MICRO:-8}; RESP=${RESP:-4096}
else QUERIES=${QUERIES:-32}; MINI_Q=${MINI_Q:-8}; MICRO=${MICRO:-4}; RESP=${RESP:-2048}; fi
STEPS=${STEPS:-300}
PROJECT=${PROJECT:-meshrl-verl}
MEI_SKETCH=${MEI_SKETCH:-0}          # e.g. 64: log MEI (count-sketched bias features) in both arms; 0 = off

# Overrides common to both arms; the caller adds the arm's data, batch shape and Mesh settings.
common_overrides() {
  echo \
    algorithm.adv_estimator=grpo \
    data.max_prompt_length=2048 data.max_response_length="$RESP" data.filter_overlong_prompts=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$MICRO" \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.actor.policy_loss.loss_mode=meshrl_ppo_clip \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size="$TP" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$MICRO" \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$MICRO" \
    reward.custom_reward_function.name=compute_score \
    trainer.n_gpus_per_node="$NGPUS" trainer.nnodes=1 trainer.total_training_steps="$STEPS" \
    trainer.logger=[console,tensorboard] trainer.project_name="$PROJECT" \
    trainer.val_before_train=true trainer.test_freq=25 trainer.save_freq=100
}
