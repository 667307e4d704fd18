"""Run by tests/integration/test_integration_trl.py under ``torchrun --nproc_per_node 2`` (gloo, CPU).

One query's 8 completions are split over the two processes (4 each). Each process computes the gradient
of its own micro-batch loss with the policy term switched off (advantages 0); their mean (what DDP does) must
equal the gradient of ``meshrl.mesh.strategy_balance_loss`` over the whole gathered batch, computed here on
rank 0 with a plain forward; MEI per query and per prefix group likewise. Prints ``TWO-PROCESS OK <max
error>`` on success.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig

from meshrl.diagnostics import bias_features
from meshrl.integrations.trl import MEICallback, MeshGRPOTrainer, MeshOptions
from meshrl.mesh import strategy_balance_loss


def even_length(completions, **kwargs) -> list[float]:
    return [float(len(c[0]["content"]) % 2 == 0) for c in completions]


def main(model_dir: str, data: str, prefixes: str, out_dir: str) -> None:
    rows = [json.loads(line) for line in Path(data).read_text(encoding="utf-8").splitlines()]
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=4, num_generations=8, max_completion_length=6, max_steps=1,
                      report_to=[], seed=0, save_strategy="no")
    mu = 0.5
    trainer = MeshGRPOTrainer(model_dir, even_length, args=args, train_dataset=Dataset.from_list(rows),
                              prefixes=prefixes, mesh=MeshOptions(m=4, template="plain", mu=mu))
    model = trainer.model
    torch.manual_seed(3)  # the same perturbation on both ranks: policy != reference
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.train()
    mei = MEICallback().attach(trainer)
    out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    out["advantages"] = torch.zeros_like(out["advantages"])  # policy gradient 0: only the balancing term
    trainer.current_gradient_accumulation_steps = 1
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(trainer._compute_loss(model, out), params)
    mean = []
    for g in grads:
        g = g.clone()
        dist.all_reduce(g)
        mean.append(g / dist.get_world_size())
    texts = trainer.processing_class.batch_decode(
        [c[m.bool()] for c, m in zip(out["completion_ids"], out["completion_mask"], strict=True)],
        skip_special_tokens=True)
    local = [(out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist(),
              out["completion_ids"][i][out["completion_mask"][i].bool()].tolist(),
              int(out["query_ids"][i]), int(out["strategy_ids"][i]), len(texts[i]) % 2 == 0)
             for i in range(len(texts))]
    every = gather_object(local)
    if dist.get_rank() == 0:
        ref = AutoModelForCausalLM.from_pretrained(model_dir)

        def seq(m, prompt, completion):
            ids = torch.tensor([prompt + completion])
            logp = torch.log_softmax(m(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
            return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).sum()

        s = torch.stack([seq(model, p, c) for p, c, *_ in every])
        with torch.no_grad():
            r = torch.stack([seq(ref, p, c) for p, c, *_ in every])
        loss, _ = strategy_balance_loss(s, r, torch.tensor([x[4] for x in every]), [x[2] for x in every],
                                        [x[3] for x in every], mu)
        expect = torch.autograd.grad(loss, params)
        err = max(float((a - b).abs().max()) for a, b in zip(mean, expect, strict=True))
        scale = max(float(b.abs().max()) for b in expect)
        assert sorted({x[3] for x in every}) == [0, 1, 2, 3] and loss.item() > 0, (every, loss)
        assert err < 2e-5 * max(scale, 1.0), (err, scale)
        with torch.no_grad():  # MEI of the one query over both processes' rows, and per prefix group
            phi = []
            for p, c, *_ in every:
                logits = model(input_ids=torch.tensor([p + c])).logits[:, len(p) - 1:-1]
                phi.append(bias_features(logits, torch.tensor([c]), torch.ones(1, len(c)))[0].double())
        phi = torch.stack(phi)
        want = float(phi.sum(0).square().sum() / phi.square().sum())
        groups = [phi[[i for i, x in enumerate(every) if x[3] == k]] for k in range(4)]
        want_group = sum(float(g.sum(0).square().sum() / g.square().sum()) for g in groups) / 4
        assert abs(mei.last["mei/query"] - want) < 1e-5 * want, (mei.last, want)
        assert abs(mei.last["mei/prefix_group"] - want_group) < 1e-5 * want_group, (mei.last, want_group)
        print(f"TWO-PROCESS OK {err:.2e} (gradient scale {scale:.2e})", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
