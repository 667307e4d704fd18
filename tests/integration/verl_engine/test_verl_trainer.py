"""The ``meshrl`` trainer mode's two stages on rows stored as verl's agent loop stores them (no Ray, no GPU).

TransferQueue's ``kv_batch_get`` / ``kv_batch_put`` are replaced by an in-memory store holding a TensorDict built
with verl's own ``list_of_dict_to_tensordict`` (what ``AgentLoopWorkerTQ`` puts per rollout), so the field names,
nested tensors and ``extra_info`` stacks the stage reads are the engine's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import torch  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from meshrl.integrations.verl import trainer as trainer_module  # noqa: E402
from meshrl.integrations.verl.loss_fn import mesh_loss  # noqa: E402
from meshrl.integrations.verl.settings import BALANCE_WEIGHT, CORRECT, MeshSettings  # noqa: E402
from meshrl.mesh import strategy_balance_row_weights  # noqa: E402

ROWS = [  # (query, strategy, response length, score)
    ("q0", 0, 3, 1.0), ("q0", 0, 4, 0.0), ("q0", 1, 2, 1.0), ("q0", 1, 5, 1.0),
    ("q1", 0, 4, 1.0), ("q1", 1, 3, 1.0), ("q1", 1, 2, 0.0), ("q1", 0, 3, 1.0),
]


class Store:
    """Stands in for TransferQueue: one TensorDict of rows, fields read by name and written back."""

    def __init__(self, data):
        self.data, self.put = data, None

    def kv_batch_get(self, keys, partition_id, select_fields):
        assert partition_id == "train" and len(keys) == self.data.batch_size[0]
        missing = [f for f in select_fields if f not in self.data]
        assert not missing, f"the stage asked for fields the rows do not have: {missing}"
        return self.data.select(*select_fields)

    def kv_batch_put(self, keys, partition_id, fields):
        self.put = fields
        return "updated meta"


def stored_rows(seed: int = 0, drop_key: str | None = None):
    g = torch.Generator().manual_seed(seed)
    rows, old, ref = [], [], []
    for q, s, length, score in ROWS:
        scores = torch.zeros(length)
        scores[-1] = score
        lp, rp = -torch.rand(length, generator=g), -torch.rand(length, generator=g)
        extra = {"query_id": q, "strategy_id": s, "split": "train", "index": 0}
        if drop_key:
            extra.pop(drop_key)
        rows.append({"responses": torch.arange(length), "response_mask": torch.ones(length, dtype=torch.long),
                     "rm_scores": scores, "old_log_probs": lp, "ref_log_prob": rp, "extra_info": extra})
        old.append(lp)
        ref.append(rp)
    return list_of_dict_to_tensordict(rows), old, ref


def stage(monkeypatch, data, mesh):
    store = Store(data)
    monkeypatch.setattr(trainer_module.tq, "kv_batch_get", store.kv_batch_get)
    monkeypatch.setattr(trainer_module.tq, "kv_batch_put", store.kv_batch_put)
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, batch, metrics: batch)
    trainer = object.__new__(trainer_module.MeshPPOTrainer)
    trainer.mesh = mesh
    n = data.batch_size[0]
    batch = KVBatchMeta(keys=[f"k{i}" for i in range(n)], tags=[{} for _ in range(n)], partition_id="train")
    return trainer, batch, store


def test_advantage_stage_writes_meshrl_mesh_weights(monkeypatch):
    data, old, ref = stored_rows()
    mesh = MeshSettings(mu=0.3, subtract_ref=True)
    trainer, batch, store = stage(monkeypatch, data, mesh)
    metrics: dict = {}
    assert trainer._compute_advantage(batch, metrics) == "updated meta"
    correct = torch.tensor([score >= 1.0 for *_, score in ROWS])
    want, _, want_metrics = strategy_balance_row_weights(
        torch.stack([x.sum() for x in old]), torch.stack([x.sum() for x in ref]), correct,
        [r[0] for r in ROWS], [r[1] for r in ROWS], 0.3)
    torch.testing.assert_close(store.put[BALANCE_WEIGHT], want.float())
    assert store.put[CORRECT].tolist() == correct.tolist()
    assert store.put.batch_size[0] == len(ROWS)
    assert metrics["mesh/balance_loss"] == pytest.approx(want_metrics["mesh/balance_loss"])
    assert metrics["mesh/balance_queries"] == 2.0


def test_advantage_stage_names_a_missing_id(monkeypatch):
    data, _, _ = stored_rows(drop_key="query_id")
    trainer, batch, _ = stage(monkeypatch, data, MeshSettings(mu=0.3))
    with pytest.raises(ValueError, match="row 0: extra_info has no 'query_id'"):
        trainer._compute_advantage(batch, {})


def test_no_balancing_means_no_reads(monkeypatch):
    data, _, _ = stored_rows()
    trainer, batch, store = stage(monkeypatch, data, MeshSettings(mu=0.0, subtract_ref=False))
    assert trainer._compute_advantage(batch, {}) is batch and store.put is None


def test_init_end_installs_the_loss_after_verls_own(monkeypatch):
    from test_verl_plugin import _verl_config

    calls = []

    class WorkerGroup:
        def set_loss_fn(self, fn):
            calls.append(("set_loss_fn", fn))

    class CheckpointManager:
        def update_weights(self, step):
            calls.append(("update_weights", step))

    monkeypatch.setattr(PPOTrainerSync, "init", lambda self: self.on_init_end())  # verl's init ends so
    trainer = object.__new__(trainer_module.MeshPPOTrainer)
    trainer.config = _verl_config("actor_rollout_ref.actor.use_kl_loss=true", "data.shuffle=false", "+meshrl.mu=5e-5")
    trainer.actor_rollout_wg, trainer.checkpoint_manager, trainer.global_steps = WorkerGroup(), CheckpointManager(), 0
    trainer.init()
    assert [c[0] for c in calls] == ["update_weights", "set_loss_fn"]
    fn = calls[1][1]
    assert fn.func is mesh_loss and fn.keywords["mesh"] == MeshSettings(mu=5e-5)
    # A bad setting stops init() before verl starts any worker.
    monkeypatch.setattr(PPOTrainerSync, "init", lambda self: pytest.fail("workers started"))
    trainer.config = _verl_config("actor_rollout_ref.actor.use_kl_loss=true", "+meshrl.mu=5e-5")
    with pytest.raises(ValueError, match="needs data.shuffle=false"):
        trainer.init()


def test_queries_split_across_steps_are_counted():
    from meshrl.integrations.verl.balance_step import balance_fields

    mask = torch.ones(3, 2)
    lp = -torch.ones(3, 2)
    extra = [{"query_id": "a", "strategy_id": k, "num_strategies": 3} for k in (0, 1, 1)]
    _, metrics = balance_fields(extra, mask, mask, lp, None, MeshSettings(mu=1e-3, subtract_ref=False))
    assert metrics["mesh/split_queries"] == 1.0
    extra[2]["strategy_id"] = 2
    _, metrics = balance_fields(extra, mask, mask, lp, None, MeshSettings(mu=1e-3, subtract_ref=False))
    assert metrics["mesh/split_queries"] == 0.0


def test_metrics_stage_runs_the_health_checks_and_stops_the_loop(monkeypatch, tmp_path):
    """``+meshrl.health_every``: after verl's own metrics, the checks add ``health/*`` and a ``stop`` finding
    lowers ``total_training_steps`` to this step, which ends verl's ``fit`` loop after it."""
    import math
    from types import SimpleNamespace

    def verl_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        metrics.update({"critic/score/mean": 0.5, "actor/entropy": 2.0 * math.exp(-0.8 * global_steps),
                        "actor/grad_norm": 1.0, "response_length/mean": 30.0})

    monkeypatch.setattr(PPOTrainerSync, "_compute_metrics", verl_metrics)
    trainer = object.__new__(trainer_module.MeshPPOTrainer)
    trainer.mesh = MeshSettings(mu=0.0, health_every=1, health_on={"alarm": "stop", "warning": "stop"},
                                health_dir=str(tmp_path))
    trainer.config = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path / "ckpt")))
    trainer.total_training_steps = 100
    for step in range(1, 30):
        metrics: dict = {}
        trainer._compute_metrics(None, metrics, {}, global_steps=step, epoch=0)
        assert metrics["health/check_s"] >= 0 and "critic/score/mean" in metrics
        if trainer.total_training_steps != 100:
            break
    assert trainer.total_training_steps == step < 29
    assert (tmp_path / "health_events.jsonl").is_file()
