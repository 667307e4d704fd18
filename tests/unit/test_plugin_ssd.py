"""plugins.ssd: the NLL term against a per-row loop, its samples' settings, and the sampler's top-k."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.rollout import SamplingParams
from meshrl.rollout.hf import generation_config
from meshrl.rollout.native import sample_tokens
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


def test_sampler_top_k_keeps_the_k_most_likely_and_off_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 12, generator=gen)
    noise = torch.empty(500, 12).exponential_(generator=gen)
    top3 = logits.topk(3, dim=-1).indices
    drawn = sample_tokens(logits, SamplingParams(1, temperature=5.0, top_k=3), noise)
    assert bool((drawn[:, None] == top3).any(-1).all())
    assert len(set(drawn.tolist())) > 3  # still a draw, not an argmax
    # top_k and top_p together: vLLM's rule, top-p over the top-k's renormalised mass (p = 0.5 of two equal
    # tokens keeps one; p = 0.5 of the whole vocabulary would keep them both)
    flat = torch.tensor([[2.0, 2.0, 0.0, 0.0, 0.0, 0.0]]).expand(200, 6)
    pair = sample_tokens(flat, SamplingParams(1, top_p=0.5, top_k=2), torch.ones(200, 6) + torch.rand(200, 6))
    assert set(pair.tolist()) <= {0, 1} and len(set(pair.tolist())) == 1
    for params in (SamplingParams(1, temperature=0.8), SamplingParams(1, temperature=0.8, top_p=0.6)):
        off = SamplingParams(1, temperature=params.temperature, top_p=params.top_p, top_k=0)
        assert torch.equal(sample_tokens(logits, params, noise), sample_tokens(logits, off, noise))
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingParams(1, top_k=-1)
    assert generation_config(SamplingParams(4, top_k=20), [0], 0).top_k == 20
    assert generation_config(SamplingParams(4), [0], 0).top_k == 0


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.ssd.coef=0", "plugins.ssd.coef"),
    ("plugins.ssd.temperature=0", "plugins.ssd.temperature"),
    ("plugins.ssd.top_k=-1", "plugins.ssd.top_k"),
    ("plugins.ssd.top_p=0", "plugins.ssd.top_p"),
    ("plugins.ssd.top_p=1.5", "plugins.ssd.top_p"),
    ("plugins.ssd.samples=filtered", "plugins.ssd.samples"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


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
