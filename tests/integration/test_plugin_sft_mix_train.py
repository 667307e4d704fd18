"""``plugins.sft_mix`` (ReLIFT's SFT on the hardest problems, MIFO's high-entropy tokens) in the trainer: the
hard-problem buffer against a count done by hand, the term against a loop over tokens, the buffer through a
checkpoint, the update's gradient, a resumed run, and training steps on the tiny model (the SFT loss and the
settings: tests/unit/test_plugin_sft_mix.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshrl.runs.correct import is_correct
from meshrl.testing import tiny_config
from meshrl.trainer import Trainer, train
from meshrl.trainer.plugins.sft_mix import SftMix


def _traces(tmp_path, problems) -> str:
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "completion": p.answer}) + "\n" for p in problems))
    return str(path)


def _trainer(tmp_path, *extra: str, traces_for=lambda ps: ps) -> Trainer:
    from meshrl.tasks import load_task

    problems = load_task("tiny:repeat", seed=0).problems("train")
    demos = _traces(tmp_path, traces_for(problems))
    cfg = tiny_config("plugins.sft_mix.enabled=true", f"plugins.sft_mix.traces={demos}", *extra)
    return Trainer(cfg, tmp_path / "run")


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile, written out (the rule of numpy's and torch's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_hard_problems_are_buffered_with_their_demonstration(tmp_path):
    # hard_max_acc 0.5: a problem whose step rollouts are at most half correct is hard; half the problems have a
    # demonstration, the others are counted as hard without one.
    t = _trainer(tmp_path, "plugins.sft_mix.hard_max_acc=0.5", "rollout.prompts_per_step=8",
                 traces_for=lambda ps: ps[: len(ps) // 2])
    plugin = t.plugins.get("sft_mix")
    data, _ = t.sampler.run(0, 0)
    plugin.batch_ready(0, data)
    with_demo = set(plugin.traces)
    by_problem: dict[str, list[float]] = {}
    for _, score, p in data.seen:
        by_problem.setdefault(str(p.id), []).append(score)
    hard = [pid for pid, s in by_problem.items() if sum(map(is_correct, s)) / len(s) <= 0.5]
    assert hard, "the untrained tiny policy should fail some problems"
    assert data.stats["sft/hard_groups"] == len(hard)
    assert data.stats["sft/hard_without_trace"] == len([p for p in hard if p not in with_demo])
    by_id = {str(p.id): p for p in t.problems}
    want = [(t.sampler.prompt_ids(by_id[p], -1), plugin.traces[p][0]) for p in hard if p in with_demo]
    assert len(plugin.buffer) == len(want)
    for (prompt, ids), (want_prompt, text) in zip(plugin.buffer, want, strict=True):
        assert prompt == want_prompt
        assert ids == t.tokenizer(text, add_special_tokens=False)["input_ids"] + [t.tokenizer.eos_token_id]


def test_term_equals_a_loop_over_tokens_and_is_added_once_per_step(tmp_path):
    t = _trainer(tmp_path, "plugins.sft_mix.batch_size=3", "plugins.sft_mix.top_entropy_frac=0.4",
                 "plugins.sft_mix.coef=0.5")
    plugin: SftMix = t.plugins.get("sft_mix")
    by_id = {str(p.id): p for p in t.problems}
    for pid in list(plugin.traces)[:4]:  # four examples buffered, three taken
        ids = t.tokenizer(plugin.traces[pid][0], add_special_tokens=False)["input_ids"] + [t.tokenizer.eos_token_id]
        plugin.buffer.append((t.sampler.prompt_ids(by_id[pid], -1), ids))
    data, _ = t.sampler.run(0, 0)
    stats = plugin.begin_update(data, None, None)
    assert stats["sft/rows"] == 3 and stats["sft/buffer"] == 1
    # independent path: each example alone, its own forward, the quantile and the sum written out
    per_token: list[tuple[float, float]] = []  # (entropy, log-prob) of every demonstration token
    with torch.no_grad():
        for prompt, resp in zip(plugin.batch.prompts, plugin.batch.responses, strict=True):
            logits = t.model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1)
            for pos, tok in enumerate(resp):
                ent = float(-(logp[pos].exp() * logp[pos]).sum())
                per_token.append((ent, float(logp[pos, tok])))
    tau = _quantile([e for e, _ in per_token], 1 - 0.4)
    kept = [lp for e, lp in per_token if e >= tau - 1e-6]
    want = -sum(kept) / len(kept)
    assert stats["sft/loss"] == pytest.approx(want, rel=1e-4)
    assert stats["sft/term"] == pytest.approx(0.5 * want, rel=1e-4)
    assert stats["sft/frac_tokens"] == pytest.approx(len(kept) / len(per_token))
    t.model.zero_grad(set_to_none=True)
    assert plugin.surrogate([0], torch.zeros(1)) == 0.0  # its gradient is back-propagated chunk by chunk
    grads = [p.grad.clone() for p in t.model.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().max()) > 0 for g in grads)
    assert plugin.surrogate([1], torch.zeros(1)) == 0.0  # once per step: no second gradient
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, [p for p in t.model.parameters() if p.grad is not None],
                                                       strict=True))
    plugin.begin_update(data, None, None)  # one example left: no SFT batch this step
    assert plugin.batch is None and plugin.surrogate([0], torch.zeros(1)) == 0.0


def test_buffer_survives_a_checkpoint(tmp_path):
    t = _trainer(tmp_path, "plugins.sft_mix.hard_max_acc=0.99")
    plugin = t.plugins.get("sft_mix")
    data, _ = t.sampler.run(0, 0)
    plugin.batch_ready(0, data)
    state = json.loads(json.dumps(plugin.state_dict()))
    (tmp_path / "b").mkdir()
    other = _trainer(tmp_path / "b", "plugins.sft_mix.hard_max_acc=0.99").plugins.get("sft_mix")
    other.load_state_dict(state)
    assert other.buffer == plugin.buffer and other.uses == plugin.uses and plugin.buffer


@pytest.mark.parametrize("recipe", [("recipe=grpo",), ("recipe=dapo",), ("algo.policy_loss=gspo",),
                                    ("recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1")])
def test_trains_two_steps_on_tiny(tmp_path, recipe):
    from meshrl.tasks import load_task

    path = _traces(tmp_path, load_task("tiny:repeat", seed=0).problems("train"))
    hist = train(tiny_config(*recipe, "plugins.sft_mix.enabled=true", f"plugins.sft_mix.traces={path}",
                             "plugins.sft_mix.hard_max_acc=0.99", "plugins.sft_mix.batch_size=2"),
                 tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    assert all(m["sft/rows"] == 2 and m["sft/loss"] > 0 for m in hist)
    for m in hist:
        assert math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])


def _update_grads(trainer: Trainer, data) -> list[torch.Tensor]:
    """Gradient of one single-pass update (a zero learning rate, no clipping: the gradient as computed)."""
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
    trainer.update(data)
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.model.parameters()]


@pytest.mark.parametrize("micro", [16, 1])  # 1: the SFT batch runs in two chunks
def test_update_gradient_is_the_rl_gradient_plus_the_sft_terms(tmp_path, micro):
    common = ("train.update_workers=1", "optim.max_grad_norm=1e9", "plugins.sft_mix.batch_size=2",
              "plugins.sft_mix.top_entropy_frac=0.5", "plugins.sft_mix.coef=0.7", f"train.micro_batch_size={micro}")
    (tmp_path / "plain").mkdir()
    plain = Trainer(tiny_config("train.update_workers=1", "optim.max_grad_norm=1e9", f"train.micro_batch_size={micro}"),
                    tmp_path / "plain" / "run")
    plug = _trainer(tmp_path, *common)
    plugin: SftMix = plug.plugins.get("sft_mix")
    by_id = {str(p.id): p for p in plug.problems}
    examples = []
    for pid in list(plugin.traces)[:2]:
        ids = plug.tokenizer(plugin.traces[pid][0], add_special_tokens=False)["input_ids"]
        examples.append((plug.sampler.prompt_ids(by_id[pid], -1), ids + [plug.tokenizer.eos_token_id]))
    plugin.buffer.extend(examples)
    data, _ = plain.sampler.run(0, 0)
    rl = _update_grads(plain, data)
    both = _update_grads(plug, data)
    # the SFT term's gradient, by its own path: per-example forwards, the quantile written out
    model = plain.model  # same initial weights (same seed), not moved by a zero learning rate
    model.zero_grad(set_to_none=True)
    ents, logps = [], []
    for prompt, resp in examples:
        logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1)
        for pos, tok in enumerate(resp):
            ents.append(float(-(lp[pos].exp() * lp[pos]).sum().detach()))
            logps.append(lp[pos, tok])
    tau = _quantile(ents, 0.5)
    kept = [lp for e, lp in zip(ents, logps, strict=True) if e >= tau - 1e-6]
    (0.7 * -torch.stack(kept).sum() / len(kept)).backward()
    sft = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    assert any(float(g.abs().max()) > 0 for g in sft)
    for got, a, b in zip(both, rl, sft, strict=True):
        torch.testing.assert_close(got, a + b, rtol=1e-4, atol=1e-6)


def test_a_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    # batch_size 3 against about 4 hard problems a step: the buffer carries examples across the resume.
    from meshrl.tasks import load_task

    path = _traces(tmp_path, load_task("tiny:repeat", seed=0).problems("train"))
    over = ["plugins.sft_mix.enabled=true", f"plugins.sft_mix.traces={path}", "plugins.sft_mix.hard_max_acc=0.99",
            "plugins.sft_mix.batch_size=3", "plugins.replay.reuse_steps=1", "checkpoint.every=1",
            "checkpoint.keep_last=10", "train.update_workers=1"]
    full = train(tiny_config(*over, steps=5), tmp_path / "full")
    part = tmp_path / "part"
    train(tiny_config(*over, steps=2), part)
    state = json.loads((part / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["plugins"]["sft_mix"]["buffer"]
    resumed = train(tiny_config(*over, steps=5), part, resume=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]  # noqa: E731
    assert strip(resumed) == strip(full[2:])
    assert sum(m["sft/rows"] for m in full) > 0
