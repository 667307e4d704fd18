"""plugins.ssd in the trainer: the NLL term against a per-row loop, its samples' settings, and a two-step run (the
sampler's top-k and the settings: tests/unit/test_plugin_ssd.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.rollout import SamplingParams
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.loss import UpdateInputs


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(overrides=[*TINY_RUN, "steps=2", "train.update_workers=1", *extra]), tmp_path / name)


def _nll_by_row(model, prompts: list[list[int]], responses: list[list[int]]) -> float:
    """Mean over rows of the mean token NLL (GRPO's seq-mean-token-mean), one unpadded sequence at a time."""
    per_row = []
    for prompt, response in zip(prompts, responses, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], -1)
        per_row.append(-sum(float(logp[k, y]) for k, y in enumerate(response)) / len(response))
    return sum(per_row) / len(per_row)


def _first_micro_loss(t: Trainer, data):
    idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))
    t.plugins.begin_update(data, None, None)
    return idx, t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))


def test_extra_samples_term_equals_a_per_row_loop(tmp_path):
    t = _trainer(tmp_path, "e", "plugins.ssd.enabled=true", "plugins.ssd.coef=0.5")
    plain = _trainer(tmp_path, "p")
    data, _ = t.plugins.sample(t.sampler, 0, 0)
    ssd = t.plugins.get("ssd")
    assert len(ssd.samples) == len(data) and ssd.samples != data.response_ids
    idx, got = _first_micro_loss(t, data)
    _, mb = next(iter(plain.forward.micro_batches(list(range(len(data))), data)))
    base = plain.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    want = _nll_by_row(t.model, [data.prompt_ids[j] for j in idx], [ssd.samples[j] for j in idx])
    assert got.stats["ssd/nll"] == pytest.approx(want, rel=1e-5)
    assert float(got.loss.detach()) == pytest.approx(float(base.loss.detach()) + 0.5 * want, rel=1e-5)
    got.loss.backward()
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in t.model.parameters())


def test_rollouts_term_is_the_nll_at_temperature_one(tmp_path):
    t = _trainer(tmp_path, "r", "plugins.ssd.enabled=true", "plugins.ssd.samples=rollouts", "rollout.temperature=0.7")
    data, _ = t.plugins.sample(t.sampler, 0, 0)
    assert t.plugins.get("ssd").samples is None  # nothing extra drawn
    idx, got = _first_micro_loss(t, data)
    want = _nll_by_row(t.model, [data.prompt_ids[j] for j in idx], [data.response_ids[j] for j in idx])
    assert got.stats["ssd/nll"] == pytest.approx(want, rel=1e-5)


def test_samples_follow_the_ssd_settings_and_are_redrawn_the_same(tmp_path):
    # top_k = 1 keeps the argmax alone: at any temperature the samples are the greedy continuations
    t = _trainer(tmp_path, "g", "plugins.ssd.enabled=true", "plugins.ssd.top_k=1", "plugins.ssd.temperature=3")
    data, _ = t.plugins.sample(t.sampler, 0, 0)
    ssd = t.plugins.get("ssd")
    greedy = t.sampler.backend.generate(data.prompt_ids, SamplingParams(t.cfg.rollout.max_new_tokens, 0.0), seed=5)
    assert ssd.samples == [list(r) for r in greedy.response_ids]
    # a batch gets the same samples whenever they are drawn (a resumed run re-draws a reused batch's)
    t2 = _trainer(tmp_path, "h", "plugins.ssd.enabled=true")
    d2, _ = t2.plugins.sample(t2.sampler, 0, 0)
    first = list(t2.plugins.get("ssd").samples)
    t2.plugins.get("ssd").samples = None
    t2.plugins.begin_update(d2, None, None)
    assert t2.plugins.get("ssd").samples == first


@pytest.mark.parametrize("extra", [
    ["recipe=grpo"],
    ["recipe=dapo", "algo.dynamic_sampling=false", "plugins.ssd.samples=rollouts"],
    ["recipe=grpo", "plugins.replay.reuse_steps=1"],
])
def test_two_step_run_logs_its_metrics(tmp_path, extra):
    hist = train(load_config(overrides=[*TINY_RUN, "steps=2", "plugins.ssd.enabled=true", *extra]), tmp_path / "r")
    assert [m["step"] for m in hist] == [1, 2]
    for m in hist:
        assert math.isfinite(m["ssd/nll"]) and m["ssd/nll"] > 0 and math.isfinite(m["loss/total"])
        if "plugins.ssd.samples=rollouts" not in extra:
            assert m["ssd/sample_tokens"] > 0 and 0 <= m["ssd/truncated_frac"] <= 1 and "time/ssd_sample_s" in m
