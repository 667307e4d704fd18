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


def _groups(tok, seed: int = 0):
    """Rows as a GRPO step makes them: 3 prompts of different lengths x 4 responses of 0..9 tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [[int(t) for t in torch.randint(4, len(tok), (n,), generator=gen)] for n in (7, 3, 5)]
    rows_p, rows_r = [], []
    for p in prompts:
        for _ in range(4):
            length = int(torch.randint(0, 10, (1,), generator=gen))
            rows_p.append(p)
            rows_r.append([int(t) for t in torch.randint(4, len(tok), (length,), generator=gen)])
    rows_r[1] = [9]  # a one-token response: only the prompt pass predicts it
    return collate(rows_p, rows_r, tok.pad_token_id)


def _logp_and_grads(model, mb, **kw):
    model.zero_grad()
    lp = token_logprobs(response_logits(model, mb, **kw), mb.response_ids) * mb.response_mask
    (lp.sum() + (lp ** 2).sum()).backward()
    return lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("pack, buckets", [(True, 2), (False, 1), (False, 2), (False, 3), (False, 12)])
def test_shared_prompt_forward_equals_one_pass_logprobs_and_gradients(pack, buckets):
    from meshrl.models import load_model

    model, tok = load_model("tiny:small", seed=3)
    mb = _groups(tok)
    ref_lp, ref_grads = _logp_and_grads(model, mb, share_prompts=False)
    lp, grads = _logp_and_grads(model, mb, share_prompts=True, pack=pack, length_buckets=buckets)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads, strict=True):  # fp32 sums in another order: ~1e-5 of the largest entry
        torch.testing.assert_close(g, r, atol=1e-4 * float(r.abs().max()), rtol=1e-3)
    # Positions past the longest response of a length bucket are never computed (zeros); finite everywhere.
    logits = response_logits(model, mb, pack=pack, length_buckets=buckets)
    assert torch.isfinite(logits).all()
    if pack:  # packed outputs land on response positions only (position 0 always holds the prompt's logits)
        assert torch.count_nonzero(logits[:, 1:][mb.response_mask[:, 1:] == 0]) == 0
    elif buckets == 1:
        assert torch.count_nonzero(logits[:, mb.response_mask.sum(-1).long().max():]) == 0


def test_shared_prompt_forward_with_lora_and_pad_equal_to_eos():
    from meshrl.models import apply_lora, build_tiny

    model, tok = build_tiny("tiny", seed=1, pad_is_eos=True)
    peft = apply_lora(model, r=4, alpha=8)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)
    mb = _groups(tok, seed=1)
    ref_lp, ref_grads = _logp_and_grads(peft, mb, share_prompts=False)
    lp, grads = _logp_and_grads(peft, mb)  # packed: the peft wrapper passes the 4-D mask through
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):  # fp32 sums in another order: ~1e-5 of the largest entry
        torch.testing.assert_close(g, r, atol=1e-4 * float(r.abs().max()), rtol=1e-3)


def test_models_without_a_cache_argument_use_one_pass():
    from meshrl.models import load_model

    model, tok = load_model("tiny", seed=0)

    class NoCache(torch.nn.Module):  # a forward that cannot take a KV cache back
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask, position_ids, use_cache=False, logits_to_keep=0):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, logits_to_keep=logits_to_keep)

    mb = _groups(tok)
    with torch.no_grad():
        torch.testing.assert_close(response_logits(NoCache(), mb), response_logits(model, mb, share_prompts=False))


def test_length_bucket_cuts_minimise_padding_like_brute_force():
    import itertools
    import random

    from meshrl.trainer.shared_prompts import length_bucket_cuts

    def padded(lengths, cuts):
        return sum((b - a) * lengths[b - 1] for a, b in zip(cuts, cuts[1:], strict=False))

    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 8), rng.randint(1, 4)
        lengths = sorted(rng.randint(0, 20) for _ in range(n))
        cuts = length_bucket_cuts(lengths, k)
        assert cuts[0] == 0 and cuts[-1] == n and len(cuts) - 1 <= k and cuts == sorted(set(cuts))
        best = min(padded(lengths, [0, *c, n]) for m in range(k) for c in itertools.combinations(range(1, n), m))
        assert padded(lengths, cuts) == best
    assert length_bucket_cuts([], 3) == [0]
    # A third of the rows at the cap: 2 buckets put exactly those together.
    assert length_bucket_cuts([5, 6, 7, 8, 64, 64], 2) == [0, 4, 6]


def test_prompts_equal_up_to_padding_are_not_merged():
    """With pad == eos, [eos, a, b] and [a, b] left-pad to the same ids; only the mask tells them apart."""
    from meshrl.models import build_tiny

    model, tok = build_tiny("tiny", seed=2, pad_is_eos=True)
    eos, a, b = tok.eos_token_id, 10, 11
    mb = collate([[eos, a, b], [a, b]], [[12, 13, 14], [12, 13, 14]], tok.pad_token_id)
    assert mb.input_ids[0].tolist() == mb.input_ids[1].tolist()
    with torch.no_grad():
        one = token_logprobs(response_logits(model, mb, share_prompts=False), mb.response_ids)
        shared = token_logprobs(response_logits(model, mb), mb.response_ids)
    torch.testing.assert_close(shared, one, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_in_training_mode_uses_one_pass():
    from meshrl.models import load_model

    model, tok = load_model("tiny", seed=0)
    model.gradient_checkpointing_enable()
    model.train()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    mb = _groups(tok)
    response_logits(model, mb)
    assert len(calls) == 1


def test_pack_responses_first_fit_decreasing_within_each_prompt():
    from meshrl.trainer.shared_prompts import pack_responses

    prompt_of = [0, 0, 0, 0, 1, 1, 1]
    widths = [9, 2, 5, 4, 0, 3, 6]
    bins, cap = pack_responses(prompt_of, widths)
    assert cap == 9
    placed = sorted(row for b in bins for row, _ in b)
    assert placed == [0, 1, 2, 3, 5, 6]  # width 0 (a one-token response) needs no slot
    for b in bins:
        assert len({prompt_of[row] for row, _ in b}) == 1
        spans = sorted((off, off + widths[row]) for row, off in b)
        assert spans[-1][1] <= cap and all(a[1] <= c[0] for a, c in zip(spans, spans[1:], strict=False))
    # 9 | 5+4 | 2 for prompt 0; 6+3 for prompt 1: 4 rows of 9 instead of 6.
    assert len(bins) == 4
