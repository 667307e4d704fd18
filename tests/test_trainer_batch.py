"""Collation layout, padding invariance of log-probs and exact gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from meshrl.algos import AGG_MODES, aggregate
from meshrl.trainer.batch import collate, micro_weight, response_logits, token_logprobs


@pytest.fixture(scope="module")
def tiny_model():
    from meshrl.models import load_model

    model, tok = load_model("tiny", seed=0)
    return model.eval(), tok


def test_collate_layout_left_pads_prompts_and_right_pads_responses():
    mb = collate([[5, 6], [7]], [[1, 2, 3], [4]], pad_id=0)
    assert mb.prompt_len == 2
    assert mb.input_ids.tolist() == [[5, 6, 1, 2, 3], [0, 7, 4, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert mb.position_ids.tolist()[1][:3] == [0, 0, 1]  # padded row counts real tokens only
    assert mb.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb.num_tokens == 4


def test_collate_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="equal"):
        collate([[1]], [], pad_id=0)


def test_padded_logprobs_equal_unpadded(tiny_model):
    model, tok = tiny_model
    prompts, responses = [[3, 4, 5, 6, 7], [8, 9]], [[10, 11, 12], [13]]
    batch = collate(prompts, responses, pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp_batch = token_logprobs(response_logits(model, batch), batch.response_ids)
        for i in range(2):
            single = collate([prompts[i]], [responses[i]], pad_id=tok.pad_token_id)
            lp_single = token_logprobs(response_logits(model, single), single.response_ids)
            n = len(responses[i])
            torch.testing.assert_close(lp_batch[i, :n], lp_single[0, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_weights_reproduce_the_full_aggregate(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0],
                         [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    full = aggregate(loss, mask, mode, norm_len=5)
    tokens, nonempty, rows = int(mask.sum()), int((mask.sum(-1) > 0).sum()), 6
    acc = torch.tensor(0.0)
    for lo, hi in [(0, 2), (2, 4), (4, 6)]:
        m = mask[lo:hi]
        if m.sum() == 0:
            continue
        acc = acc + aggregate(loss[lo:hi], m, mode, norm_len=5) * micro_weight(mode, m, tokens, nonempty, rows)
    torch.testing.assert_close(acc, full)
