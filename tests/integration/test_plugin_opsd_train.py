"""plugins.opsd in the trainer: the self-distillation term against a per-token loop over separately run teacher
sequences, and a two-step run (the settings: tests/unit/test_plugin_opsd.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshrl.algos import aggregate
from meshrl.models import encode_prompt
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.loss import UpdateInputs
from meshrl.trainer.plugins import PluginContext
from meshrl.trainer.plugins.opsd import Opsd, OpsdConfig


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(overrides=[*TINY_RUN, "steps=2", "train.update_workers=1", *extra]), tmp_path / name)


def _teacher_row_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits ``[len(response), V]`` predicting each response token, one unpadded sequence at a time."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        out = model(input_ids=ids).logits[0].double()
    return out[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def _jsd(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """1/2 KL(p || m) + 1/2 KL(q || m) with m = (p + q) / 2, summed over the vocabulary one token at a time."""
    p, q = torch.softmax(p_logits, -1).tolist(), torch.softmax(q_logits, -1).tolist()
    total = 0.0
    for a, b in zip(p, q, strict=True):
        m = (a + b) / 2
        total += 0.5 * (a * math.log(a / m) if a > 0 else 0.0) + 0.5 * (b * math.log(b / m) if b > 0 else 0.0)
    return total


def _topk_kl(student: torch.Tensor, teacher: torch.Tensor, k: int, lo: float, hi: float) -> float:
    s, t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    top = sorted(range(len(t)), key=lambda v: -float(t[v]))[:k]
    total = sum(math.exp(max(float(t[v]), lo)) * (max(float(t[v]), lo) - max(float(s[v]), lo)) for v in top)
    return min(max(total, 0.0), hi)


def _expected(t: Trainer, idx, data, per_token, teacher_model) -> torch.Tensor:
    """The recipe's aggregation of ``per_token(student logits [V], teacher logits [V])`` over the rows that have
    a context, the teacher's prompt written out here from the paper's template."""
    mb = t.forward.collate([data.prompt_ids[j] for j in idx], [data.response_ids[j] for j in idx])
    with torch.no_grad():
        student = t.forward.logits(t.model, mb).double()
    mat = torch.zeros(mb.response_ids.shape, dtype=torch.float64)
    mask = torch.zeros_like(mat)
    for r, j in enumerate(idx):
        problem = data.problems[j]
        if not problem.answer:
            continue
        text = ("Here is a reference solution to this problem:\n" + problem.answer + "\n\nAfter understanding the "
                "reference solution and the rationale behind each step, now articulate your own step-by-step "
                "reasoning that derives the same final answer to the problem below:\n" + t.task.format_prompt(problem))
        response = data.response_ids[j]
        teacher = _teacher_row_logits(teacher_model, encode_prompt(t.tokenizer, text), response)
        for k in range(len(response)):
            mat[r, k] = per_token(student[r, k], teacher[k])
            mask[r, k] = 1.0
    return aggregate(mat, mask, t.recipe.loss_agg, norm_len=t.cfg.rollout.max_new_tokens)


def test_jsd_term_equals_a_per_token_loop_and_skips_rows_without_an_answer(tmp_path, caplog):
    opsd = _trainer(tmp_path, "o", "plugins.opsd.enabled=true", "plugins.opsd.teacher=current",
                    "plugins.opsd.coef=0.5")
    plain = _trainer(tmp_path, "p")
    data, _ = opsd.sampler.run(0, 0)
    for j in range(4):  # the first group's problem has no reference answer: no teacher for its rows
        data.problems[j] = dataclasses.replace(data.problems[j], answer="")
    idx, mb = next(iter(opsd.forward.micro_batches(list(range(len(data))), data)))
    got = opsd.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    base = plain.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    want = _expected(opsd, idx, data, _jsd, opsd.model)
    assert float(want) > 0
    assert got.stats["opsd/loss"] == pytest.approx(float(want), rel=1e-5)
    assert got.stats["opsd/no_context_frac"] == 4 / len(idx)
    assert f"problem {data.problems[0].id!r} has no reference answer" in caplog.text
    torch.testing.assert_close(got.loss.detach().double(), base.loss.detach().double() + 0.5 * want,
                               rtol=1e-5, atol=1e-7)
    # the term's gradient reaches the policy
    got.loss.backward()
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in opsd.model.parameters())


def test_topk_forward_kl_term_equals_a_per_token_loop(tmp_path):
    t = _trainer(tmp_path, "k", "plugins.opsd.enabled=true", "plugins.opsd.teacher=current",
                 "plugins.opsd.loss=forward_kl_topk", "plugins.opsd.topk=5", "plugins.opsd.log_prob_min=-4",
                 "plugins.opsd.loss_max=0.05")
    data, _ = t.sampler.run(0, 0)
    idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))
    got = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0)).stats
    want = _expected(t, idx, data, lambda s, q: _topk_kl(s, q, 5, -4.0, 0.05), t.model)
    assert got["opsd/loss"] == pytest.approx(float(want), rel=1e-5)
    assert 0 < got["opsd/teacher_mass"] <= 1 and 0 <= got["opsd/overlap_ratio"] <= 1


def test_initial_teacher_is_the_frozen_start_policy(tmp_path):
    t = _trainer(tmp_path, "i", "plugins.opsd.enabled=true")
    data, _ = t.sampler.run(0, 0)
    plugin = t.plugins.get("opsd")
    rows = list(range(8))
    prompts = [plugin.teacher_prompt(data.problems[j]) for j in rows]
    mb = t.forward.collate([data.prompt_ids[j] for j in rows], [data.response_ids[j] for j in rows])
    before = plugin.teacher_logits(mb, prompts, rows, data)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.05)
    torch.testing.assert_close(plugin.teacher_logits(mb, prompts, rows, data), before, rtol=0, atol=0)
    assert t.ref_model is not None  # a frozen copy: the tiny run trains every weight
    plugin.cfg.teacher = "current"
    assert not torch.allclose(plugin.teacher_logits(mb, prompts, rows, data), before)
    want = _teacher_row_logits(t.model, prompts[0], data.response_ids[0]).float()
    torch.testing.assert_close(plugin.teacher_logits(mb, prompts, rows, data)[0, : want.shape[0]], want,
                               rtol=1e-4, atol=1e-4)


def test_other_context_shows_another_problem_and_its_answer(tmp_path):
    t = _trainer(tmp_path, "x", "plugins.opsd.enabled=true", "plugins.opsd.context=other")
    plugin = t.plugins.get("opsd")
    problem = t.problems[0]
    text = plugin.teacher_text(problem)
    other = t.problems[1] if t.problems[1].id != problem.id else t.problems[2]
    assert text.endswith(t.task.format_prompt(problem))
    assert f"{t.task.format_prompt(other)}\n{other.answer}\n" in text and other.id != problem.id
    ctx = PluginContext(cfg=t.cfg, recipe=t.recipe, forward=t.forward, tokenizer=t.tokenizer, task=t.task,
                        problems=[problem], seed=0, rollouts=None)
    with pytest.raises(ValueError, match=r"plugins\.opsd\.context='other' needs at least two"):
        Opsd(OpsdConfig(enabled=True, context="other"), ctx)


@pytest.mark.parametrize("extra", [
    ["recipe=grpo"],
    ["recipe=dapo", "algo.dynamic_sampling=false", "plugins.opsd.context=other", "plugins.opsd.teacher=current",
     "plugins.opsd.loss=forward_kl_topk", "plugins.opsd.topk=8"],
])
def test_two_step_run_logs_its_metrics(tmp_path, extra):
    hist = train(load_config(overrides=[*TINY_RUN, "steps=2", "plugins.opsd.enabled=true", *extra]), tmp_path / "r")
    assert [m["step"] for m in hist] == [1, 2]
    for m in hist:
        for key in ("opsd/loss", "opsd/teacher_logp", "opsd/student_logp", "opsd/context_tokens", "loss/total"):
            assert math.isfinite(m[key]), key
        assert m["opsd/loss"] > 0 and m["opsd/no_context_frac"] == 0
