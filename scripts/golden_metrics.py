"""Golden metrics: short tiny-model runs over every recipe, plug-in and speed path, to check that a change to the
trainer changes nothing numerically (metrics, final weights and logged samples, bit for bit).

    PYTHONPATH=OLD_TREE/src python scripts/golden_metrics.py /tmp/before.json
    PYTHONPATH=NEW_TREE/src python scripts/golden_metrics.py /tmp/after.json
    python scripts/golden_metrics.py --compare /tmp/before.json /tmp/after.json    # exit 1 on any difference

Same machine and thread count for both sides (float rounding differs across CPUs). About 2 minutes on 2 cores.
Name cases after the output file to run only those.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def cases(tmp: Path) -> dict[str, list[str]]:
    from meshrl.tasks import load_task

    traces = tmp / "traces.jsonl"
    traces.write_text(
        "".join(
            json.dumps({"id": p.id, "completion": p.answer}) + "\n"
            for p in load_task("tiny:repeat", seed=0).problems("train")
        )
    )
    base = [
        "model=tiny",
        "task=tiny:repeat",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=6",
        "train.micro_batch_size=16",
        "log.progress=false",
        "checkpoint.every=100",
        "optim.lr=1e-3",
        "log.samples_per_step=-1",
    ]
    guided = [
        "model=tiny",
        "task=testbed:add",
        "recipe=cp_only",
        "mesh.m=3",
        "mesh.template=plain",
        "mesh.adv_unit=query",
        "rollout.group_size=12",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=23",
        "plugins.coach_guide.enabled=true",
        "log.progress=false",
        "train.micro_batch_size=48",
        "checkpoint.every=100",
        "optim.lr=1e-3",
        "log.samples_per_step=-1",
    ]
    return {
        "grpo": base,
        "grpo_w1": base + ["train.update_workers=1"],
        "grpo_w2": base + ["train.update_workers=2"],
        "grpo_noskip": base + ["train.skip_zero_advantage=false"],
        "grpo_mb5": base + ["train.micro_batch_size=5"],
        "grpo_noshare": base + ["train.share_prompts=false"],
        "grpo_nopack": base + ["train.pack_responses=false"],
        "dapo": base + ["recipe=dapo"],
        "dr_grpo": base + ["recipe=dr_grpo"],
        "grpo_kl": base + ["recipe=grpo_kl"],
        "grpo_js": base + ["recipe=grpo_js"],
        "grpo_js_exact": base + ["recipe=grpo_js", "algo.js_mode=exact"],
        "gspo": base + ["recipe=gspo"],
        "gspo_token": base + ["recipe=gspo_token"],
        "cispo": base + ["recipe=cispo"],
        "epochs": base + ["train.ppo_epochs=2", "train.mini_batches=2"],
        "clip_cov": base + ["plugins.clip_cov.enabled=true", "plugins.clip_cov.ratio=0.05"],
        "kl_cov": base + ["plugins.kl_cov.enabled=true", "train.ppo_epochs=2", "train.mini_batches=2"],
        "entropy_adv": base + ["plugins.entropy_adv.enabled=true", "algo.policy_loss=cispo"],
        "fork": base + ["plugins.fork.enabled=true"],
        "m2po": base + ["plugins.m2po.enabled=true", "train.ppo_epochs=2"],
        "luffy": base + ["plugins.luffy.enabled=true", f"plugins.luffy.traces={traces}"],
        "distill": base
        + [
            "plugins.distill.enabled=true",
            "plugins.distill.teacher=tiny",
            "plugins.distill.teacher_seed=1",
            "plugins.distill.topk=5",
        ],
        "dpo": base + ["plugins.dpo.enabled=true"],
        "replay": base + ["plugins.replay.reuse_steps=1", "plugins.m2po.enabled=true"],
        "prompt_filter": base + ["plugins.prompt_filter.enabled=true", "plugins.prompt_filter.window=1"],
        "rollout_corr": base + ["plugins.rollout_corr.enabled=true"],
        "lagged_tis": base + ["rollout.max_staleness=2", "rollout.sampler_process=process"],
        "lagged_m2po": base + ["rollout.max_staleness=1", "rollout.staleness_correction=m2po",
                               "rollout.sampler_process=inline"],
        "mesh": base + ["recipe=mesh", "mesh.m=2", "mesh.mu=0.1"],
        "mesh_support": base + ["recipe=mesh", "mesh.balance=support", "mesh.mu=0.5", "mesh.m=2"],
        "cp_only": base + ["recipe=cp_only", "mesh.m=2"],
        "mesh_fork": base + ["recipe=mesh", "mesh.m=2", "mesh.mu=0.1", "plugins.fork.enabled=true"],
        "mesh_replay": base + ["recipe=mesh", "mesh.m=2", "mesh.mu=0.1", "plugins.replay.reuse_steps=1"],
        "mei": base + ["diag.mei.every=1"],
        "mei_w2": base + ["diag.mei.every=1", "train.update_workers=2", "train.ppo_epochs=2"],
        "lora": base + ["train.lora_r=4", "recipe=grpo_kl"],
        "coach_guide": guided,
        "coach_guide_log": guided + ["plugins.coach_guide.shape=log"],
        "testbed_grpo": [
            "model=tiny",
            "task=testbed:add",
            "rollout.group_size=12",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=23",
            "log.progress=false",
            "checkpoint.every=100",
            "optim.lr=1e-3",
            "eval.every=2",
            "eval.n=2",
            "eval.limit=6",
            "log.samples_per_step=-1",
        ],
    }


def run(out: Path, names: list[str]) -> None:
    from meshrl.trainer import load_config, train

    tmp = Path(tempfile.mkdtemp())
    all_cases = cases(tmp)
    res = json.loads(out.read_text()) if out.exists() else {}
    for name in names or list(all_cases):
        run_dir = tmp / name
        hist = train(load_config(overrides=[*all_cases[name], "steps=3"]), run_dir)
        metrics = [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))} for m in hist]
        last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
        res[name] = {
            "metrics": metrics,
            "weights": hashlib.sha256((last / "model.safetensors").read_bytes()).hexdigest(),
            "samples": hashlib.sha256((run_dir / "samples.jsonl").read_bytes()).hexdigest(),
        }
        print(name, "done", flush=True)
    out.write_text(json.dumps(res, indent=1, sort_keys=True, default=str))


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    bad = 0
    for name in a:
        if name not in b:
            print(f"{name}: missing in {b_path}")
            bad += 1
            continue
        for field in ("weights", "samples"):
            if a[name][field] != b[name][field]:
                print(f"{name}: {field} differ")
                bad += 1
        for step, (x, y) in enumerate(zip(a[name]["metrics"], b[name]["metrics"], strict=True)):
            diff = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            if diff:
                print(f"{name} step {step + 1}:", {k: (x.get(k), y.get(k)) for k in diff[:6]})
                bad += 1
    print(f"{len(a)} cases, {bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    run(Path(sys.argv[1]), sys.argv[2:])
