"""MeshGRPOTrainer and prompts that a coach prefix pushes past the model's positions: the rows are dropped with a
warning and counted before any step, cheaply (a 200,000-character prefix is measured from its head), and
``task_reward_func`` names mismatched lengths in one line."""

from __future__ import annotations

import json
import logging
import time

import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from meshrl.export.trl import export_trl  # noqa: E402
from meshrl.integrations.trl import MeshGRPOTrainer, MeshOptions  # noqa: E402
from meshrl.integrations.trl.reward import task_reward_func  # noqa: E402
from meshrl.mesh import query_key  # noqa: E402
from meshrl.models.tiny import build_tiny  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402

N_QUERIES = 4
LONG = {1: "x" * 5_000, 2: "y " * 100_000}  # row -> one of its prefixes: past 4096 positions; 200,000 characters


def even_length(completions, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_long")
    model, tok = build_tiny("tiny", seed=0)
    assert model.config.max_position_embeddings == 4096
    model.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    problems = load_task("tiny:add").problems("train")[:N_QUERIES]
    with (root / "prefixes.jsonl").open("w") as fh:
        for i, p in enumerate(problems):
            prefixes = ["count up", "carry first", "tens then units", LONG.get(i, "check by subtracting")]
            fh.write(json.dumps({"key": query_key(p.prompt), "prefixes": prefixes, "names": ["a", "b", "c", "d"]})
                     + "\n")
    export_trl("tiny:add", root / "prefixes.jsonl", root / "data", m=4, limit=N_QUERIES)
    rows = [json.loads(line) for line in (root / "data" / "train.jsonl").read_text().splitlines()]
    return {"root": root, "model": str(root / "tiny"), "tok": tok, "rows": rows, "ids": [p.id for p in problems]}


def trainer_for(world, **kw) -> MeshGRPOTrainer:
    args = GRPOConfig(**{**dict(output_dir=str(world["root"] / "out"), use_cpu=True, bf16=False,
                                per_device_train_batch_size=16, num_generations=8, max_completion_length=6,
                                max_steps=1, logging_steps=1, report_to=[], seed=0, save_strategy="no"), **kw})
    return MeshGRPOTrainer(world["model"], even_length, args=args, train_dataset=Dataset.from_list(world["rows"]),
                           processing_class=world["tok"], prefixes=world["root"] / "prefixes.jsonl",
                           mesh=MeshOptions(m=4, template="plain"))


def test_rows_past_the_positions_are_dropped_counted_and_named_fast(world, caplog):
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        trainer = trainer_for(world)
    assert time.perf_counter() - t0 < 60
    ids = world["ids"]
    assert [r["query_id"] for r in trainer.train_dataset] == [ids[0], ids[3]]
    assert set(trainer.mesh_too_long) == {ids[1], ids[2]} and trainer.mesh_too_long[ids[2]] > 4096
    assert any("skipped 2 of 4 train_dataset rows" in r.getMessage() and ids[1] in r.getMessage()
               for r in caplog.records)


def test_a_completion_length_that_leaves_no_room_or_no_fitting_row_is_refused(world):
    with pytest.raises(ValueError, match="max_completion_length=4096 leaves no room"):
        trainer_for(world, max_completion_length=4096)
    with pytest.raises(ValueError, match="every train_dataset row's prompt is too long"):
        trainer_for(world, max_completion_length=4090)


def test_training_runs_on_the_rows_that_fit_and_logs_the_count(world):
    trainer = trainer_for(world, per_device_train_batch_size=8)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "skipped/long_prompts" in h]
    assert logged and logged[0]["skipped/long_prompts"] == 2.0


def test_rows_without_a_prompt_are_named(world, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "prompt"} for r in world["rows"]]
    with pytest.raises(ValueError, match=f"train_dataset row {world['ids'][0]} has no 'prompt' column"):
        MeshGRPOTrainer(world["model"], even_length, args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                                                                     per_device_train_batch_size=8,
                                                                     num_generations=8, report_to=[]),
                        train_dataset=Dataset.from_list(rows), processing_class=world["tok"],
                        prefixes=world["root"] / "prefixes.jsonl", mesh=MeshOptions(m=4, template="plain"))


def test_task_reward_func_names_mismatched_lengths():
    reward = task_reward_func("tiny:add")
    problem = load_task("tiny:add").problems("train")[0]
    with pytest.raises(ValueError, match=r"^reward: 3 completions but 2 query ids"):
        reward(["1", "2", "3"], [problem.id, problem.id])
