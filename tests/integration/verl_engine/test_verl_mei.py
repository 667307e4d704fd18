"""MEI inside verl: the logits-processor answer of meshrl's loss and the trainer's per-step MEI.

Checked against meshrl.diagnostics computed independently: bias features of the response tokens, their count
sketch, and ``mei_metrics`` per query and per prefix group.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import torch  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from meshrl.diagnostics import bias_features, count_sketch, mei_metrics  # noqa: E402
from meshrl.integrations.verl import trainer as trainer_module  # noqa: E402
from meshrl.integrations.verl.loss_fn import mesh_loss  # noqa: E402
from meshrl.integrations.verl.mei import sketch_fields  # noqa: E402
from meshrl.integrations.verl.settings import MeshSettings  # noqa: E402

PROMPT_LENS = [3, 2, 4, 3, 2, 3]
RESPONSE_LENS = [4, 3, 5, 2, 4, 3]
QUERIES = ["a", "a", "a", "a", "b", "b"]
STRATEGIES = [0, 0, 1, 1, 0, 1]
V, K, SEED = 11, 8, 3


def packed(seed: int = 0):
    """Engine-shaped inputs: packed input ids, ``[1, nnz, V]`` logits, and the padded response view of both."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (p + r,), generator=g) for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]
    input_ids = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    nnz = sum(len(s) for s in seqs)
    logits = torch.randn(1, nnz, V, generator=g, dtype=torch.float64) * 2
    t_max = max(RESPONSE_LENS)
    resp_logits = torch.zeros(len(seqs), t_max, V, dtype=torch.float64)
    resp_tokens = torch.zeros(len(seqs), t_max, dtype=torch.long)
    mask = torch.zeros(len(seqs), t_max)
    start = 0
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        # The logits at position p - 1 + k predict response token k (at position p + k).
        resp_logits[i, :r] = logits[0, start + p - 1 : start + p - 1 + r]
        resp_tokens[i, :r] = seqs[i][p : p + r]
        mask[i, :r] = 1
        start += p + r
    return input_ids, logits, resp_logits, resp_tokens, mask


def test_logits_processor_answer_sums_to_the_sketch_of_bias_features():
    input_ids, logits, resp_logits, resp_tokens, mask = packed()
    mesh = MeshSettings(mu=0.0, subtract_ref=False, mei_sketch=K, mei_seed=SEED)
    out = mesh_loss(student_logits=logits, data={"input_ids": input_ids}, config=None, mesh=mesh)
    assert sorted(out) == sorted(sketch_fields(K)) and all(v.shape == (1, logits.shape[1]) for v in out.values())
    offsets = input_ids.offsets()
    per_row = torch.zeros(len(PROMPT_LENS), K, dtype=torch.float64)
    for k, name in enumerate(sketch_fields(K)):
        values = out[name][0].double()
        for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
            per_row[i, k] = values[offsets[i] + p - 1 : offsets[i] + p - 1 + r].sum()
    want = count_sketch(bias_features(resp_logits, resp_tokens, mask), K, SEED)
    torch.testing.assert_close(per_row, want, rtol=1e-5, atol=1e-5)


def test_forward_only_pass_returns_a_zero_loss_and_top_k_distillation_is_refused():
    input_ids, logits, *_ = packed()
    mesh = MeshSettings(mu=1e-3, subtract_ref=False, mei_sketch=K)
    loss, metrics = mesh_loss({"log_probs": torch.zeros(3)}, {"input_ids": input_ids}, config=None, mesh=mesh)
    assert float(loss) == 0.0 and metrics == {}
    with pytest.raises(ValueError, match="meshrl.mei_sketch is 0"):
        mesh_loss(student_logits=logits, data={"input_ids": input_ids}, config=None, mesh=MeshSettings())


class Group:
    """The actor worker group as the trainer sees it: records what the log-prob call was asked to do."""

    def __init__(self, store):
        self.store, self.seen = store, []

    def compute_log_prob(self, batch):
        self.seen.append(dict(batch.extra_info))
        return batch


def test_old_log_prob_stage_asks_for_the_sketch_and_logs_mei(monkeypatch):
    input_ids, logits, resp_logits, resp_tokens, mask = packed(seed=1)
    mesh = MeshSettings(mu=0.0, subtract_ref=False, mei_sketch=K, mei_seed=SEED)
    token_sketch = mesh_loss(student_logits=logits, data={"input_ids": input_ids}, config=None, mesh=mesh)
    offsets = input_ids.offsets()
    rows = []
    for i, r in enumerate(RESPONSE_LENS):
        row = {name: v[0, offsets[i] : offsets[i + 1]] for name, v in token_sketch.items()}
        row["response_mask"] = torch.ones(r, dtype=torch.long)
        row["extra_info"] = {"query_id": QUERIES[i], "strategy_id": STRATEGIES[i]}
        rows.append(row)
    stored = list_of_dict_to_tensordict(rows)

    def verl_stage(self, batch, metrics):  # what verl's own _compute_old_log_prob does around the call
        batch.extra_info.update({"calculate_entropy": True, "compute_loss": False})
        return self.actor_rollout_wg.compute_log_prob(batch)

    monkeypatch.setattr(PPOTrainerSync, "_compute_old_log_prob", verl_stage)
    monkeypatch.setattr(trainer_module.tq, "kv_batch_get",
                        lambda keys, partition_id, select_fields: stored.select(*select_fields))
    written = []
    monkeypatch.setattr(trainer_module.tq, "kv_batch_put", lambda keys, partition_id, fields: written.append(fields))
    trainer = object.__new__(trainer_module.MeshPPOTrainer)
    trainer.mesh = mesh
    group = trainer.actor_rollout_wg = Group(stored)
    batch = KVBatchMeta(keys=[f"k{i}" for i in range(len(rows))], tags=[{} for _ in rows], partition_id="train")
    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)
    assert group.seen[0]["compute_loss"] is True and group.seen[0]["distillation_use_topk"] is True
    assert batch.extra_info["distillation_use_topk"] is False  # the update pass must not see the flag
    assert group.compute_log_prob.__func__ is Group.compute_log_prob  # the worker group is restored
    phi = count_sketch(bias_features(resp_logits, resp_tokens, mask), K, SEED)
    want = mei_metrics(phi, QUERIES, STRATEGIES, feature=f"bias_sketch{K}")
    assert set(want) <= set(metrics)
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    assert metrics[f"mei/bias_sketch{K}/query_group_size"] == 3.0
    # The per-token sketch fields are overwritten by their per-rollout sums (what the update pass will fetch).
    (small,) = written
    assert sorted(small.keys()) == sorted(sketch_fields(K)) and small.batch_size[0] == len(rows)
    torch.testing.assert_close(torch.stack([small[f] for f in sketch_fields(K)], -1).double(), phi,
                               rtol=1e-5, atol=1e-5)


def test_a_step_without_the_sketch_is_counted_not_fatal(monkeypatch):
    def missing(keys, partition_id, select_fields):
        raise KeyError("meshrl_mei_sketch_0")

    monkeypatch.setattr(trainer_module.tq, "kv_batch_get", missing)
    trainer = object.__new__(trainer_module.MeshPPOTrainer)
    trainer.mesh = MeshSettings(mu=0.0, subtract_ref=False, mei_sketch=K)
    batch = KVBatchMeta(keys=["k0"], tags=[{}], partition_id="train")
    assert trainer._step_mei(batch) == {"mei/skipped_steps": 1.0}
    assert trainer._step_mei(batch) == {"mei/skipped_steps": 2.0}
