"""The update split over forked worker processes equals the one-process update."""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshrl.forkpool import WorkerError, fork_available
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.parallel_update import (
    Shard,
    UpdateWorkers,
    routed_experts,
    split_rows,
    update_worker_count,
)
from meshrl.trainer.update import PartsEngine, StepPlan, kept_row

needs_fork = pytest.mark.skipif(not fork_available(), reason="worker processes need fork (Linux)")


def test_split_rows_keeps_prompt_groups_whole_and_balances_cost():
    prompt_of = [(0,)] * 4 + [(1,)] * 4 + [(2,)] * 4 + [(3,)] * 4
    cost = [10] * 4 + [1] * 4 + [6] * 4 + [5] * 4  # group costs 40, 4, 24, 20
    rows = list(range(16))
    parts = split_rows(rows, prompt_of, cost, 2)
    assert sorted(r for p in parts for r in p) == rows
    for p in parts:
        assert all(prompt_of[r] in {prompt_of[q] for q in p} for r in p)
        assert len({prompt_of[r] for r in p}) * 4 == len(p)  # whole groups only
    loads = sorted(sum(cost[r] for r in p) for p in parts)
    assert loads == [44, 44]  # LPT: 40 | 24 -> 24+20 | 40+4


def test_split_rows_deals_single_rows_when_prompts_are_fewer_than_parts():
    prompt_of = [(7,)] * 5
    parts = split_rows([0, 1, 2, 3, 4], prompt_of, [5, 4, 3, 2, 1], 3)
    assert sorted(r for p in parts for r in p) == [0, 1, 2, 3, 4]
    assert len(parts) == 3 and all(p == sorted(p) for p in parts)
    assert split_rows([3], [(0,)] * 4, [1] * 4, 4) == [[3]]  # empty shards dropped


def test_update_worker_count():
    model = torch.nn.Linear(2, 2)
    assert update_worker_count(1, model) == 1
    if fork_available():
        assert update_worker_count(3, model) == 3
        assert update_worker_count(0, model) == min(torch.get_num_threads(), 8)
        big = torch.nn.Linear(4100, 4100)  # 16.8M trainable: the gradient hand-off would cost more than it gains
        assert update_worker_count(0, big) == 1 and update_worker_count(2, big) == 2
        big.requires_grad_(False)  # frozen (a LoRA base): only trainable parameters count
        assert update_worker_count(0, torch.nn.Sequential(big, model)) == min(torch.get_num_threads(), 8)
    with pytest.raises(ValueError, match="train.update_workers"):
        load_config(overrides=["train.update_workers=-1"])


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(3))
        self.b = torch.nn.Parameter(torch.randn(3))
        self.unused = torch.nn.Parameter(torch.randn(3))


def _toy_loss(model: _Toy, shard: Shard) -> torch.Tensor:
    x = torch.tensor(shard.advantages)
    if shard.prompts == [[666]]:
        raise ValueError("worker-side failure")
    loss = (model.a * x.sum()).pow(2).sum()
    return loss + (model.b * x[0]).sum() if shard.prompts == [[1]] else loss


@needs_fork
def test_workers_sum_gradients_and_leave_unreached_parameters_without_one():
    model = _Toy()
    params = list(model.parameters())

    def run(shard: Shard):
        _toy_loss(model, shard).backward()
        return True, {"n": float(len(shard.advantages))}

    workers = UpdateWorkers(model, params, run, workers=3)
    try:
        shards = [Shard([[1]], [[2]], [0.5, 2.0], None, None, (1, 1, 1)), Shard([[3]], [[4]], [-1.0], None, None,
                                                                                  (1, 1, 1))]
        here = Shard([[5]], [[6]], [3.0], None, None, (1, 1, 1))
        for _ in range(2):  # the buffers are zeroed between mini-batches
            model.zero_grad(set_to_none=True)
            workers.slots.begin()
            out = workers.map(lambda: run(here), shards)
            workers.slots.collect()
            assert [s["n"] for _, s in out] == [1.0, 2.0, 1.0]
        expected = _Toy()
        for shard in (here, *shards):
            _toy_loss(expected, shard).backward()
        torch.testing.assert_close(model.a.grad, expected.a.grad)
        torch.testing.assert_close(model.b.grad, expected.b.grad)
        assert model.unused.grad is None
        with pytest.raises(WorkerError, match="worker-side failure"):
            workers.map(lambda: run(here), [shards[0], Shard([[666]], [[0]], [1.0], None, None, (1, 1, 1))])
        assert not workers.pool.closed
        model.zero_grad(set_to_none=True)
        workers.slots.begin()  # after a failure every buffer is cleared, whatever the failed worker had added
        workers.map(lambda: (True, {}), [Shard([[3]], [[4]], [1.0], None, None, (1, 1, 1))])
        workers.slots.collect()
        expected = _Toy()
        _toy_loss(expected, Shard([[3]], [[4]], [1.0], None, None, (1, 1, 1))).backward()
        torch.testing.assert_close(model.a.grad, expected.a.grad)
        assert model.b.grad is None
    finally:
        workers.close()


# the shared tiny run with longer responses, a smaller step and the default micro-batch
TINY = [*TINY_RUN, "rollout.max_new_tokens=8", "optim.lr=1e-4", "train.micro_batch_size=16"]


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(overrides=[*TINY, *extra]), tmp_path / name)


@contextlib.contextmanager
def _one_and_many(tmp_path, *extra: str, workers: int = 2):
    """Two trainers with the same seed and settings: one in one process, one with ``workers`` processes."""
    one = _trainer(tmp_path, "one", *extra, "train.update_workers=1")
    many = _trainer(tmp_path, "many", *extra, f"train.update_workers={workers}")
    try:
        yield one, many
    finally:
        one.close()
        many.close()


def _random_advantages(data, seed: int) -> None:
    """Every row gets a gradient (the tiny model's first rollouts score 0 in most groups)."""
    data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(seed))


def _assert_same_weights(one: Trainer, many: Trainer, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    for p, q in zip(one.model.parameters(), many.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=atol, rtol=rtol)


@needs_fork
@pytest.mark.parametrize("extra", [
    ["recipe=grpo", "train.micro_batch_size=16"],
    # reference log-probs and old log-probs travel to the workers; several micro- and mini-batches
    ["recipe=grpo_kl", "train.ppo_epochs=2", "train.mini_batches=2", "train.micro_batch_size=3"],
    ["recipe=gspo", "train.micro_batch_size=8"],
    ["recipe=grpo_js", "algo.js_mode=exact", "train.micro_batch_size=16"],
    # LoRA: only the adapters train; the KL reference is the adapter-free base, scored in the parent
    ["recipe=grpo_kl", "train.lora_r=4", "train.micro_batch_size=16"],
])
def test_parallel_update_equals_the_one_process_update(tmp_path, extra):
    with _one_and_many(tmp_path, *extra, workers=3) as (one, many):
        data, _ = one.sampler.run(0, 0)
        _random_advantages(data, 0)
        m_one, m_many = one.update(data), many.update(data)
        assert many.engine.started and not one.engine.started
        scale = max(float(p.grad.abs().max()) for p in one.model.parameters() if p.grad is not None)
        for p, q in zip(one.model.parameters(), many.model.parameters(), strict=True):
            # the last mini-batch's (clipped) gradients: equal up to the order of summation
            assert (p.grad is None) == (q.grad is None) == (not p.requires_grad)
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, atol=1e-5 * scale, rtol=1e-4)
            torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5)
        for key in ("loss/policy", "loss/total", "grad/norm", "entropy/mean"):
            assert m_many[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
        # the next update reads the new weights in the workers too
        data2, _ = one.sampler.run(1, 4)
        _random_advantages(data2, 1)
        one.update(data2)
        many.update(data2)
        _assert_same_weights(one, many, atol=1e-5, rtol=1e-4)


@needs_fork
def test_mei_steps_and_balancing_run_in_one_process(tmp_path):
    t = _trainer(tmp_path, "mei", "train.update_workers=2", "diag.mei.every=1")
    try:
        params = [p for p in t.model.parameters() if p.requires_grad]
        assert isinstance(t.engine, PartsEngine)
        assert t.engine.serial(StepPlan(collect_mei=True), 0)  # the first epoch of an MEI step
        assert not t.engine.serial(StepPlan(collect_mei=True), 1)  # later epochs may split
        assert not t.engine.serial(StepPlan(), 0) and t.engine.workers(params) is not None
        assert t.engine.serial(StepPlan(balance=True), 0)
    finally:
        t.close()


def _vary_lengths(data, seed: int) -> None:
    """Random response lengths (some empty) and advantages, so that token- and row-weighted metrics differ."""
    g = torch.Generator().manual_seed(seed)
    for j, r in enumerate(data.response_ids):
        data.response_ids[j] = r[: int(torch.randint(0, len(r) + 1, (1,), generator=g))]
    data.response_ids[1] = []
    data.advantages = torch.randn(len(data), generator=g)


@needs_fork
@pytest.mark.parametrize("extra", [
    ["recipe=dapo"],  # token-mean
    ["recipe=dr_grpo"],  # seq-mean-token-sum-norm
    ["recipe=grpo", "algo.loss_agg=token-sum", "train.ppo_epochs=2"],
    ["recipe=gspo"],  # sequence-level clip fractions
])
def test_metrics_do_not_depend_on_the_worker_count(tmp_path, extra):
    with _one_and_many(tmp_path, *extra, "train.micro_batch_size=6", workers=3) as (one, many):
        data, _ = one.sampler.run(0, 0)
        _vary_lengths(data, 0)
        m_one, m_many = one.update(data), many.update(data)
        assert many.engine.started
        assert set(m_one) == set(m_many)
        for key, value in m_one.items():
            assert m_many[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@needs_fork
def test_mei_epoch_then_workers_from_the_second_epoch(tmp_path):
    extra = ["recipe=grpo", "train.ppo_epochs=2", "diag.mei.every=1"]
    with _one_and_many(tmp_path, *extra, workers=2) as (one, many):
        data, _ = one.sampler.run(0, 0)
        _random_advantages(data, 3)
        one.mei.begin(len(data))
        many.mei.begin(len(data))
        m_one, m_many = one.update(data, collect_mei=True), many.update(data, collect_mei=True)
        assert many.engine.started  # forked for the second epoch
        for key in ("loss/policy", "entropy/mean", "grad/norm", "clip/frac_low"):
            assert m_many[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
        _assert_same_weights(one, many)


@needs_fork
def test_a_dead_update_worker_means_this_mini_batch_runs_here(tmp_path, caplog):
    with _one_and_many(tmp_path, "train.micro_batch_size=16", workers=2) as (one, many):
        data, _ = one.sampler.run(0, 0)
        _random_advantages(data, 4)
        one.update(data)
        many.update(data)
        pool = many.engine.workers(many.params).pool
        pool.procs[0].kill()
        pool.procs[0].join()
        with caplog.at_level("WARNING", logger="meshrl"):
            m_one, m_many = one.update(data), many.update(data)
        assert "a worker process died" in caplog.text and many.engine.workers_wanted == 1
        assert m_many["loss/policy"] == pytest.approx(m_one["loss/policy"], rel=1e-5)
        _assert_same_weights(one, many)


@needs_fork
def test_a_non_finite_worker_part_skips_the_step_and_leaves_no_gradient_behind(tmp_path, monkeypatch):
    import os

    from meshrl.trainer import loss

    real, parent, poison = loss.aggregate, os.getpid(), tmp_path / "poison"

    def poisoned(*args, **kwargs):  # NaN loss in the workers while the flag file exists
        out = real(*args, **kwargs)
        return out * float("nan") if os.getpid() != parent and poison.exists() else out

    monkeypatch.setattr(loss, "aggregate", poisoned)
    with _one_and_many(tmp_path, "train.micro_batch_size=16", workers=2) as (one, many):
        data, _ = one.sampler.run(0, 0)
        _random_advantages(data, 5)
        poison.touch()
        assert many.update(data).get("skipped/nonfinite") == 1.0  # the parent's part was finite
        poison.unlink()
        m_one, m_many = one.update(data), many.update(data)  # `one` never saw the skipped step
        assert "skipped/nonfinite" not in m_many
        assert m_many["grad/norm"] == pytest.approx(m_one["grad/norm"], rel=1e-5)
        _assert_same_weights(one, many, atol=1e-5, rtol=1e-4)  # as after any update split over processes


@needs_fork
def test_no_room_in_shared_memory_means_one_process(tmp_path, monkeypatch, caplog):
    from collections import namedtuple

    from meshrl import forkpool

    t = _trainer(tmp_path, "t", "train.update_workers=2")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(forkpool.shutil, "disk_usage", lambda path: usage(1 << 20, 1 << 20, 1 << 10))
    allocated = []
    monkeypatch.setattr(torch.Tensor, "share_memory_", lambda self: allocated.append(self) or self)
    try:
        data, _ = t.sampler.run(0, 0)
        with caplog.at_level("WARNING", logger="meshrl"):
            metrics = t.update(data)
        assert "no worker processes" in caplog.text and t.engine.workers_wanted == 1 and not t.engine.started
        assert t.engine.parts == 1  # cannot start at the first update: one part, all threads, as update_workers=1
        assert not allocated  # refused before any buffer was written to shared memory
        assert "loss/policy" in metrics
    finally:
        t.close()


@needs_fork
def test_close_leaves_no_worker_processes(tmp_path):
    import multiprocessing as mp

    t = _trainer(tmp_path, "t", "train.update_workers=2", "rollout.decode_workers=2", "rollout.prompts_per_step=8")
    data, _ = t.sampler.run(0, 0)
    t.update(data)
    procs = [*t.engine.workers(t.params).pool.procs, *t.backend._pool.procs]
    assert procs and all(p.is_alive() for p in procs)
    t.close()
    assert not any(p.is_alive() for p in procs)
    assert not set(procs) & set(mp.active_children())


@needs_fork
def test_bf16_weights_train_with_workers(tmp_path):
    t = _trainer(tmp_path, "bf16", "train.update_workers=2", "train.dtype=bfloat16")
    try:
        data, _ = t.sampler.run(0, 0)
        _random_advantages(data, 7)
        metrics = t.update(data)
        assert t.engine.started and torch.isfinite(torch.tensor(metrics["grad/norm"]))
        assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in t.model.parameters())
    finally:
        t.close()


def _some_zero_advantages(data, seed: int, zero_groups=(0, 2), group: int = 4) -> None:
    _random_advantages(data, seed)
    for g in zero_groups:
        data.advantages[g * group : (g + 1) * group] = 0.0


def _count_backward_rows(trainer: Trainer) -> list[int]:
    seen: list[int] = []
    real = trainer.objective.micro_loss

    def counted(idx, *args, **kwargs):
        seen.append(len(idx))
        return real(idx, *args, **kwargs)

    trainer.objective.micro_loss = counted
    return seen


@pytest.mark.parametrize("extra", [
    ["recipe=grpo", "train.micro_batch_size=16"],
    ["recipe=dr_grpo", "train.micro_batch_size=6"],
    ["recipe=gspo", "train.ppo_epochs=2", "train.mini_batches=2", "train.micro_batch_size=5"],
    ["recipe=dapo", "train.micro_batch_size=16"],
    ["recipe=grpo", "algo.policy_loss=cispo", "train.micro_batch_size=16"],
    ["recipe=grpo", "algo.policy_loss=gspo_token", "train.micro_batch_size=16"],
    ["recipe=grpo", "algo.clip_dual=3.0", "train.ppo_epochs=2", "train.micro_batch_size=16"],
    ["recipe=grpo", "train.lora_r=4", "train.micro_batch_size=16"],
])
@pytest.mark.parametrize("workers", [1, 2])
def test_zero_advantage_rows_skip_their_backward_and_change_nothing(tmp_path, extra, workers):
    if workers > 1 and not fork_available():
        pytest.skip("worker processes need fork (Linux)")
    plain = _trainer(tmp_path, "plain", *extra, "train.update_workers=1", "train.skip_zero_advantage=false")
    skip = _trainer(tmp_path, "skip", *extra, f"train.update_workers={workers}")
    try:
        backward_rows = _count_backward_rows(skip)
        data, _ = plain.sampler.run(0, 0)
        _vary_lengths(data, 1)
        _some_zero_advantages(data, 1)
        m_plain, m_skip = plain.update(data), skip.update(data)
        if workers == 1:  # the parent's own count (workers count in their own processes)
            assert 0 < sum(backward_rows) < len(data) * int(skip.cfg.train.ppo_epochs)
        assert set(m_plain) == set(m_skip)
        for key, value in m_plain.items():
            assert m_skip[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        # AdamW divides each element's step by its own gradient scale, so over several optimiser steps a
        # rounding-level difference in a near-zero gradient element moves that weight by far more than the
        # rounding: measured 1.8e-6 on 1 of 4096 elements (GSPO, 2 epochs x 2 mini-batches) on an Intel Xeon with
        # AMX, where the other CPUs met 1e-6
        _assert_same_weights(plain, skip, atol=1e-5)
        # a step where every advantage is 0: zero gradients, and AdamW's momentum still moves the weights
        data.advantages = torch.zeros(len(data))
        before = [p.detach().clone() for p in skip.model.parameters()]
        m_plain, m_skip = plain.update(data), skip.update(data)
        assert m_skip["grad/norm"] == m_plain["grad/norm"] == 0.0
        _assert_same_weights(plain, skip, atol=1e-5)  # carries the first update's difference
        assert any(not torch.equal(b, p) for b, p in zip(before, skip.model.parameters(), strict=True))
    finally:
        plain.close()
        skip.close()


def test_first_all_zero_step_gives_zero_gradients_not_none(tmp_path):
    t = _trainer(tmp_path, "t", "train.update_workers=1", "train.micro_batch_size=16")
    rows = _count_backward_rows(t)
    data, _ = t.sampler.run(0, 0)
    data.advantages = torch.zeros(len(data))
    t.update(data)
    assert rows == [1]  # one row kept so that the parameters it reaches get their zero gradient
    assert all(p.grad is not None and not p.grad.any() for p in t.model.parameters())


def test_terms_beyond_the_policy_loss_need_every_row(tmp_path):
    assert _trainer(tmp_path, "g", "recipe=grpo").engine.skip_zero
    assert not _trainer(tmp_path, "k", "recipe=grpo_kl").engine.skip_zero
    assert not _trainer(tmp_path, "j", "recipe=grpo_js").engine.skip_zero
    assert not _trainer(tmp_path, "o", "recipe=grpo", "train.skip_zero_advantage=false").engine.skip_zero
    t = _trainer(tmp_path, "m", "recipe=grpo")
    assert t.engine.serial(StepPlan(collect_mei=True), 0)  # MEI's first epoch: every row, whole, here


def test_a_non_finite_log_prob_skips_the_step_with_or_without_skipping(tmp_path, monkeypatch):
    from meshrl.trainer import forward, loss

    real = loss.token_logprobs

    def poisoned(logits, tokens, temperature=1.0):
        out = real(logits, tokens, temperature)
        return torch.cat([out[:1] * float("nan"), out[1:]])  # the first row of every batch

    monkeypatch.setattr(loss, "token_logprobs", poisoned)
    monkeypatch.setattr(forward, "token_logprobs", poisoned)
    for flag in ("true", "false"):
        t = _trainer(tmp_path, flag, "train.update_workers=1", "train.micro_batch_size=16",
                     f"train.skip_zero_advantage={flag}", "train.head_chunk=0")  # the whole-logits path
        data, _ = t.sampler.run(0, 0)
        _some_zero_advantages(data, 2, zero_groups=(0,))  # rows 0-3 would run forward only
        before = [p.detach().clone() for p in t.model.parameters()]
        metrics = t.update(data)  # the non-finite skip (failure.max_nonfinite), not a ValueError
        assert metrics["skipped/nonfinite"] == 1.0 and t.bad_in_row == 1
        assert all((a == b).all() for a, b in zip(before, t.model.parameters(), strict=True))


def test_the_parent_decides_skipping_and_the_kept_row_for_the_workers(tmp_path, monkeypatch):
    if not fork_available():
        pytest.skip("worker processes need fork (Linux)")
    t = _trainer(tmp_path, "t", "train.update_workers=2", "train.micro_batch_size=16")
    sent = []
    real = UpdateWorkers.map

    def spy(self, local, shards):
        sent.extend(shards)
        return real(self, local, shards)

    monkeypatch.setattr(UpdateWorkers, "map", spy)
    try:
        data, _ = t.sampler.run(0, 0)
        _some_zero_advantages(data, 3)
        t.update(data)
        assert sent and all(s.skip_zero and s.keep == -1 for s in sent)  # other rows have gradients
        sent.clear()
        data.advantages = torch.zeros(len(data))
        t.update(data)
        kept = kept_row(list(range(len(data))), data)
        shortest = min(len(r) for r in data.response_ids if r)
        assert kept is not None and len(data.response_ids[kept]) == shortest
        assert sum(s.keep >= 0 for s in sent) <= 1  # one kept row in the whole mini-batch, here or there
    finally:
        t.close()


def test_mixture_of_experts_models_do_not_skip(tmp_path, monkeypatch):
    class Cfg:
        num_local_experts = 8

    class Moe(torch.nn.Linear):
        config = Cfg()

    assert routed_experts(Moe(2, 2)) and not routed_experts(torch.nn.Linear(2, 2))
    from meshrl.trainer import update

    monkeypatch.setattr(update, "routed_experts", lambda model: True)
    assert not _trainer(tmp_path, "t", "recipe=grpo").engine.skip_zero
