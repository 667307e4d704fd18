"""The exported parquet loads with verl's own RLHFDataset; the reward module scores through verl's loader."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl.trainer.ppo.reward import get_custom_reward_fn  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402

from meshrl.export.verl import export_verl  # noqa: E402
from meshrl.mesh import RuleCoach, generate_prefixes  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402

TASK = "tiny:add"
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def offline_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a chat template; no hub access."""
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "[PAD]": 1, "<|end|>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="<|end|>")
    fast.chat_template = CHAT
    return fast


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_export")
    task = load_task(TASK)
    problems = task.problems("train")
    by_id = {p.id: p for p in problems}
    prefixes = tmp / "prefixes.jsonl"
    generate_prefixes([{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems],
                      RuleCoach(lambda q: task.coach_strategies(by_id[q["id"]])), m=4, out_path=prefixes)
    return export_verl(TASK, tmp / "data", prefixes=prefixes, m=4), problems


def test_parquet_loads_with_verls_dataset(exported):
    summary, problems = exported
    config = OmegaConf.create({"max_prompt_length": 4096, "filter_overlong_prompts": True,
                               "cache_dir": str(summary["files"]["train"]) + ".cache"})
    dataset = RLHFDataset(data_files=[summary["files"]["train"]], tokenizer=offline_tokenizer(), config=config)
    assert len(dataset) == 4 * len(problems) == summary["rows"]
    row = dataset[6]  # query 1, prefix 2
    assert row["extra_info"]["query_id"] == problems[1].id and row["extra_info"]["strategy_id"] == 2
    assert [m["role"] for m in row["raw_prompt"]] == ["system", "user"]
    assert row["raw_prompt"][1]["content"] == load_task(TASK).format_prompt(problems[1])
    assert row["data_source"] == "meshrl/tiny:add"
    assert row["reward_model"]["ground_truth"] == problems[1].answer
    val = RLHFDataset(data_files=[summary["files"]["val"]], tokenizer=offline_tokenizer(), config=config)
    assert len(val) == len(load_task(TASK).problems("eval"))


def test_reward_module_loads_through_verl_and_scores_a_known_completion(exported):
    summary, problems = exported
    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": summary["reward_module"],
                                                                  "name": "compute_score"}}})
    compute_score = get_custom_reward_fn(cfg)
    problem = problems[3]
    # The keyword arguments verl's naive reward manager passes (plus the fields it adds to extra_info).
    extra = {"query_id": problem.id, "strategy_id": 1, "split": "train", "index": 13, "num_turns": None,
             "rollout_reward_scores": {}}
    call = dict(data_source="meshrl/tiny:add", ground_truth=problem.answer, extra_info=extra)
    assert compute_score(solution_str=f"{problem.answer}", **call) == {"score": 1.0, "acc": True}
    assert compute_score(solution_str="no number here", **call)["score"] == 0.0
    assert torch.tensor(compute_score(solution_str=problem.answer, **call)["score"]) == 1.0
