"""MEI's bias features summed by the sampler (``Rollouts.engine_features``): equal to the trainer's own forward,
free of any effect on the samples, and used by the trainer in place of the update's forward (which keeps the
parts engine's workers and zero-advantage skip), with the update's forward as the logged fallback."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from meshrl.diagnostics import bias_features
from meshrl.models import encode_prompt, load_model
from meshrl.rollout import SamplingParams, make_backend
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.batch import collate, response_logits
from meshrl.trainer.update import PartsEngine

BASE = [*TINY_RUN, "rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.max_new_tokens=8",
        "train.micro_batch_size=5", "diag.mei.every=1", "optim.lr=1e-5", "checkpoint.every=10"]
MEI_KEYS = ("mei/query", "mei/directions", "mei/directions_median", "mei/g_over_mei_of_mean")


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return load_model("tiny:small", seed=0)


def _prompts(tok) -> list[list[int]]:
    return [encode_prompt(tok, t) for t in ["1+2=", "Repeat: hello there", "x"]]


def _forward_features(model, backend, out, temperature: float) -> torch.Tensor:
    """``bias_features`` of the trainer's fp32 forward on the sampled rows (the update path's features)."""
    mb = collate(out.prompt_ids, out.response_ids, backend.pad_id)
    with torch.no_grad():
        logits = response_logits(model, mb)
    return bias_features(logits, mb.response_ids, mb.response_mask, temperature=temperature if temperature > 0 else 1.0)


@pytest.mark.parametrize(("backend_name", "workers", "temperature", "top_p"), [
    ("native", 1, 1.0, 1.0), ("native", 2, 1.0, 1.0), ("native", 1, 0.7, 0.8), ("native", 2, 0.7, 0.8),
    ("native", 1, 0.0, 1.0), ("hf", None, 1.0, 1.0), ("hf", None, 0.7, 0.8)])
def test_sampler_features_equal_the_trainers_forward_and_leave_samples_unchanged(small, backend_name, workers,
                                                                                temperature, top_p):
    model, tok = small
    kw = {"workers": workers} if backend_name == "native" else {}
    backend = make_backend(backend_name, model, tok, **kw)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, n=6)
    try:
        with_features = backend.generate(_prompts(tok), params, seed=3, features=True)
        without = backend.generate(_prompts(tok), params, seed=3)
    finally:
        if hasattr(backend, "close"):
            backend.close()
    # (b) the same draws, log-probs and texts with the flag on and off; no features when not asked
    assert with_features.response_ids == without.response_ids
    assert with_features.engine_logprobs == without.engine_logprobs
    assert without.engine_features is None
    if temperature > 0:  # rows end at different steps (eos), some run to the limit (greedy: all alike here)
        assert len({len(r) for r in with_features.response_ids}) > 1 and any(not t for t in with_features.truncated)
    # (a) the sampler's sums equal the update's features of the same tokens
    got = torch.from_numpy(np.stack(with_features.engine_features))
    assert got.dtype == torch.float32 and got.shape[0] == len(with_features)
    want = _forward_features(model, backend, with_features, temperature)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    # phi sums (e_y - p) over the tokens, so its entries sum to 0
    assert torch.allclose(got.sum(-1), torch.zeros(len(got)), atol=1e-4)


def _trainer(tmp_path, name: str, *extra: str, rollout_features: bool = True) -> Trainer:
    tr = Trainer(load_config(overrides=[*BASE, "steps=3", *extra]), tmp_path / name)
    if not rollout_features:  # this sampler's features withheld: the update's forward must feed MEI
        tr.backend.returns_features = False
    return tr


def _record_plans(tr: Trainer) -> list[bool]:
    """The ``collect_mei`` of every mini-batch the engine computes (wraps ``engine.backward``)."""
    seen: list[bool] = []
    inner = tr.engine.backward

    def spy(rows, inputs, params, stats, plan, epoch):
        seen.append(plan.collect_mei)
        return inner(rows, inputs, params, stats, plan, epoch)

    tr.engine.backward = spy
    return seen


@pytest.mark.parametrize("recipe", ["grpo", "cp_only", "dapo"])
def test_training_mei_from_the_rollout_equals_mei_from_the_update(tmp_path, caplog, recipe):
    # (c) the first step samples the same rollouts either way: its MEI metrics must agree; cp_only exercises Mesh's
    # strategy prefixes (prefix groups), dapo dynamic sampling's kept rows (StepData.extend across rounds).
    extra = [f"recipe={recipe}"]
    with caplog.at_level(logging.INFO, logger="meshrl"):
        fast = _trainer(tmp_path, "fast", *extra)
        fast_plans = _record_plans(fast)
        got = fast.step()
        slow = _trainer(tmp_path, "slow", *extra, rollout_features=False)
        slow_plans = _record_plans(slow)
        want = slow.step()
    assert "MEI features from the rollout" in caplog.text
    assert "MEI features from the update's forward: rollout backend" in caplog.text
    assert fast_plans and not any(fast_plans)  # the update never collects MEI
    assert slow_plans and all(slow_plans)
    keys = [*MEI_KEYS, *(["mei/prefix_group"] if recipe == "cp_only" else [])]
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_mei_on_keeps_the_parts_engine_and_its_workers(tmp_path):
    # (e) MEI no longer forces the serial path: the engine and the mini-batch's path are those of a run without MEI
    tr = _trainer(tmp_path, "parts", "recipe=grpo", "train.update_workers=2")
    assert isinstance(tr.engine, PartsEngine) and tr.engine.skip_zero
    plans = _record_plans(tr)
    metrics = tr.step()
    assert "mei/query" in metrics and plans == [False]
    assert tr.engine.started  # the forked update workers ran this MEI step
    tr.engine.close()


def test_a_reused_batch_falls_back_to_the_update_and_says_why(tmp_path, caplog):
    # (d) plugins.replay trains on the stored batch again at step 2: its sampler features belonged to the policy
    # of step 1 and were taken then, so MEI is scored by the update's forward, and the log says so.
    tr = _trainer(tmp_path, "replay", "plugins.replay.reuse_steps=1")
    plans = _record_plans(tr)
    with caplog.at_level(logging.INFO, logger="meshrl"):
        first = tr.step()
        n_first = len(plans)
        second = tr.step()
    assert not any(plans[:n_first]) and all(plans[n_first:])
    assert "MEI features from the rollout" in caplog.text
    assert "MEI features from the update's forward: 16 of 16 rows have no sampler features" in caplog.text
    assert "mei/query" in first and "mei/query" in second


def test_steps_without_mei_ask_the_sampler_for_nothing(tmp_path):
    tr = _trainer(tmp_path, "every2", "diag.mei.every=2")
    off, _ = tr.sampler.run(1, 0)
    on, _ = tr.sampler.run(0, 0)
    assert off.rollout_features == [None] * len(off)
    assert len(on.rollout_features) == len(on) and all(f is not None for f in on.rollout_features)
    features, missing = on.take_rollout_features()
    assert features is not None and features.shape[0] == len(on) and missing == 0
    assert on.take_rollout_features() == (None, len(on))  # taken once: they belong to the sampling policy
