"""The meshrl actor loss wrapper on a micro-batch built as verl's FSDP engine hands it over (nested tensors).

The wrapper must add exactly the strategy-balancing gradient of :mod:`meshrl.mesh` (computed independently from
the ids) and the sampled JS penalty, on top of verl's own ``ppo_loss``; missing fields are errors naming them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import agg_loss  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from meshrl.algos import js_sampled  # noqa: E402
from meshrl.integrations.verl.balance_step import balance_fields  # noqa: E402
from meshrl.integrations.verl.loss_fn import mesh_loss  # noqa: E402
from meshrl.integrations.verl.settings import BALANCE_WEIGHT, MeshSettings, settings_from_config  # noqa: E402
from meshrl.mesh import strategy_balance_loss  # noqa: E402

PROMPT_LENS = [3, 2, 4, 3, 2, 5, 3, 2]
RESPONSE_LENS = [4, 6, 3, 5, 6, 2, 4, 5]
QUERIES = ["q0", "q0", "q0", "q0", "q1", "q1", "q1", "q1"]
STRATEGIES = [0, 0, 1, 1, 0, 0, 1, 1]
SCORES = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def micro_batch(seed: int = 0, dp_size: int = 1):
    """``(model_output, data, leaf [B, T] response log-probs, padded mask, padded ref log-probs)``."""
    g = torch.Generator().manual_seed(seed)
    n, t_max = len(PROMPT_LENS), max(RESPONSE_LENS)
    leaf = (-torch.rand(n, t_max, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    mask = torch.zeros(n, t_max)
    for i, r in enumerate(RESPONSE_LENS):
        mask[i, :r] = 1.0
    mask[1, 2] = mask[3, 1] = mask[4, 3] = 0.0  # holes inside responses
    ref = -torch.rand(n, t_max, generator=g, dtype=torch.float64) * 2
    # The engine's log-probs cover whole sequences: response token k of row i sits at offset + P_i - 1 + k.
    full = [torch.cat([leaf.new_zeros(p - 1), leaf[i, :r], leaf.new_zeros(1)])
            for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True))]
    values = torch.cat(full)
    offsets = torch.tensor([0] + [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]).cumsum(0)
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets)}
    old = leaf.detach()  # on-policy: the weights are computed at the current parameters
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    fields = {
        "prompts": nested([torch.arange(p) for p in PROMPT_LENS]),
        "responses": nested([torch.arange(r) for r in RESPONSE_LENS]),
        "response_mask": nested([mask[i, :r] for i, r in enumerate(RESPONSE_LENS)]),
        "old_log_probs": nested([old[i, :r] for i, r in enumerate(RESPONSE_LENS)]),
        "advantages": nested([adv[i].expand(r).clone() for i, r in enumerate(RESPONSE_LENS)]),
        "ref_log_prob": nested([ref[i, :r] for i, r in enumerate(RESPONSE_LENS)]),
    }
    data = tu.get_tensordict(fields)
    tokens = int(mask.sum()) * dp_size
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=tokens if dp_size > 1 else None,
                         global_batch_size=n * dp_size if dp_size > 1 else None)
    return model_output, data, leaf, mask.double(), ref


def weights_for(mask, old, ref, mesh):
    extra = [{"query_id": q, "strategy_id": s} for q, s in zip(QUERIES, STRATEGIES, strict=True)]
    scores = torch.zeros_like(mask)
    for i, (r, s) in enumerate(zip(RESPONSE_LENS, SCORES, strict=True)):
        scores[i, r - 1] = s  # verl writes the score on the last response token
    return balance_fields(extra, scores, mask, old, ref, mesh)


def config() -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=8,
                       clip_ratio=0.2, loss_agg_mode="token-mean")


@pytest.mark.parametrize("dp_size", [1, 2])
def test_wrapper_adds_the_balancing_gradient_of_meshrl_mesh(dp_size):
    mesh = MeshSettings(mu=0.5, subtract_ref=True)
    model_output, data, leaf, mask, ref = micro_batch(seed=dp_size, dp_size=dp_size)
    fields, metrics = weights_for(mask, leaf.detach(), ref, mesh)
    data[BALANCE_WEIGHT] = fields[BALANCE_WEIGHT]
    cfg = config()
    total, out_metrics = mesh_loss(model_output, data, config=cfg, mesh=mesh)
    base, _ = ppo_loss(cfg, model_output, data)
    g_total, g_base = (torch.autograd.grad(x, leaf, retain_graph=True)[0] for x in (total, base))
    # Independent: meshrl.mesh's loss on the rows' summed response log-probs, with its own autograd.
    seq = (leaf * mask).sum(-1)
    correct = torch.tensor([s >= 1.0 for s in SCORES])
    want, want_metrics = strategy_balance_loss(seq, (ref * mask).sum(-1), correct, QUERIES, STRATEGIES, 0.5)
    (g_want,) = torch.autograd.grad(want, leaf)
    torch.testing.assert_close(g_total - g_base, dp_size * g_want)
    assert g_want.abs().sum() > 0  # the term acts on this batch (both queries have two strategies)
    assert metrics["mesh/balance_loss"] == pytest.approx(want_metrics["mesh/balance_loss"])
    assert metrics["mesh/balance_queries"] == 2.0
    assert "meshrl/balance_surrogate" in out_metrics


def test_sampled_js_term_and_no_op_settings():
    mesh = MeshSettings(mu=0.0, js_coef=0.1, subtract_ref=False)
    model_output, data, leaf, mask, ref = micro_batch(seed=5)
    cfg = config()
    total, metrics = mesh_loss(model_output, data, config=cfg, mesh=mesh)
    base, _ = ppo_loss(cfg, model_output, data)
    js = agg_loss(loss_mat=js_sampled(leaf, ref), loss_mask=mask.bool(), loss_agg_mode="token-mean")
    torch.testing.assert_close(total - base, 0.1 * js)
    torch.testing.assert_close(torch.autograd.grad(total - base, leaf)[0], 0.1 * torch.autograd.grad(js, leaf)[0])
    assert metrics["meshrl/js"].aggregate() == pytest.approx(float(js))
    plain, _ = mesh_loss(model_output, data, config=cfg, mesh=MeshSettings(mu=0.0, subtract_ref=False))
    torch.testing.assert_close(plain, base)


def test_js_metric_over_micro_batches_is_the_mini_batch_mean_as_the_engine_normalises():
    """verl's FSDP engine always sets ``batch_num_tokens`` (the mini-batch's), so each micro-batch's JS term is
    its share of the mini-batch mean and the shares must be added: the metric was averaged on one GPU (half
    the true value for two micro-batches)."""
    mesh = MeshSettings(mu=0.0, js_coef=0.1, subtract_ref=False)
    model_output, data, leaf, mask, ref = micro_batch(seed=7)
    halves = [slice(0, 4), slice(4, 8)]
    tokens = int(mask.sum())
    combined = None
    for rows in halves:
        part_output = {"log_probs": nested(list(model_output["log_probs"].unbind())[rows])}
        part = tu.get_tensordict({k: nested(list(data[k].unbind())[rows]) for k in (
            "prompts", "responses", "response_mask", "old_log_probs", "advantages", "ref_log_prob")})
        tu.assign_non_tensor(part, dp_size=1, batch_num_tokens=tokens, global_batch_size=None)
        cfg = config()
        _, metrics = mesh_loss(part_output, part, config=cfg, mesh=mesh)
        _, base_metrics = ppo_loss(cfg, part_output, part)
        assert metrics["meshrl/js"].aggregation == base_metrics["actor/pg_loss"].aggregation
        if combined is None:
            combined = metrics["meshrl/js"]
        else:
            combined.append(metrics["meshrl/js"])
    whole = agg_loss(loss_mat=js_sampled(leaf, ref), loss_mask=mask.bool(), loss_agg_mode="token-mean")
    assert combined.aggregate() == pytest.approx(float(whole))


def test_missing_fields_are_errors_naming_them():
    model_output, data, _leaf, _mask, _ref = micro_batch()
    with pytest.raises(ValueError, match="no field 'meshrl_balance_weight'.*trainer_mode=meshrl"):
        mesh_loss(model_output, data, config=config(), mesh=MeshSettings(mu=1e-3))
    del data["ref_log_prob"]
    with pytest.raises(ValueError, match="no field 'ref_log_prob'.*use_kl_loss=true"):
        mesh_loss(model_output, data, config=config(), mesh=MeshSettings(mu=0.0, js_coef=0.1))


def test_batch_rows_without_ids_are_errors_naming_row_and_field():
    mask = torch.ones(2, 3, dtype=torch.float64)
    lp = -torch.ones(2, 3, dtype=torch.float64)
    mesh = MeshSettings(mu=1e-3, subtract_ref=False)
    with pytest.raises(ValueError, match=r"row 1: extra_info has no 'strategy_id'"):
        balance_fields([{"query_id": "a", "strategy_id": 0}, {"query_id": "a"}], mask, mask, lp, None, mesh)
    with pytest.raises(ValueError, match=r"row 0: field 'extra_info' must be a dict"):
        balance_fields([None, {"query_id": "a", "strategy_id": 0}], mask, mask, lp, None, mesh)
    with pytest.raises(ValueError, match="subtract_ref=true needs verl's reference log-probs"):
        balance_fields([{"query_id": "a", "strategy_id": 0}] * 2, mask, mask, lp, None, MeshSettings(mu=1e-3))
    # Padding rows (verl fills a batch to a multiple of the DP size) need no ids and get weight 0.
    fields, _ = balance_fields([{"query_id": "a", "strategy_id": 0}, None], mask, mask, lp, None, mesh,
                               padding=[False, True])
    assert fields[BALANCE_WEIGHT][1] == 0 and fields["meshrl_query_id"].tolist() == [0, -1]


def test_settings_are_checked():
    assert settings_from_config({"mu": 1, "reduction": "sum"}) == MeshSettings(mu=1.0, reduction="sum")
    with pytest.raises(ValueError, match=r"unknown meshrl setting\(s\) \['m'\]"):
        settings_from_config({"m": 4})
    with pytest.raises(ValueError, match="meshrl.mu must be a finite number"):
        settings_from_config({"mu": -1.0})
    with pytest.raises(ValueError, match="meshrl.reduction must be one of"):
        settings_from_config({"reduction": "max"})
