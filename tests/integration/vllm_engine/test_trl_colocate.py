"""TRL 1.16's GRPOTrainer with vLLM colocated, on vLLM's CPU build, carrying meshrl's MeshGRPOTrainer and
MEICallback (run in .venv-vllm by scripts/vllm_env.sh; skipped where vLLM or TRL is missing)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from meshrl.export.trl import export_trl  # noqa: E402
from meshrl.integrations.trl import MEICallback, MeshGRPOTrainer, MeshOptions  # noqa: E402
from meshrl.mesh import RuleCoach, generate_prefixes, load_prefixes  # noqa: E402
from meshrl.models.tiny import build_tiny  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402

N_QUERIES = 4


def even_length(completions, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_vllm")
    model, tok = build_tiny("tiny:small", seed=0)  # head size 32: vLLM's CPU attention does not take 16
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    task = load_task("tiny:add")
    problems = task.problems("train")[:N_QUERIES]
    coach = RuleCoach(lambda q: task.coach_strategies(problems[0]), name="rule:tiny:add")
    generate_prefixes([{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems], coach, m=4,
                      out_path=root / "prefixes.jsonl")
    export_trl("tiny:add", root / "prefixes.jsonl", root / "data", m=4, limit=N_QUERIES)
    rows = [json.loads(line) for line in (root / "data" / "train.jsonl").read_text().splitlines()]
    return {"root": root, "model": str(root / "model"), "tok": tok, "prefixes": root / "prefixes.jsonl",
            "rows": rows}


def test_mesh_and_mei_with_vllm_colocate(world):
    args = GRPOConfig(output_dir=str(world["root"] / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=16, num_generations=8, max_completion_length=6, max_steps=2,
                      logging_steps=1, report_to=[], seed=0, learning_rate=1e-3, save_strategy="no",
                      use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05,
                      vllm_enable_sleep_mode=False)
    trainer = MeshGRPOTrainer(world["model"], even_length, args=args, train_dataset=Dataset.from_list(world["rows"]),
                              processing_class=world["tok"], prefixes=world["prefixes"],
                              mesh=MeshOptions(m=4, template="plain", mu=1e-2, adv_unit="query"))
    MEICallback().attach(trainer)
    llm = trainer.vllm_generation.llm  # colocated: the engine lives in this process
    prompts_seen: list[list[int]] = []
    generate = llm.generate

    def recording_generate(prompts, *args, **kwargs):
        prompts_seen.extend(list(p["prompt_token_ids"]) for p in prompts)
        return generate(prompts, *args, **kwargs)

    llm.generate = recording_generate
    batches: list[dict] = []
    score = trainer._generate_and_score_completions

    def recording_score(inputs):
        out = score(inputs)
        batches.append(out)
        return out

    trainer._generate_and_score_completions = recording_score
    trainer.train()
    # The coach prefixes reached vLLM as prompt tokens ...
    texts = [world["tok"].decode(p) for p in prompts_seen]
    prefixes = {x for row in load_prefixes(world["prefixes"]).values() for x in row}
    assert texts and all(any(x in t for x in prefixes) for t in texts), texts[:2]
    # ... and stay outside the loss: the loss mask covers completion tokens only (at most max_completion_length),
    # and no prefix is inside a completion.
    assert batches
    for b in batches:
        assert b["completion_mask"].shape[1] <= 6
        for ids in b["completion_ids"]:
            assert not any(x in world["tok"].decode(ids) for x in prefixes if len(x) > 6)
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"mesh/balance_mu", "mesh/active_strategies", "loss"} <= logged
    assert {"mei/query", "mei/prefix_group"} <= logged
    assert trainer.state.global_step == 2
