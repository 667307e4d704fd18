"""Mesh Learning in the trainer: budgets, prefixes, placement masking, balancing metrics, CLI coach."""

from __future__ import annotations

import pytest
import torch

from meshrl.cli import main as cli_main
from meshrl.jsonl import read_jsonl
from meshrl.tasks.tiny import RepeatTask
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import response_logits, token_logprobs

BASE = [*TINY_RUN, "rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.max_new_tokens=4",
        "train.micro_batch_size=8", "optim.lr=1e-5"]


def _cfg(*extra: str, steps: int = 2):
    return load_config(overrides=[*BASE, f"steps={steps}", *extra])


def test_matched_budget_samples_as_many_rollouts_as_grpo(tmp_path):
    counts = {}
    for recipe in ("grpo", "cp_only", "mesh"):
        hist = train(_cfg(f"recipe={recipe}"), tmp_path / recipe)
        counts[recipe] = [m["rollouts/count"] for m in hist]
    assert counts["grpo"] == counts["cp_only"] == counts["mesh"] == [16.0, 16.0]


def test_per_prefix_budget_samples_m_times_more(tmp_path):
    hist = train(_cfg("recipe=cp_only", "mesh.budget=per_prefix", steps=1), tmp_path / "pp")
    assert hist[0]["rollouts/count"] == 2 * 8 * 4


def test_matched_budget_requires_divisible_group_size():
    with pytest.raises(ValueError, match="group_size=6.*mesh.m=4"):
        _cfg("recipe=mesh", "rollout.group_size=6")


def test_prefix_groups_and_advantage_units(tmp_path):
    tr = Trainer(_cfg("recipe=cp_only"), tmp_path / "g")
    data, _ = tr.sampler.run(0, 0)
    assert sorted(set(data.strategy_ids)) == [0, 1, 2, 3]
    assert len(set(data.group_ids)) == 2 * 4  # per prefix group (the release's unit)
    for gid in set(data.group_ids):  # advantages sum to zero inside each prefix group
        rows = [i for i, g in enumerate(data.group_ids) if g == gid]
        assert abs(float(data.advantages[rows].sum())) < 1e-4
    tr_q = Trainer(_cfg("recipe=cp_only", "mesh.adv_unit=query"), tmp_path / "q")
    data_q, _ = tr_q.sampler.run(0, 0)
    assert len(set(data_q.group_ids)) == 2


@pytest.mark.parametrize("placement", ["system", "assistant"])
def test_prefix_is_in_the_prompt_and_coach_tokens_get_no_gradient(placement, tmp_path):
    from meshrl.mesh import wrap_prefix

    tr = Trainer(_cfg("recipe=cp_only", f"mesh.placement={placement}"), tmp_path / placement)
    data, _ = tr.sampler.run(0, 0)
    prob, k = data.problems[0], data.strategy_ids[0]
    text = tr.tokenizer.decode(data.prompt_ids[0])
    prefix_text = tr.sampler.prefixes[prob.id][k]
    assert prefix_text[:20] in text
    if placement == "assistant":
        tail = tr.tokenizer.encode(wrap_prefix(prefix_text, "assistant"), add_special_tokens=False)
        assert data.prompt_ids[0][-len(tail):] == tail  # prefix ends the prompt, outside the response
    # Gradient of a response-only loss with respect to the logits at every prompt position is exactly 0.
    mb = tr.forward.collate(data.prompt_ids[:2], data.response_ids[:2])
    captured = {}

    def keep_logits(module, args, output):
        output.logits.retain_grad()
        captured.setdefault("logits", []).append(output.logits)

    handle = tr.model.register_forward_hook(keep_logits)
    try:
        logp = token_logprobs(response_logits(tr.model, mb, share_prompts=False), mb.response_ids)
        (logp * mb.response_mask).sum().backward()
        captured["shared"] = captured.pop("logits")
        tr.model.zero_grad()
        logp_shared = token_logprobs(response_logits(tr.model, mb, share_prompts=True), mb.response_ids)
        (logp_shared * mb.response_mask).sum().backward()
    finally:
        handle.remove()
    (one_pass,) = captured["shared"]
    grad = one_pass.grad
    t = mb.response_ids.shape[1]
    # Only the logits from the last prompt position on are computed at all (logits_to_keep = T + 1), so the
    # log-probabilities of prompt and coach tokens cannot enter any loss term; of those kept, the last one
    # (predicting past the response) gets exactly zero gradient and the response positions get some.
    assert grad.shape[1] == t + 1 < mb.input_ids.shape[1]
    assert torch.count_nonzero(grad[:, t:]) == 0
    assert torch.count_nonzero(grad[:, :t]) > 0
    # Shared prompts: the prompt pass unembeds its last position only (it predicts response token 0); the
    # response passes see response tokens only. Same log-probs either way.
    prompt_pass, *response_passes = captured["logits"]
    assert prompt_pass.shape[1] == 1 and torch.count_nonzero(prompt_pass.grad) > 0
    assert all(r.shape[1] <= t - 1 for r in response_passes)
    assert torch.allclose(logp_shared * mb.response_mask, logp * mb.response_mask, atol=1e-5)


def test_mesh_balancing_metrics_and_gradient_ratio(tmp_path, monkeypatch):
    # Make about half the rollouts "correct" (parity of the characters' code points, whatever the sampled
    # lengths) so that several strategies qualify for the balancing term.
    monkeypatch.setattr(RepeatTask, "score", lambda self, completion, problem: float(sum(map(ord, completion)) % 2))
    hist = train(_cfg("recipe=mesh", "mesh.mu=0.1", steps=2), tmp_path / "mesh")
    last = hist[-1]
    for key in ("mesh/balance_loss", "mesh/active_strategies", "mesh/grad_ratio", "mesh/balance_mu"):
        assert key in last, key
    assert last["mesh/balance_queries"] >= 1 and last["mesh/active_strategies"] > 1
    assert last["mesh/grad_ratio"] > 0
    cfg_text = (tmp_path / "mesh" / "config.yaml").read_text()
    assert "balance_mu: 0.1" in cfg_text and "placement: system" in cfg_text and "budget: matched" in cfg_text


def test_cp_only_has_no_balancing_term(tmp_path, monkeypatch):
    monkeypatch.setattr(RepeatTask, "score", lambda self, completion, problem: float(len(completion) % 2))
    hist = train(_cfg("recipe=cp_only", "mesh.mu=0.1", steps=1), tmp_path / "cp")
    assert "mesh/grad_ratio" not in hist[0]


def test_coach_cli_then_train_with_the_prefix_file(tmp_path):
    out = tmp_path / "prefixes.jsonl"
    assert cli_main(["coach", "--task", "tiny:add", "--backend", "rule", "--out", str(out)]) == 0
    assert len(read_jsonl(out)) == 80
    rc = cli_main(["train", "--recipe", "mesh", "--model", "tiny", "--task", "tiny:add", "--steps", "1",
                   "--out", str(tmp_path / "run"), "--no-progress", "--set", f"mesh.prefixes={out}",
                   "--set", "rollout.max_new_tokens=3", "--set", "rollout.prompts_per_step=2"])
    assert rc == 0
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["rollouts/count"] == 16


def test_missing_prefixes_are_an_error_naming_problems(tmp_path):
    out = tmp_path / "prefixes.jsonl"
    cli_main(["coach", "--task", "tiny:add", "--backend", "rule", "--out", str(out), "--limit", "3"])
    with pytest.raises(ValueError, match="have no 4 valid prefixes"):
        Trainer(load_config(overrides=[*BASE, "task=tiny:add", "recipe=mesh", f"mesh.prefixes={out}"]),
                tmp_path / "run")


def test_task_without_rule_strategies_needs_a_prefix_file(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"problem": "1+1", "answer": "2"}\n')
    with pytest.raises(ValueError, match="no rule strategies"):
        Trainer(load_config(overrides=[*BASE, f"task=jsonl:{f}", "recipe=mesh"]), tmp_path / "run")


def test_mesh_samples_record_their_conditioning_for_census(tmp_path):
    from meshrl.analysis import census

    train(_cfg("recipe=cp_only", "log.samples_per_step=-1", steps=1), tmp_path / "s")
    rows = read_jsonl(tmp_path / "s" / "samples.jsonl")
    assert len(rows) == 16 and all(r["strategy"] in (0, 1, 2, 3) and "system" in r for r in rows)
    out = census(str(tmp_path / "s"), tmp_path / "s" / "samples.jsonl", eps=0.05, progress=False)
    assert out["total"]["n_groups"] == 2 and out["total"]["n_rollouts"] == 16


@pytest.mark.parametrize("placement", ["system", "assistant"])
def test_plain_template_conditions_on_the_prefix_text_alone(placement, tmp_path):
    from meshrl.mesh import wrap_prefix

    tr = Trainer(_cfg("recipe=cp_only", "mesh.template=plain", f"mesh.placement={placement}"), tmp_path / placement)
    prob = tr.sampler.problems[0]
    prefix = tr.sampler.prefixes[prob.id][1]
    key = "system" if placement == "system" else "assistant_prefix"
    assert tr.sampler.conditioning(prob, 1) == {key: prefix}
    wrapped = Trainer(_cfg("recipe=cp_only", f"mesh.placement={placement}"), tmp_path / f"w{placement}")
    assert wrapped.sampler.conditioning(prob, 1) == {key: wrap_prefix(prefix, placement)}
    assert len(tr.sampler.prompt_ids(prob, 1)) < len(wrapped.sampler.prompt_ids(prob, 1))


def test_unknown_template_is_rejected():
    with pytest.raises(ValueError, match="mesh.template='fancy'"):
        _cfg("recipe=mesh", "mesh.template=fancy")


@pytest.mark.parametrize("balance", ["paper", "support"])
def test_bare_group_samples_without_prefix_at_the_matched_budget(balance, tmp_path):
    tr = Trainer(_cfg("recipe=mesh", "mesh.m=3", "mesh.bare_group=true", f"mesh.balance={balance}", "mesh.mu=0.5"),
                 tmp_path / balance)
    data, _ = tr.sampler.run(0, 0)
    assert len(data) == 2 * 8  # matched: 3 prefix groups + 1 bare group of 2 = G = 8 per query
    assert sorted(set(data.strategy_ids)) == [-1, 0, 1, 2]
    bare = [i for i, k in enumerate(data.strategy_ids) if k == -1]
    assert len(bare) == 2 * 2
    bare_prompt = tr.sampler.prompt_ids(data.problems[bare[0]], -1)
    assert data.prompt_ids[bare[0]] == bare_prompt  # no coach text in the bare group's prompt
    assert all(data.group_ids[i] == (data.query_ids[i], -1) for i in bare)  # its own advantage group
    data.scores = [1.0] * len(data)  # everything correct: every strategy cell is active
    if balance == "paper":
        from meshrl.trainer.balance import balance_row_weights

        seq = torch.randn(len(data))
        w, _ = balance_row_weights(tr.cfg, data, seq, seq * 0)
    else:
        tr.balance.begin_update(data, None, None)
        w = tr.balance.support_weights
    assert all(float(w[i]) == 0.0 for i in bare)  # the bare group is not a strategy to balance
    assert any(float(w[i]) != 0.0 for i in range(len(data)) if i not in bare)


def test_bare_group_needs_divisible_group_size():
    with pytest.raises(ValueError, match=r"mesh.m=3 \+ 1 \(mesh.bare_group\)"):
        _cfg("recipe=mesh", "mesh.m=3", "mesh.bare_group=true", "rollout.group_size=6")


def test_paper_balance_of_a_replayed_batch_uses_its_behaviour_logprobs(tmp_path):
    """The paper's balancing weights are a function of the batch's sampling distribution: for a batch that
    plugins.replay reuses, that is the earlier policy that sampled it (its stored log-probs), not the current one."""
    from meshrl.trainer import Trainer

    tr = Trainer(_cfg("recipe=mesh", "mesh.mu=0.1", "plugins.replay.reuse_steps=1", "optim.lr=1e-2", steps=2),
                 tmp_path / "run")
    seen = []
    begin = tr.balance.begin_update

    def recording(data, logps, ref_logps):
        seen.append([lp.clone() for lp in logps])
        return begin(data, logps, ref_logps)

    tr.balance.begin_update = recording
    tr.step()
    behaviour = [lp.clone() for lp in tr.plugins.get("replay").stored[1]]
    tr.step()  # the same batch again, after an optimiser step (lr 1e-2 moves the policy)
    assert len(seen) == 2
    for fresh, sampled in zip(seen[0], behaviour, strict=True):
        torch.testing.assert_close(fresh, sampled)
    for replayed, sampled in zip(seen[1], behaviour, strict=True):
        torch.testing.assert_close(replayed, sampled)
    current = tr.forward.logps(tr.model, tr.plugins.get("replay").stored[0])
    assert max((a - b).abs().max().item() for a, b in zip(current, behaviour, strict=True)) > 1e-4
