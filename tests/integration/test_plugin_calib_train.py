"""``plugins.calib`` (CalibRL's expert-calibrated term) in the trainer: the trainer's micro-batch loss against the
recipe's loss plus the term computed from a separate scoring of the expert traces, and runs on the tiny model (the
term itself and its settings: tests/unit/test_plugin_calib.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshrl.algos import aggregate, ppo_clip_loss
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.loss import UpdateInputs
from meshrl.trainer.plugins.luffy import trace_ids


def _cfg(*extra: str, steps: int = 2):
    return load_config(overrides=[*TINY_RUN, f"steps={steps}", *extra])


def _traces(tmp_path, problems, completion=lambda p: p.answer) -> str:
    path = tmp_path / "expert.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "completion": completion(p)}) + "\n" for p in problems))
    return str(path)


def test_micro_batch_loss_is_the_recipe_loss_plus_the_term(tmp_path):
    from meshrl.runs.correct import is_correct
    from meshrl.tasks import load_task

    problems = load_task("tiny:repeat", seed=0).problems("train")
    with_trace = problems[: len(problems) // 2]
    path = _traces(tmp_path, with_trace, completion=lambda p: p.answer + p.answer)  # traces of several lengths
    t = Trainer(_cfg("plugins.calib.enabled=true", f"plugins.calib.traces={path}", "plugins.calib.coef=0.3",
                     "plugins.calib.negative_slope=0.2", "rollout.prompts_per_step=8", "train.update_workers=1"),
                tmp_path / "t")
    try:
        data, _ = t.sampler.run(0, 0)
        data.scores = [float(i % 3 == 0) for i in range(len(data))]  # mixed outcomes
        data.advantages = torch.linspace(-1.0, 1.0, len(data))
        stats = t.plugins.begin_update(data, None, None)
        ids = {p.id for p in with_trace}
        n_groups = len(dict.fromkeys(data.group_ids))
        with_expert = [i for i in range(len(data)) if data.problems[i].id in ids]
        assert stats["calib/groups_without_trace"] == n_groups - len({data.group_ids[i] for i in with_expert})
        idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))
        r = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
        # independently: each row's expert scored alone, under its own prompt
        with torch.no_grad():
            logp = token_logprobs(t.forward.logits(t.model, mb), mb.response_ids, 1.0)
            want_term = torch.zeros_like(logp)
            for k, j in enumerate(idx):
                if data.problems[j].id not in ids:
                    continue
                e = trace_ids(t.tokenizer, data.problems[j].answer * 2)[: t.cfg.rollout.max_new_tokens]
                emb = t.forward.collate([data.prompt_ids[j]], [e])
                elp = token_logprobs(t.forward.logits(t.model, emb), emb.response_ids, 1.0)[0]
                sign = 1.0 if is_correct(data.scores[j]) else -1.0
                for pos in range(min(len(e), int(mb.response_mask[k].sum()))):
                    x = -sign * float(logp[k, pos] - elp[pos])
                    want_term[k, pos] = abs(float(data.advantages[j])) * (x if x > 0 else 0.2 * x)
        mask = mb.response_mask
        pg, _ = ppo_clip_loss(logp, logp, data.advantages[idx], mask)
        want = aggregate(pg + 0.3 * want_term, mask, "seq-mean-token-mean")
        torch.testing.assert_close(r.loss.detach(), want, rtol=1e-5, atol=1e-6)
        assert r.stats["calib/term"] == pytest.approx(
            float(0.3 * aggregate(want_term, mask, "seq-mean-token-mean")), rel=1e-4, abs=1e-7)
        assert 0 < r.stats["calib/covered_frac"] < 1
    finally:
        t.close()


def test_trains_two_steps_on_tiny(tmp_path):
    from meshrl.tasks import load_task

    path = _traces(tmp_path, load_task("tiny:repeat", seed=0).problems("train"))
    hist = train(_cfg("plugins.calib.enabled=true", f"plugins.calib.traces={path}"), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    for m in hist:
        assert m["calib/groups_without_trace"] == 0 and 0 < m["calib/covered_frac"] <= 1
        assert math.isfinite(m["calib/term"]) and math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])


@pytest.mark.parametrize("extra", [
    ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1"],  # groups with several prefixes
    ["recipe=dapo", "algo.dynamic_sampling=false", "train.ppo_epochs=2", "train.mini_batches=2"],
])
def test_composes_with_mesh_and_several_optimiser_steps(tmp_path, extra):
    from meshrl.tasks import load_task

    path = _traces(tmp_path, load_task("tiny:repeat", seed=0).problems("train"))
    hist = train(_cfg(*extra, "plugins.calib.enabled=true", f"plugins.calib.traces={path}"), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    assert all(math.isfinite(m["calib/term"]) and math.isfinite(m["grad/norm"]) for m in hist)
