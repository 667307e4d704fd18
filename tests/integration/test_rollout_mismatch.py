"""The sampler's own log-probs (``Rollouts.engine_logprobs``) against the training forward: equal in fp32 for
``native`` (forked decoders included) and ``hf``, visibly apart under bf16 autocast; the trainer's per-step
``mismatch/*`` diagnostic; ``plugins.rollout_corr``'s loss against the hand-computed weighted loss."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import aggregate, ppo_clip_loss
from meshrl.forkpool import fork_available
from meshrl.jsonl import read_jsonl
from meshrl.models import encode_prompt, load_model
from meshrl.rollout import SamplingParams, make_backend
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import collate, response_logits, token_logprobs
from meshrl.trainer.loss import UpdateInputs

TINY = [*TINY_RUN, "train.update_workers=1"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def _prompts(tok) -> list[list[int]]:
    return [encode_prompt(tok, t) for t in ("repeat: a b", "repeat: c", "say something longer here")]


def _update_logps(model, out, temperature: float) -> list[torch.Tensor]:
    """fp32 training-forward log-probs of each sampled response (the trainer's own scoring)."""
    pad = out.prompt_ids[0][0]
    mb = collate(out.prompt_ids, out.response_ids, pad)
    with torch.no_grad():
        lp = token_logprobs(response_logits(model, mb, False), mb.response_ids, temperature)
    return [lp[i, : len(r)] for i, r in enumerate(out.response_ids)]


def _max_diff(model, out, temperature: float) -> float:
    ref = _update_logps(model, out, temperature)
    assert out.engine_logprobs is not None and len(out.engine_logprobs) == len(out.response_ids)
    diffs = [(torch.tensor(e) - r).abs().max() for e, r in zip(out.engine_logprobs, ref, strict=True) if len(e)]
    assert all(len(e) == len(r) for e, r in zip(out.engine_logprobs, out.response_ids, strict=True))
    return float(torch.stack(diffs).max())


@pytest.mark.parametrize(("backend", "workers"), [("native", 1), ("native", 2), ("hf", None)])
def test_sampler_logprobs_equal_the_fp32_forward_and_bf16_ones_do_not(tiny, backend, workers):
    if workers == 2 and not fork_available():
        pytest.skip("no fork")
    model, tok = tiny
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, n=4)
    extra = {"workers": workers} if workers else {}
    out = make_backend(backend, model, tok, **extra).generate(_prompts(tok), params, seed=3)
    assert all(isinstance(x, float) for row in out.engine_logprobs for x in row)  # plain lists (worker pipe)
    fp32 = _max_diff(model, out, 0.7)
    assert fp32 < 1e-5
    low = make_backend(backend, model, tok, autocast="bfloat16", **extra).generate(_prompts(tok), params, seed=3)
    bf16 = _max_diff(model, low, 0.7)
    assert bf16 > 1e-4 and bf16 > 100 * fp32


def test_greedy_logprobs_are_the_untempered_distribution(tiny):
    model, tok = tiny
    out = make_backend("native", model, tok, workers=1).generate(_prompts(tok), SamplingParams(6, temperature=0.0),
                                                                 seed=0)
    assert _max_diff(model, out, 1.0) < 1e-5


def test_trainer_logs_the_mismatch_every_step_and_names_backend_and_precision(tmp_path):
    hist = train(load_config(overrides=[*TINY, "steps=2"]), tmp_path / "fp32")
    for m in hist:
        assert m["mismatch/logp_absdiff_max"] < 1e-5 and abs(m["mismatch/logp_diff_mean"]) < 1e-6
        assert {"mismatch/logp_absdiff_mean", "mismatch/logp_absdiff_p50", "mismatch/logp_absdiff_p90",
                "mismatch/logp_absdiff_p99", "mismatch/kl_k3"} <= set(m)
    events = [e for e in read_jsonl(tmp_path / "fp32" / "events.jsonl") if e["event"] == "mismatch_setup"]
    assert events == [{"step": 1, "event": "mismatch_setup", "backend": "native", "rollout_precision": "float32",
                       "update_precision": "float32"}]
    hist = train(load_config(overrides=[*TINY, "steps=1", "rollout.autocast_bf16=true", "rollout.backend=hf"]),
                 tmp_path / "bf16")
    assert hist[0]["mismatch/logp_absdiff_mean"] > 1e-4
    event = next(e for e in read_jsonl(tmp_path / "bf16" / "events.jsonl") if e["event"] == "mismatch_setup")
    assert event["backend"] == "hf" and event["rollout_precision"] == "autocast-bfloat16"


def test_mismatch_uses_the_old_policy_of_the_first_epoch(tmp_path):
    """With two epochs the second pass sees moved weights; the diagnostic stays the fp32 agreement."""
    hist = train(load_config(overrides=[*TINY, "steps=1", "train.ppo_epochs=2", "train.mini_batches=2"]),
                 tmp_path / "epochs")
    assert hist[0]["mismatch/logp_absdiff_max"] < 1e-5


@pytest.mark.parametrize(("level", "mode", "reject"), [("token", "truncate", "none"), ("token", "mask", "k3"),
                                                      ("sequence", "truncate", "k1")])
def test_rollout_corr_loss_equals_the_hand_computed_weighted_loss(tmp_path, level, mode, reject):
    rc = "plugins.rollout_corr"
    t = Trainer(load_config(overrides=[*TINY, "steps=1", f"{rc}.enabled=true", f"{rc}.level={level}",
                                       f"{rc}.mode={mode}", f"{rc}.threshold=1.3", f"{rc}.lo=0.8", f"{rc}.hi=1.2",
                                       f"{rc}.reject={reject}",
                                       f"{rc}.reject_threshold={1.1 if reject == 'k1' else 0.02}"]),
                tmp_path / "rc")
    data, _ = t.sampler.run(0, 0)
    data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)  # a constructed sampler: per token +-0.4 off, or per row +-0.3

    def off(scale: float) -> float:
        return scale * (2 * float(torch.rand(1, generator=gen)) - 1)

    if level == "token":
        data.rollout_logps = [[x + off(0.4) for x in row] for row in data.rollout_logps]
    else:
        data.rollout_logps = [[x + shift + off(0.02) for x in row]
                              for row, shift in ((r, off(0.3)) for r in data.rollout_logps)]
    (idx, mb), = list(t.forward.micro_batches(list(range(len(data))), data))
    r = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    loss, stats = r.loss, r.stats
    with torch.no_grad():
        logp = token_logprobs(t.forward.logits(t.model, mb), mb.response_ids, 1.0)
    mask = mb.response_mask
    rollout = torch.zeros_like(logp)
    for i, j in enumerate(idx):
        rollout[i, : len(data.rollout_logps[j])] = torch.tensor(data.rollout_logps[j])
    log_w = (logp - rollout) * mask
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(logp)
    raw = log_w.exp()
    w = raw.clamp(max=1.3) if mode == "truncate" else raw * ((raw >= 0.8) & (raw <= 1.2))
    keep = torch.ones_like(mask)
    tok_lw = logp - rollout
    if reject == "k3":
        keep = ((tok_lw.exp() - 1 - tok_lw) <= 0.02).to(mask.dtype)
    elif reject == "k1":  # row mean of -log w inside [log(1/1.1), log(1.1)]
        row = (-tok_lw * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        keep = ((row >= math.log(1 / 1.1)) & (row <= math.log(1.1))).to(mask.dtype)[:, None].expand_as(mask)
    pg, _ = ppo_clip_loss(logp, logp, data.advantages[idx], mask)
    want = aggregate(pg * w * keep, mask * keep, "seq-mean-token-mean")  # grpo's aggregation
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    n = float(mask.sum())
    assert stats["rollout_corr/weight_mean"] == pytest.approx(float((w * mask).sum()) / n, rel=1e-5)
    assert stats["rollout_corr/frac_rejected"] == pytest.approx(float(((1 - keep) * mask).sum()) / n)
    hit = (raw > 1.3) if mode == "truncate" else ~((raw >= 0.8) & (raw <= 1.2))
    tok = tok_lw.exp()[mask > 0].double()
    assert stats["rollout_corr/weight_max"] == pytest.approx(float(tok.max()), rel=1e-6)
    assert stats["rollout_corr/ess"] == pytest.approx(float(tok.sum() ** 2 / (tok.numel() * (tok**2).sum())), rel=1e-6)
    assert stats["rollout_corr/frac_truncated"] == pytest.approx(float((hit * mask).sum()) / n)
    if reject != "none":
        assert 0 < stats["rollout_corr/frac_rejected"] < 1
    assert 0 < stats["rollout_corr/frac_truncated"] < 1


@pytest.mark.slow
def test_rollout_corr_trains_with_recipes_and_logs_its_metrics(tmp_path):
    rc = "plugins.rollout_corr"
    for name, extra in {"grpo": ["train.ppo_epochs=2", "train.mini_batches=2", "rollout.autocast_bf16=true"],
                        "dapo": ["recipe=dapo", "algo.dynamic_sampling=false", f"{rc}.reject=k3",
                                 f"{rc}.reject_threshold=1e-3"],
                        "mesh": ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1",
                                 f"{rc}.level=sequence", f"{rc}.mode=mask"]}.items():
        hist = train(load_config(overrides=[*TINY, "steps=2", f"{rc}.enabled=true", *extra]), tmp_path / name)
        for m in hist:
            for key in ("rollout_corr/weight_mean", "rollout_corr/frac_truncated", "rollout_corr/frac_rejected",
                        "loss/total", "mismatch/logp_absdiff_p99"):
                assert math.isfinite(m[key]), (name, key)
        assert "rollout_corr:" in (tmp_path / name / "config.yaml").read_text()


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.rollout_corr.level=row", "plugins.rollout_corr.level"),
    ("plugins.rollout_corr.mode=clip", "plugins.rollout_corr.mode"),
    ("plugins.rollout_corr.threshold=0", "plugins.rollout_corr.threshold"),
    ("plugins.rollout_corr.hi=0.1", "plugins.rollout_corr.hi"),
    ("plugins.rollout_corr.reject=k4", "plugins.rollout_corr.reject"),
    ("plugins.rollout_corr.reject=k3", "plugins.rollout_corr.reject_threshold"),
])
def test_rollout_corr_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[*TINY, override])


def test_rollout_corr_is_a_loss_plugin():
    from meshrl.trainer.plugins import REGISTRY, UPDATE_HOOKS, Plugin

    cls = REGISTRY["rollout_corr"]  # an update hook: one process, every row backward, as the other loss plug-ins
    assert any(getattr(cls, h) is not getattr(Plugin, h) for h in UPDATE_HOOKS)


@pytest.mark.skipif(not fork_available(), reason="no fork")
def test_mismatch_with_the_update_split_over_processes(tmp_path):
    """Parts of each micro-batch run in forked update workers; their log-probs come back to the parent."""
    over = [o for o in TINY if not o.startswith("train.update_workers")]
    hist = train(load_config(overrides=[*over, "steps=1", "train.update_workers=2", "train.micro_batch_size=8"]),
                 tmp_path / "split")
    assert 0 <= hist[0]["mismatch/logp_absdiff_max"] < 1e-5
