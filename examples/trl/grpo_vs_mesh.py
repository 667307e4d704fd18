"""GRPO vs Mesh Learning in TRL on a real model, with the MEI monitor on both arms.

UNTESTED ON A GPU: written against trl 1.16.0 and checked on a CPU with a tiny model only
(tests/integration/test_integration_trl.py); see examples/trl/README.md for the exact launch commands.

    python examples/trl/grpo_vs_mesh.py --arm mesh --data runs/trl_data --prefixes prefixes.jsonl \
        --task gsm8k --model Qwen/Qwen2.5-1.5B-Instruct --threshold threshold.json --out runs/trl_mesh

Paper settings (Mesh Learning, arXiv release; docs/scale-out.md): 16 rollouts per query, m = 4 prefixes
in the system prompt, 4 prefix groups of 4 (the ``matched`` budget), advantages per prefix group, mu = 1e-5
(the authors' GRPO launch script uses 5e-5), the GRPO arm with the same 16 rollouts per query.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from meshrl.integrations.trl import MEICallback, MeshGRPOTrainer, MeshOptions
from meshrl.integrations.trl.reward import task_reward_func


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=["grpo", "cp_only", "mesh"], required=True)
    p.add_argument("--data", type=Path, required=True, help="directory written by `meshrl export trl`")
    p.add_argument("--prefixes", type=Path, help="prefix file from `meshrl coach` (cp_only and mesh arms)")
    p.add_argument("--task", required=True, help="the task spec given to `meshrl export trl` (for the reward)")
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threshold", help="MEI threshold: a number or `meshrl mei calibrate` JSON")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--queries-per-step", type=int, default=32, help="per process: batch = queries x 16")
    p.add_argument("--num-generations", type=int, default=16)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--mu", type=float, default=1e-5)
    p.add_argument("--template", choices=["wrapped", "plain"], default="wrapped",
                   help="plain: the bare prefix (tiny character-level models cannot carry the 800-character template)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--max-completion-length", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    p.add_argument("--vllm-mode", choices=["colocate", "server"], default="colocate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="tensorboard", help="tensorboard, wandb, trackio or none")
    p.add_argument("--cpu", action="store_true", help="the CPU size: no vLLM, no bf16 (a tiny model, minutes)")
    return p.parse_args()


def main() -> None:
    a = parse()
    rows = [json.loads(line) for line in (a.data / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    rollouts_per_step = a.queries_per_step * a.num_generations
    if rollouts_per_step % a.micro_batch:
        raise SystemExit(f"--queries-per-step x --num-generations ({rollouts_per_step}) must be a multiple of "
                         f"--micro-batch ({a.micro_batch})")
    device = (dict(use_cpu=True, bf16=False, gradient_checkpointing=False, use_vllm=False) if a.cpu else
              dict(bf16=True, gradient_checkpointing=True, use_vllm=True, vllm_mode=a.vllm_mode,
                   vllm_gpu_memory_utilization=0.35, vllm_enable_sleep_mode=True))
    args = GRPOConfig(
        output_dir=str(a.out), seed=a.seed, max_steps=a.steps, learning_rate=a.lr,
        num_generations=a.num_generations, max_completion_length=a.max_completion_length, temperature=1.0,
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=rollouts_per_step // a.micro_batch,
        beta=0.0, loss_type="grpo", scale_rewards="group", logging_steps=1, save_steps=100,
        report_to=a.report_to, log_completions=False, **device)
    reward = task_reward_func(a.task)
    if a.arm == "grpo":
        trainer = GRPOTrainer(a.model, reward, args=args, train_dataset=dataset)
    else:
        if a.prefixes is None:
            raise SystemExit("--prefixes is required for the cp_only and mesh arms")
        mesh = MeshOptions(m=a.m, placement="system", budget="matched", adv_unit="prefix_group",
                           mu=0.0 if a.arm == "cp_only" else a.mu, subtract_ref=True, template=a.template)
        trainer = MeshGRPOTrainer(a.model, reward, args=args, train_dataset=dataset, prefixes=a.prefixes, mesh=mesh)
    # batch_size=2: the bias features need full logits (rows x completion length x vocab) in one extra forward.
    MEICallback(threshold=a.threshold, every=1, patience=3, on_warning="checkpoint", batch_size=2).attach(trainer)
    trainer.train()


if __name__ == "__main__":
    main()
