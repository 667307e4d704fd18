"""``meshrl census`` on multi-turn episodes: the trainer logs each episode's exact ids, its model-token mask and its
tool-pattern label; the census scores the tokens the model sampled (never a re-tokenised transcript, never the
tool's output) and reports the parser's labels beside the geometric partition."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from agents_support import ScriptedBackend, call_text  # noqa: E402

from meshrl.analysis import census  # noqa: E402
from meshrl.analysis.census import full_sequences, group_scores, parser_label_figures  # noqa: E402
from meshrl.diagnostics import fisher_scores  # noqa: E402
from meshrl.models import load_model  # noqa: E402
from meshrl.testing import TINY_RUN  # noqa: E402
from meshrl.trainer import Trainer, load_config  # noqa: E402


def test_parser_label_figures_by_hand():
    # labels a a b b, partition {0,1} {2} {3}: purity 4/4; label b split over 2 strategies -> 1 of 2 labels split
    got = parser_label_figures(["a", "a", "b", "b"], [0, 0, 1, 2])
    assert got == {"label_mass": {"a": 0.5, "b": 0.5}, "max_label_mass": 0.5, "label_purity": 1.0,
                   "label_split": 0.5}
    # one strategy holding a, a, b: its majority label covers 2 of 3
    assert parser_label_figures(["a", "a", "b"], [0, 0, 0])["label_purity"] == pytest.approx(2 / 3)
    assert parser_label_figures(["a", None], [0, 1]) == {} and parser_label_figures([], []) == {}


def test_masked_scores_cover_the_models_tokens_only():
    model, tok = load_model("tiny")
    prompts = [[5, 6, 7], [5, 6, 7]]
    responses = [[8, 9, 10, 11], [8, 12, 13, 11]]
    masks = [[1, 0, 0, 1], [1, 1, 1, 1]]
    ids, am, rm = full_sequences(prompts, responses, 0, masks)
    assert rm[0].tolist() == [0, 0, 0, 1, 0, 0, 1] and rm[1].tolist() == [0, 0, 0, 1, 1, 1, 1]
    got = group_scores(model, prompts, responses, 0, temperature=1.0, params=None, sketch_dim=None, seed=0,
                       model_masks=masks)
    assert torch.allclose(got, fisher_scores(model, ids, am, rm, temperature=1.0))
    unmasked = group_scores(model, prompts, responses, 0, temperature=1.0, params=None, sketch_dim=None, seed=0)
    assert not torch.allclose(got[0], unmasked[0]) and torch.allclose(got[1], unmasked[1])


def test_bad_exact_token_fields_are_counted_skips(tmp_path):
    base = {"step": 1, "problem_id": "p", "prompt": "x", "completion": "y"}
    rows = [{**base, "prompt_ids": [1, 2]},
            {**base, "prompt_ids": [1], "response_ids": [2, -1]},
            {**base, "prompt_ids": [1], "response_ids": [2, 3], "model_mask": [1]},
            {**base, "prompt_ids": [1], "response_ids": [2, 3], "model_mask": [1, 2]},
            {**base, "model_mask": [1]},
            {**base, "prompt_ids": [], "response_ids": [2]},
            {**base, "strategy_label": 3}]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = census("tiny", path, progress=False, device="cpu")
    assert [s["reason"] for s in r["skipped"]] == [
        "field 'prompt_ids' needs its partner ('prompt_ids' and 'response_ids' go together)",
        "field 'response_ids' must be a list of token ids (integers >= 0)",
        "field 'model_mask' has 1 entries for 2 response ids",
        "field 'model_mask' must be a list of 0/1",
        "field 'model_mask' needs 'prompt_ids' and 'response_ids'",
        "field 'prompt_ids' is empty",
        "field 'strategy_label' must be a string or null, got int"]


def _script(tokenizer):
    """Even rows call the calculator, then answer; odd rows answer directly (two tool patterns per group)."""

    def script(context: list[int], row: int, seed: int) -> str:
        if "<s>tool\n" in tokenizer.decode(context):
            return "5"
        return call_text("calculator", {"expression": "2+3"}) if row % 2 == 0 else "5"

    return script


def test_trainer_logs_exact_episodes_and_the_census_reads_them(tmp_path):
    cfg = load_config(overrides=[*TINY_RUN, "rollout.max_new_tokens=96", "log.samples_per_step=-1",
                                 "task=env:calculator?max_turns=3&data=tiny:add"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.sampler.backend = ScriptedBackend(trainer.tokenizer, _script(trainer.tokenizer))
        trainer.step()
        data = trainer.last_data
        from meshrl.jsonl import JsonlWriter
        from meshrl.trainer.loop import _write_samples

        path = tmp_path / "samples.jsonl"
        writer = JsonlWriter(path)
        _write_samples(writer, trainer, 0)
        writer.close()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(data)
    for i, row in enumerate(rows):  # written in row order (-1: every row)
        assert row["prompt_ids"] == list(data.prompt_ids[i]) and row["response_ids"] == list(data.response_ids[i])
        assert row["model_mask"] == data.model_mask(i)
    labels = {row["strategy_label"] for row in rows}
    assert labels == {"calculator", "direct"}
    called = [row for row in rows if row["strategy_label"] == "calculator"]
    assert all(0 < sum(r["model_mask"]) < len(r["response_ids"]) for r in called)  # tool output masked

    out = census("tiny", path, progress=False, device="cpu")
    assert out["rows_skipped"] == 0 and out["total"]["labelled_groups"] == out["total"]["n_groups"] > 0
    for g in out["groups"]:
        assert g["label_mass"] == {"calculator": 0.5, "direct": 0.5} and 0.5 <= g["label_purity"] <= 1.0
