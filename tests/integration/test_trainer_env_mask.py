"""Multi-turn episodes in the update: environment tokens (tool output between the model's turns) are masked out of
every loss term (``StepData.response_masks``). The gradient of a masked GRPO / DAPO step equals a hand-built one: each
episode as one plain sequence through the model's own forward, the policy term over the model's tokens only, the
recipe's aggregation written out; an all-ones mask changes no bit; the mask is checked against the response."""

from __future__ import annotations

import copy

import pytest
import torch

from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.batch import collate

BASE = [*TINY_RUN, "rollout.max_new_tokens=8", "optim.max_grad_norm=1e9", "train.micro_batch_size=5"]


def _episodes(trainer: Trainer, seed: int):
    """A step's rollouts turned into episodes: each response gets a run of environment tokens spliced in (tool
    output, drawn from the vocabulary) after its first model tokens, and random advantages."""
    data, _ = trainer.sampler.run(0, 0)
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    masks = []
    for j, r in enumerate(data.response_ids):
        cut = int(torch.randint(1, len(r) + 1, (1,), generator=g))
        env = torch.randint(4, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        data.response_ids[j] = r[:cut] + env + r[cut:]
        masks.append([1] * cut + [0] * len(env) + [1] * (len(r) - cut))
    data.response_masks = masks
    data.advantages = torch.randn(len(data), generator=g)
    return data


def _hand_built_grads(model, data, temperature: float, loss_agg: str) -> list[torch.Tensor]:
    """On-policy, one epoch: the ratio is 1 and the clip inactive, so the policy term's gradient is
    ``-A_i grad log p(y_t)`` per model token, aggregated as the recipe says."""
    model = copy.deepcopy(model).train(False)
    model.zero_grad(set_to_none=True)
    per_row, tokens, rows = [], 0, 0
    for p, r, m, a in zip(data.prompt_ids, data.response_ids, data.response_masks, data.advantages.tolist(),
                          strict=True):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        mask = torch.tensor(m, dtype=torch.float32)
        per_token = -a * torch.exp(logp - logp.detach()) * mask
        per_row.append((per_token.sum(), mask.sum()))
        tokens += int(mask.sum())
        rows += 1
    if loss_agg == "seq-mean-token-mean":
        loss = sum(s / n for s, n in per_row) / rows
    elif loss_agg == "token-mean":
        loss = sum(s for s, _ in per_row) / tokens
    else:
        raise AssertionError(loss_agg)
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["grpo", "dapo"])
def test_masked_step_gradient_equals_the_hand_built_one(tmp_path, recipe):
    trainer = Trainer(load_config(overrides=[*BASE, f"recipe={recipe}"]), tmp_path / recipe)
    try:
        data = _episodes(trainer, 0)
        expected = _hand_built_grads(trainer.model, data, trainer.cfg.rollout.temperature,
                                     trainer.recipe.loss_agg)
        trainer.update(data)
        for (name, p), want in zip(trainer.model.named_parameters(), expected, strict=True):
            assert torch.allclose(p.grad, want, atol=1e-6, rtol=1e-4), name
    finally:
        trainer.close()


def test_environment_tokens_change_nothing_when_unmasked_rows_are_all_ones(tmp_path):
    a = Trainer(load_config(overrides=BASE), tmp_path / "a")
    b = Trainer(load_config(overrides=BASE), tmp_path / "b")
    try:
        data = _episodes(a, 1)
        plain = copy.deepcopy(data)
        plain.response_masks = []
        data.response_masks = [[1] * len(r) for r in data.response_ids]
        m_a, m_b = a.update(data), b.update(plain)
        assert m_a == m_b
        for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad) and torch.equal(p, q)
    finally:
        a.close()
        b.close()


def test_masked_tokens_do_not_reach_the_gradient(tmp_path):
    """Changing only the environment tokens' content changes the gradient (they are context for later model
    tokens) but the loss never scores them: masking every token of a row removes the row's gradient entirely."""
    trainer = Trainer(load_config(overrides=[*BASE, "recipe=grpo"]), tmp_path / "t")
    try:
        data = _episodes(trainer, 2)
        data.advantages[:] = 0.0
        data.advantages[0] = 1.0
        data.response_masks[0] = [0] * len(data.response_ids[0])
        trainer.update(data)
        assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in trainer.model.parameters())
    finally:
        trainer.close()


def test_collate_masks_the_environment_tokens_and_checks_lengths():
    mb = collate([[5, 6], [7]], [[1, 2, 3], [4, 5]], 0, [[1, 0, 1], None])
    assert mb.response_mask.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="row 0: model mask of 2 tokens for a response of 3"):
        collate([[5]], [[1, 2, 3]], 0, [[1, 0]])
    with pytest.raises(ValueError, match="1 model masks for 2 responses"):
        collate([[5], [6]], [[1], [2]], 0, [[1]])
