"""meshrl inside TRL: MeshGRPOTrainer, MEICallback and `meshrl export trl` on a tiny offline model (CPU).

The Mesh and MEI numbers are checked against meshrl.mesh / meshrl.diagnostics evaluated on log-probs and
logits from a plain transformers forward, not from TRL's fused head.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from meshrl.diagnostics import bias_features  # noqa: E402
from meshrl.export.trl import add_export_parser, export_trl  # noqa: E402
from meshrl.integrations.trl import MEICallback, MeshGRPOTrainer, MeshOptions, check_trl_version  # noqa: E402
from meshrl.integrations.trl.options import trl_group_advantages  # noqa: E402
from meshrl.integrations.trl.reward import task_reward_func  # noqa: E402
from meshrl.mesh import (  # noqa: E402
    RuleCoach,
    generate_prefixes,
    strategy_balance_loss,
    support_balance_row_weights,
    wrap_prefix,
)
from meshrl.models.tiny import build_tiny  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402

N_QUERIES = 4


def even_length(completions, **kwargs) -> list[float]:
    """A reward that half the random tiny model's completions earn (so strategies have correct rollouts)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    model, tok = build_tiny("tiny", seed=0)
    model.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    task = load_task("tiny:add")
    problems = task.problems("train")[:N_QUERIES]
    coach = RuleCoach(lambda q: task.coach_strategies(problems[0]), name="rule:tiny:add")
    generate_prefixes([{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems], coach, m=4,
                      out_path=root / "prefixes.jsonl")
    export_trl("tiny:add", root / "prefixes.jsonl", root / "data", m=4, limit=N_QUERIES)
    rows = [json.loads(line) for line in (root / "data" / "train.jsonl").read_text().splitlines()]
    return {"root": root, "model": str(root / "tiny"), "tok": tok, "prefixes": root / "prefixes.jsonl",
            "rows": rows, "task": task}


def config(root: Path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(root / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                per_device_train_batch_size=16, num_generations=8, max_completion_length=6, max_steps=2,
                logging_steps=1, report_to=[], seed=0, learning_rate=1e-3, save_strategy="no")
    return GRPOConfig(**{**base, **kw})


def mesh_trainer(world, mesh: MeshOptions, **kw) -> MeshGRPOTrainer:
    return MeshGRPOTrainer(world["model"], even_length, args=config(world["root"], **kw),
                           train_dataset=Dataset.from_list(world["rows"]), processing_class=world["tok"],
                           prefixes=world["prefixes"], mesh=mesh)


def first_batch(trainer) -> list[dict]:
    trainer.model.train()  # TRL reads the mode from the model: conditioning and MEI act in training only
    return next(iter(trainer.get_train_dataloader()))


def seq_logps(model, out, *, grad: bool = False) -> torch.Tensor:
    """Sum of completion-token log-probs from a plain forward (full logits, log_softmax at temperature 1)."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    width = out["completion_ids"].size(1)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, attention_mask=att).logits[:, -width - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return (logp * out["completion_mask"]).sum(-1)


# ---- pure pieces --------------------------------------------------------------------------------------------
def test_layout_and_bad_num_generations():
    assert MeshOptions(m=4).layout(16) == (4, [0, 1, 2, 3])
    assert MeshOptions(m=2, bare_group=True).layout(6) == (2, [0, 1, -1])
    assert MeshOptions(m=4, budget="per_prefix").baseline_group_size(16) == 16
    assert MeshOptions(m=4, budget="matched").baseline_group_size(16) == 16
    assert MeshOptions(m=4, budget="per_prefix", group_size=4).layout(16) == (4, [0, 1, 2, 3])
    assert MeshOptions(m=4, budget="matched", group_size=16).layout(16) == (4, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="num_generations=16 but mesh.budget='per_prefix' with group_size=16"):
        MeshOptions(m=4, budget="per_prefix", group_size=16).layout(16)
    with pytest.raises(ValueError, match="divisible by m"):
        MeshOptions(m=4, group_size=6)
    with pytest.raises(ValueError, match="num_generations=6 does not divide into mesh.m=4"):
        MeshOptions(m=4).layout(6)
    with pytest.raises(ValueError, match="mesh.adv_unit"):
        MeshOptions(adv_unit="prompt")


def test_unsupported_trl_version_is_named():
    assert check_trl_version("1.16.0") == "1.16.0"
    for bad in ("1.15.2", "2.0.0", "0.19.1"):
        with pytest.raises(ValueError, match=f"trl {bad} is not supported"):
            check_trl_version(bad)


def test_conditioned_prompt_forms():
    user = [{"role": "user", "content": "1+2="}]
    sys_plain = MeshOptions(template="plain").conditioned_prompt(user, "count on")
    assert sys_plain == [{"role": "system", "content": "count on"}, *user]
    asst = MeshOptions(placement="assistant").conditioned_prompt(user, "count on")
    assert asst[-1] == {"role": "assistant", "content": wrap_prefix("count on", "assistant")}
    assert MeshOptions(placement="assistant", template="plain").conditioned_prompt("Q:", "hint") == "Q:hint"
    with pytest.raises(ValueError, match="placement='system' needs conversational prompts"):
        MeshOptions().conditioned_prompt("Q:", "hint")


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    a = trl_group_advantages(r, 2, "group")
    std = torch.tensor([1.0, 0.0]).std()  # unbiased, as TRL
    assert torch.allclose(a, torch.tensor([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, 0.0]))
    assert torch.allclose(trl_group_advantages(r, 2, "none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))


# ---- export ---------------------------------------------------------------------------------------------------
def test_export_cli_and_missing_prefixes(world, tmp_path):
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="engine"))
    args = parser.parse_args(["trl", "--task", "tiny:add", "--prefixes", str(world["prefixes"]), "--out",
                              str(tmp_path / "rows"), "--layout", "query_prefix", "--limit", "2",
                              "--template", "plain"])
    assert args.func(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "rows" / "train.jsonl").read_text().splitlines()]
    ids = [p.id for p in world["task"].problems("train")[:2]]
    assert [(r["query_id"], r["strategy_id"]) for r in rows] == [(q, k) for q in ids for k in range(4)]
    assert rows[1]["prompt"][0] == {"role": "system", "content": rows[1]["prefix"]}
    meta = json.loads((tmp_path / "rows" / "meta.json").read_text())
    assert meta["rows"] == 8 and meta["queries"] == 2
    q = world["rows"][0]
    assert q["strategy_ids"] == [0, 1, 2, 3] and len(q["prefixes"]) == 4 and q["prompt"][0]["role"] == "user"
    with pytest.raises(ValueError, match=f"no 4 prefixes in prefix file {world['prefixes']}"):
        export_trl("tiny:add", world["prefixes"], tmp_path / "x", limit=N_QUERIES + 1)
    reward = task_reward_func("tiny:add")
    problem = world["task"].problems("train")[1]
    assert reward([problem.answer, "nope"], [problem.id, problem.id]) == [1.0, 0.0]


def test_export_module_does_not_import_trl():
    code = ("import sys, meshrl.export.trl, meshrl.integrations.trl, meshrl.integrations.trl.reward; "
            "print('trl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- MeshGRPOTrainer --------------------------------------------------------------------------------------------
def test_bad_input_before_any_step(world, tmp_path):
    rows = [*world["rows"], {**world["rows"][0], "problem": "9+9=", "query_id": "stranger"}]
    with pytest.raises(ValueError, match=rf"prefix file {world['prefixes']}.*first: stranger"):
        MeshGRPOTrainer(world["model"], even_length, args=config(tmp_path), train_dataset=Dataset.from_list(rows),
                        processing_class=world["tok"], prefixes=world["prefixes"], mesh=MeshOptions(m=4))
    with pytest.raises(ValueError, match="num_generations=6"):
        mesh_trainer(world, MeshOptions(m=4), num_generations=6, per_device_train_batch_size=12)
    with pytest.raises(ValueError, match="map-style train_dataset"):
        MeshGRPOTrainer(world["model"], even_length, args=config(tmp_path),
                                    train_dataset=Dataset.from_list(world["rows"]).to_iterable_dataset(),
                        prefixes=world["prefixes"])
    with pytest.raises(ValueError, match="prefix file not found"):
        MeshGRPOTrainer(world["model"], even_length, args=config(tmp_path), train_dataset=Dataset.from_list(rows),
                        prefixes=tmp_path / "none.jsonl")


@pytest.mark.slow  # a TRL trainer on a tiny model: ~10 s on 2 quiet cores
def test_mesh_batch_matches_meshrl_mesh(world):
    """Conditioning, ids, advantages, balancing weights, loss and gradient on one batch vs meshrl.mesh."""
    mu = 0.5
    trainer = mesh_trainer(world, MeshOptions(m=4, placement="assistant", template="plain", mu=mu))
    model = trainer.model
    torch.manual_seed(1)
    with torch.no_grad():  # move the policy away from the reference so that the term is not zero
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    batch = first_batch(trainer)
    out = trainer._generate_and_score_completions(batch)
    tok = world["tok"]
    assert out["strategy_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] * 2
    assert out["query_ids"].tolist() == [0] * 8 + [1] * 8
    for i in range(16):  # the prefix ends the prompt and never appears in the completion
        prefix = trainer.mesh_table[batch[i]["query_key"]][out["strategy_ids"][i]]
        prompt = tok.decode(out["prompt_ids"][i][out["prompt_mask"][i].bool()])
        assert prompt.endswith(f"<s>assistant\n{prefix}"), prompt
        assert prefix not in tok.decode(out["completion_ids"][i])
    texts = tok.batch_decode([c[m.bool()] for c, m in zip(out["completion_ids"], out["completion_mask"],
                                                          strict=True)], skip_special_tokens=True)
    reward = torch.tensor(even_length(texts))
    assert torch.allclose(out["advantages"], trl_group_advantages(reward, 2, "group"))

    ref = AutoModelForCausalLM.from_pretrained(world["model"])
    seq = seq_logps(model, out, grad=True)
    ref_seq = seq_logps(ref, out)
    loss, metrics = strategy_balance_loss(seq, ref_seq, reward == 1, out["query_ids"], out["strategy_ids"], mu)
    assert loss.item() > 1e-6
    assert trainer._metrics["train"]["mesh/balance_loss"][-1] == pytest.approx(loss.item(), rel=1e-4)
    assert trainer._metrics["train"]["mesh/active_strategies"][-1] == metrics["mesh/active_strategies"]
    (want,) = torch.autograd.grad(loss, seq)
    assert torch.allclose(out["mesh_balance_w"], want.float(), atol=1e-7)

    params = [p for p in model.parameters() if p.requires_grad]
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop
    with_term = torch.autograd.grad(trainer._compute_loss(model, out), params, allow_unused=True)
    plain = {k: v for k, v in out.items() if k != "mesh_balance_w"}
    without = torch.autograd.grad(trainer._compute_loss(model, plain), params, allow_unused=True)
    expect = torch.autograd.grad(strategy_balance_loss(seq_logps(model, out, grad=True), ref_seq, reward == 1,
                                                       out["query_ids"], out["strategy_ids"], mu)[0], params)
    for a, b, e in zip(with_term, without, expect, strict=True):
        assert torch.allclose(a - b, e, atol=2e-5, rtol=1e-4)  # float32, entries up to ~1


@pytest.mark.slow  # a TRL trainer on a tiny model: ~10 s on 2 quiet cores
def test_support_balance_and_bare_group(world, monkeypatch):
    """meshrl's support form: weights from the completions under their bare queries; the bare group is no cell."""
    strides = []
    original = GRPOTrainer._generate_single_turn

    def spy(self, prompt_ids, images, fields, num_generations, *args):
        strides.append(num_generations)
        return original(self, prompt_ids, images, fields, num_generations, *args)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", spy)
    trainer = mesh_trainer(world, MeshOptions(m=3, bare_group=True, balance="support", mu=0.5, template="plain"))
    batch = first_batch(trainer)
    out = trainer._generate_and_score_completions(batch)
    assert strides == [2]  # vLLM server mode de-duplicates prompts with this stride: one prefix group
    assert out["strategy_ids"].tolist() == [0, 0, 1, 1, 2, 2, -1, -1] * 2
    tok = world["tok"]
    bare = [tok.apply_chat_template(x["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
            ["input_ids"] for x in batch]
    width = max(map(len, bare))
    bare_out = {**out, "prompt_ids": torch.tensor([[tok.pad_token_id] * (width - len(b)) + list(b) for b in bare]),
                "prompt_mask": torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in bare])}
    texts = tok.batch_decode([c[m.bool()] for c, m in zip(out["completion_ids"], out["completion_mask"],
                                                          strict=True)], skip_special_tokens=True)
    correct = (torch.tensor(even_length(texts)) == 1) & (out["strategy_ids"] >= 0)
    w, metrics = support_balance_row_weights(seq_logps(trainer.model, bare_out), correct, out["query_ids"],
                                             out["strategy_ids"], 0.5)
    assert float(w.abs().sum()) > 0 and torch.allclose(out["mesh_support_w"], w.float(), atol=1e-7)
    assert bool((w[out["strategy_ids"] < 0] == 0).all())
    assert trainer._metrics["train"]["mesh/support_queries"][-1] == metrics["mesh/support_queries"]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.current_gradient_accumulation_steps = 1
    with_term = torch.autograd.grad(trainer._compute_loss(trainer.model, out), params)
    plain = {k: v for k, v in out.items() if k != "mesh_support_w"}
    without = torch.autograd.grad(trainer._compute_loss(trainer.model, plain), params)
    expect = torch.autograd.grad((w.float() * seq_logps(trainer.model, bare_out, grad=True)).sum(), params)
    for a, b, e in zip(with_term, without, expect, strict=True):
        assert torch.allclose(a - b, e, atol=2e-5, rtol=1e-4)


@pytest.mark.slow  # a TRL trainer on a tiny model: ~10 s on 2 quiet cores
def test_mesh_trains_end_to_end(world):
    trainer = mesh_trainer(world, MeshOptions(m=4, template="plain", mu=1e-2, adv_unit="query"))
    MEICallback().attach(trainer)
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"mesh/balance_mu", "mesh/active_strategies", "rollouts/count", "loss"} <= logged
    assert {"mei/query", "mei/prefix_group", "mei/bias/prefix_group_group_size"} <= logged
    prompts = list(trainer._logs["prompt"])  # the last generation batch as generated: system placement
    assert len(prompts) == 16
    prefixes = trainer.mesh_table
    for i, prompt in enumerate(prompts):
        key = next(r["query_key"] for r in world["rows"] if r["prompt"][-1] == prompt[-1])
        assert prompt[0] == {"role": "system", "content": prefixes[key][(i % 8) // 2]}
    assert trainer.state.global_step == 2


# ---- MEICallback ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a TRL trainer on a tiny model: ~10 s on 2 quiet cores
def test_mei_callback_matches_diagnostics_and_stops(world, tmp_path):
    rows = [{"prompt": r["prompt"], "query_id": r["query_id"]} for r in world["rows"]]
    trainer = GRPOTrainer(world["model"], even_length, args=config(tmp_path, max_steps=3),
                          train_dataset=Dataset.from_list(rows), processing_class=world["tok"])
    cb = MEICallback(threshold=0.0, patience=2, on_warning="checkpoint_and_stop").attach(trainer)
    out = trainer._generate_and_score_completions(first_batch(trainer))
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, out)  # plain TRL: MEI reads the LM head's input of the loss forward
    logits = trainer.model(input_ids=torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
                           attention_mask=torch.cat([out["prompt_mask"], out["completion_mask"]], 1)).logits
    width = out["completion_ids"].size(1)
    phi = bias_features(logits[:, -width - 1:-1].detach(), out["completion_ids"], out["completion_mask"]).double()
    by_query = [phi[i:i + 8] for i in (0, 8)]
    mei = [float(f.sum(0).square().sum() / f.square().sum()) for f in by_query]
    assert cb.last["mei/query"] == pytest.approx(sum(mei) / 2, rel=1e-5)
    assert cb.last["mei/g_over_mei"] == pytest.approx(sum(8 / x for x in mei) / 2, rel=1e-5)
    grams = [f @ f.T for f in by_query]  # effective directions: tr^2 / ||Gram||_F^2 per query, at most G
    pr = [float(g.trace() ** 2 / g.square().sum()) for g in grams]
    assert cb.last["mei/directions"] == pytest.approx(sum(pr) / 2, rel=1e-5) and 1 <= cb.last["mei/directions"] <= 8
    assert cb.above == 1 and not cb.warned and "mei/prefix_group" not in cb.last

    cb.above, cb.checks, cb.first_cross = 0, 0, None
    trainer.train()
    assert trainer.state.global_step == 2  # warned at the second check, stopped before max_steps=3
    events = [json.loads(x) for x in (tmp_path / "out" / "mei_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-1] == "mei_warning"
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


@pytest.mark.slow  # two gloo processes on a CPU: ~50 s on 2 busy cores
def test_two_processes_balance_gradient(world, tmp_path):
    """A query split over 2 processes: the process-mean gradient is grad J of the gathered batch; MEI too."""
    script = Path(__file__).with_name("trl_two_process_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           world["model"], str(world["root"] / "data" / "train.jsonl"), str(world["prefixes"]), str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert "TWO-PROCESS OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_vllm_server_mode_on_a_cpu_is_refused_before_connecting(tmp_path):
    """TRL's server mode syncs weights through vLLM's NCCL transfer, which needs CUDA (VLLMClient.init_communicator
    refuses another device, after waiting for the server): MeshGRPOTrainer says so at once."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="server",
                      per_device_train_batch_size=8, num_generations=8, report_to=[])
    with pytest.raises(ValueError, match=r"vllm_mode='server'\) needs CUDA.*use vllm_mode='colocate'"):
        MeshGRPOTrainer("unused", lambda **_: [], args=args, train_dataset=Dataset.from_list([{"prompt": "x"}]),
                        prefixes=tmp_path / "none.jsonl")
