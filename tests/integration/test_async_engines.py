"""What of meshrl works on the asynchronous trainers (docs/scale-out.md, "Asynchronous trainers"), checked on a CPU.

TRL 1.16's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) needs CUDA and a vLLM server: it reads the GPU's
name while it is built, its default rollout worker needs vLLM installed and a server to generate on, its weight sync
is NCCL and its attention is the FA3 kernel. The tests here build the real trainer with a tiny model and stand-ins
for those pieces only: a rollout worker whose queue the test fills with scored samples and a weight transfer that
sends nowhere (the trainer takes both as arguments: ``RolloutWorkerProtocol``, ``WeightTransferProtocol``), and,
patched for the test, the device-name probe (no peak FLOPs) and the tree attention (per-segment SDPA, checked against
a plain forward below). The planner, packing, loss, logging and callbacks that run are TRL's own.

verl is not in this environment: for its one-step-off mode, what is checked here is meshrl's side (the doctor on
verl's records; the trainer mode's base class).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import pickle
import queue
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl.experimental.async_grpo")

import numpy as np  # noqa: E402
import trl.experimental.async_grpo.async_grpo_trainer as async_trainer  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, packing  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import (  # noqa: E402
    RolloutGroup,
    RolloutSample,
    TrainingSequence,
    _AsyncRolloutLoop,
)
from trl.trainer.utils import get_callable_name  # noqa: E402

from meshrl.doctor import diagnose_records  # noqa: E402
from meshrl.doctor.engines import TRL_ASYNC_CORRECTION, is_async_grpo, load_trl, verl_records  # noqa: E402
from meshrl.doctor.live import truncate_records  # noqa: E402
from meshrl.export.trl import export_rows  # noqa: E402
from meshrl.integrations.trl import HealthCallback, MEICallback, MeshGRPOTrainer  # noqa: E402
from meshrl.integrations.trl.async_grpo import TaskReward  # noqa: E402
from meshrl.integrations.trl.head_capture import HiddenCapture  # noqa: E402
from meshrl.integrations.trl.reward import task_reward_func  # noqa: E402
from meshrl.jsonl import read_jsonl  # noqa: E402
from meshrl.mesh.coach import query_key  # noqa: E402
from meshrl.models.tiny import build_tiny  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402

GROUP = 4  # num_generations = per_device_train_batch_size: one prompt group per optimiser step


# ---- stand-ins for the CUDA / vLLM pieces ------------------------------------------------------------------------
def cpu_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                       tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, scaling=None, **kwargs):
    """``packing.tree_attention`` without the FA3 kernel: each segment's queries attend, causally aligned to the
    end, to the keys of its root-to-segment path (``flash_attn_varlen_func(..., causal=True)``)."""
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [tokens, heads, dim]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    rep = q.size(1) // k.size(1)
    out = []
    for s in range(tree_cu_seqlens_q.numel() - 1):
        qs = q[tree_cu_seqlens_q[s]:tree_cu_seqlens_q[s + 1]].transpose(0, 1)
        ks, vs = (x[tree_cu_seqlens_k[s]:tree_cu_seqlens_k[s + 1]].repeat_interleave(rep, 1).transpose(0, 1)
                  for x in (k, v))
        mask = torch.ones(qs.size(1), ks.size(1), dtype=torch.bool).tril(ks.size(1) - qs.size(1))
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling)
                   .transpose(0, 1))
    return torch.cat(out).unsqueeze(0), None


class QueueWorker:
    """``RolloutWorkerProtocol`` over a queue the test fills; an empty queue fails the test instead of waiting."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.versions: list[int] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("the test's rollout queue ran dry")


class NoTransfer:
    """``WeightTransferProtocol`` that sends nowhere (still draining the trainer's parameter stream)."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    model, tok = build_tiny("tiny", seed=0)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture
def make_trainer(model_dir, monkeypatch):
    """``make_trainer(out, groups, callbacks=(), old_logp=-3.0, **config) -> (trainer, worker)``, queue filled."""
    _, tok = build_tiny("tiny", seed=0)
    if not torch.cuda.is_available():  # AsyncGRPOTrainer asks CUDA for the device name (peak FLOPs, MFU)
        monkeypatch.setattr(async_trainer, "get_peak_flops_per_device", lambda *args, **kwargs: None)

    def make(out: Path, groups: int, *, callbacks=(), old_logp: float = -3.0, **config):
        worker = QueueWorker()
        args = AsyncGRPOConfig(**{
            "output_dir": str(out), "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
            "per_device_train_batch_size": GROUP, "num_generations": GROUP, "max_completion_length": 4,
            "max_steps": 3, "logging_steps": 1, "report_to": [], "token_budget": 0, "save_strategy": "no",
            "learning_rate": 1e-2, "max_staleness": 1000, "seed": 0, **config})
        dataset = Dataset.from_list([{"prompt": f"{a}+{a}="} for a in range(4)])
        trainer = AsyncGRPOTrainer(str(model_dir), args=args, train_dataset=dataset, processing_class=tok,
                                   callbacks=list(callbacks), rollout_worker=worker, weight_transfer=NoTransfer())
        AttentionInterface.register(packing.TREE_ATTENTION, cpu_tree_attention)  # the trainer registered FA3's
        rng = np.random.default_rng(0)
        for g in range(groups):
            prompt = tok(f"{g % 10}+{g % 10}=")["input_ids"]
            for j in range(GROUP):
                ids = np.array(prompt + list(rng.integers(5, 20, size=3)))
                worker.rollout_buffer.put(RolloutSample(
                    prompt=[], completion=[], input_ids=ids, completion_mask=np.array([0] * len(prompt) + [1] * 3),
                    old_log_probs=np.full(len(ids), old_logp, dtype=np.float32), advantage=float(j) - 1.5,
                    model_version=0, group_id=g, enqueued_at=time.time(),
                    metrics={"reward": float(j % 2), "reward_std": 0.5, "rewards/correct": float(j % 2)}))
        return trainer, worker

    yield make
    packing.register_tree_attention()  # TRL's own tree attention back in the global registry


def checks_of(out: Path) -> list[dict]:
    return [e for e in read_jsonl(out / "health_events.jsonl") if e["event"] == "health_check"]


# ---- TRL AsyncGRPOTrainer: what it is --------------------------------------------------------------------------
def test_the_async_trainer_has_none_of_the_grpo_override_points():
    """MeshGRPOTrainer overrides GRPOTrainer methods and MEICallback wraps three of them; AsyncGRPOTrainer
    (TRL's _BaseTrainer, not GRPOTrainer) has none of them."""
    assert not issubclass(AsyncGRPOTrainer, GRPOTrainer)
    mesh = {name for name, v in vars(MeshGRPOTrainer).items()
            if callable(v) and not name.startswith("__") and hasattr(GRPOTrainer, name)}
    mei = {"_generate_and_score_completions", "_get_per_token_logps_and_entropies", "_compute_loss"}
    assert mei <= mesh and {"_calculate_rewards", "_generate_single_turn", "_tokenize_prompts"} <= mesh
    assert [name for name in sorted(mesh | mei) if hasattr(AsyncGRPOTrainer, name)] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what fails without CUDA")
def test_without_cuda_it_cannot_even_be_built(model_dir, tmp_path):
    _, tok = build_tiny("tiny", seed=0)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                           report_to=[], max_steps=1, token_budget=0, num_generations=GROUP)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        AsyncGRPOTrainer(str(model_dir), args=args, train_dataset=Dataset.from_list([{"prompt": "1+1="}]),
                         processing_class=tok, rollout_worker=QueueWorker(), weight_transfer=NoTransfer())


def test_the_default_rollout_worker_needs_vllm(make_trainer, model_dir, tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    _, tok = build_tiny("tiny", seed=0)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                           report_to=[], max_steps=1, token_budget=0, num_generations=GROUP)
    with pytest.raises(ImportError, match="vLLM is required"):
        AsyncGRPOTrainer(str(model_dir), args=args, train_dataset=Dataset.from_list([{"prompt": "1+1="}]),
                         processing_class=tok, weight_transfer=NoTransfer())


def test_the_cpu_tree_attention_equals_a_plain_forward(make_trainer, model_dir, tmp_path):
    """The stand-in is faithful: two completions sharing their prompt, packed as a tree, score each token as a
    plain eager forward of each sequence does."""
    trainer, _ = make_trainer(tmp_path / "out", 0)
    _, tok = build_tiny("tiny", seed=0)
    plain = type(trainer.model).from_pretrained(model_dir, attn_implementation="eager")
    seqs = [tok("3+3=12")["input_ids"], tok("3+3=45")["input_ids"]]
    row = packing.TreeRow()
    for ids in seqs:
        row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * 4 + [1] * (len(ids) - 4)),
                 "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": 0})
    p = row.pack()
    assert p["tree_cu_seqlens_q"].numel() == 4  # a shared prompt segment and one segment per completion
    trainer.model.eval()
    with torch.no_grad():
        out = trainer.model(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None],
                            shift_labels=p["shift_labels"][None], fused_lm_head=True,
                            tree_kv_index=p["tree_kv_index"], tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
                            tree_cu_seqlens_k=p["tree_cu_seqlens_k"], tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
                            tree_max_seqlen_k=int(p["tree_max_seqlens"][1]))
        want = []
        for ids in seqs:
            x = torch.tensor([ids])
            logps = torch.log_softmax(plain(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
            want.append(logps[3:])
    torch.testing.assert_close(out.log_probs.flatten()[p["token_index"]], torch.cat(want), atol=1e-5, rtol=1e-5)


# ---- health checks -----------------------------------------------------------------------------------------------
def test_health_callback_on_an_async_run_equals_the_doctor_afterwards_and_reads_its_own_names(make_trainer, tmp_path):
    """HealthCallback attached to AsyncGRPOTrainer: a check every logged step, each the post-hoc doctor's verdict on
    trainer_state.json cut there. The doctor recognises the run from its records and reads AsyncGRPOTrainer's names:
    ``kl`` as the sampler/trainer divergence, ``sample/staleness_*`` as the lag its clipped ratio corrects,
    ``rewards/correct`` as the accuracy; what it does not log stays unchecked."""
    out = tmp_path / "out"
    steps = 6
    trainer, worker = make_trainer(out, steps + 3, max_steps=steps)
    callback = HealthCallback(every=1).attach(trainer)
    trainer.train()
    trainer.save_state()
    assert worker.versions[:2] == [1, 2]  # a cold sync at train begin, then one after every step
    checks = checks_of(out)
    assert [c["step"] for c in checks] == list(range(1, steps + 1))
    rec = load_trl(out)
    assert is_async_grpo(trainer.state.log_history)
    for check in checks:
        assert check["findings"] == diagnose_records(truncate_records(rec, check["step"])).ids(), check["step"]
    assert callback.samples == []  # AsyncGRPOTrainer keeps no completion log for the callback to read
    for theirs, ours in {"reward": "reward/mean", "reward_std": "reward/std", "entropy": "entropy/mean",
                         "kl": "mismatch/kl", "clip_ratio/region_mean": "clip/frac", "grad_norm": "grad/norm",
                         "loss": "loss/total", "learning_rate": "lr", "rewards/correct": "acc/mean",
                         "sample/staleness_mean": "lag/staleness_mean",
                         "sample/staleness_max": "lag/staleness_max"}.items():
        assert rec.mapping.get(theirs) == ours, theirs
    assert rec.config["staleness_correction"] == TRL_ASYNC_CORRECTION
    staleness = [r["lag/staleness_max"] for r in rec.steps]
    assert len(staleness) == steps and staleness == sorted(staleness) and staleness[0] >= 1
    assert all("acc/mean" in r and "kl/mean" not in r and "sample/time_in_queue_s" in r for r in rec.steps)
    diagnosis = diagnose_records(rec)
    unchecked = {u.id: u.reason for u in diagnosis.unchecked}
    judged = set(diagnosis.passed) | set(diagnosis.ids())
    assert "stale_rollouts" in diagnosis.passed  # lagged, and corrected by the clipped ratio to the sampler
    assert {"rollout_mismatch", "reward_without_accuracy"} <= judged
    assert "the recipe has no KL term" in unchecked["kl_blowup"]
    for check_id in ("length", "truncation", "no_learning_signal", "garbled_output"):
        assert check_id in unchecked, check_id


def test_health_stop_ends_an_async_run_on_the_sampler_mismatch_its_kl_measures(make_trainer, tmp_path):
    """AsyncGRPOTrainer's ``kl`` measures the policy against the sampler's log-probs (staleness and trainer/server
    mismatch), not against a reference: samples from a drifted sampler raise rollout_mismatch, never kl_blowup. The
    stop action ends the run at the step of the check."""
    out = tmp_path / "out"
    callback = HealthCallback(every=1, on={"rollout_mismatch": "stop", "kl_blowup": "stop"})
    trainer, _ = make_trainer(out, 8, callbacks=[callback], old_logp=-8.0, max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.state.log_history[0]["kl"] > 1.0
    raised = {finding.id: (finding, action) for finding, action in callback.last_report.raised}
    assert "kl_blowup" not in raised and raised["rollout_mismatch"][1] == "stop"
    evidence = raised["rollout_mismatch"][0].evidence["mismatch/kl"]
    assert evidence["max"] == pytest.approx(trainer.state.log_history[0]["kl"], rel=1e-3)
    assert checks_of(out)[-1]["step"] == 1 and "rollout_mismatch" in checks_of(out)[-1]["findings"]


# ---- MEI -------------------------------------------------------------------------------------------------------
def test_mei_callback_refuses_the_async_trainer(make_trainer, tmp_path):
    trainer, _ = make_trainer(tmp_path / "out", 0)
    with pytest.raises(ValueError, match="MEICallback.attach needs a trl GRPOTrainer, got AsyncGRPOTrainer"):
        MEICallback().attach(trainer)
    assert not any(isinstance(cb, MEICallback) for cb in trainer.callback_handler.callbacks)


def test_the_head_hook_fires_on_packed_rows_that_carry_no_query_ids(make_trainer, tmp_path):
    """The LM head's input can be read from AsyncGRPOTrainer's forward (HiddenCapture accepts its model), but it
    comes as one packed row per rank, not MEICallback's [rows, length] layout, and the loss inputs carry each
    token's sample in the row (segment_id) but no query/group id: per-query MEI would need an adapter of its own."""
    trainer, _ = make_trainer(tmp_path / "out", 3, max_steps=1)
    capture = HiddenCapture(trainer)
    backbone = capture._parts()[0]
    shapes, keys, compute_loss = [], [], trainer.compute_loss

    def hook(module, args, output):
        shapes.append(tuple(output.last_hidden_state.shape))

    def spy(model, inputs, *args, **kwargs):
        keys.append(set(inputs))
        packed = int(inputs["attention_mask"].sum())
        with capture.recording(GROUP, packed, 3) as record:  # MEICallback's view: GROUP rows of length `packed`
            loss = compute_loss(model, inputs, *args, **kwargs)
        assert record.hidden() is None and record.error is None and record.seen == 1  # 1 row, not GROUP
        return loss

    trainer.compute_loss = spy
    handle = backbone.register_forward_hook(hook)
    try:
        trainer.train()
    finally:
        handle.remove()
    width = trainer.model.config.hidden_size
    assert shapes and all(s[0] == 1 and s[2] == width for s in shapes)
    assert keys and all("segment_id" in k and not {"group_id", "query_ids", "strategy_ids"} & k for k in keys)


# ---- Coach Prompting through the data ----------------------------------------------------------------------------
def test_coach_rows_are_scored_per_prefix_group_by_the_async_reward_worker():
    """The rows of ``meshrl export trl --layout query_prefix`` scored by TRL's rollout worker code: TaskReward
    crosses the worker's pickle check (task_reward_func does not), gets each row's query_id, and the advantages are
    those of the row's own completions, i.e. of its prefix group."""
    task = load_task("tiny:add")
    problems = task.problems("train")[:2]
    table = {query_key(p.prompt): [f"hint {k}" for k in range(2)] for p in problems}
    rows = export_rows(task, problems, table, 2, layout="query_prefix", template="plain")
    assert [(r["query_id"], r["strategy_id"]) for r in rows] == [(p.id, k) for p in problems for k in range(2)]
    assert rows[1]["prompt"][0] == {"role": "system", "content": "hint 1"}

    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps({"reward_funcs": [task_reward_func("tiny:add")]})  # AsyncRolloutWorker.start()'s check
    reward = pickle.loads(pickle.dumps(TaskReward("tiny:add")))
    assert reward._score is None and get_callable_name(reward) == "correct"

    row = rows[1]  # the second prefix of the first query
    answer = problems[0].answer
    texts = [answer, "x", answer, "y"]
    kwargs = {key: [row[key]] * GROUP for key in row if key not in {"prompt", "completion", "completion_ids"}}
    group = RolloutGroup(
        prompts=[row["prompt"]] * GROUP, reward_kwargs=kwargs,
        completions=[[{"role": "assistant", "content": t}] for t in texts], completions_ids=[[1]] * GROUP,
        completions_sequences=[[TrainingSequence([1, 2], [0, 1], [0.0, -1.0], str(i))] for i in range(GROUP)],
        tool_call_counts=[0] * GROUP, tool_failure_counts=[0] * GROUP, model_version=0, group_id=7,
        env_rewards=[None] * GROUP, rollout_rewards=[None] * GROUP)
    loop = SimpleNamespace(reward_funcs=[reward], reward_func_names=[get_callable_name(reward)],
                           _env_reward_types=[], _provides_rollout_reward=False)
    samples = asyncio.run(_AsyncRolloutLoop._score_group(loop, group))
    assert [s.metrics["rewards/correct"] for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-6)
    with pytest.raises(ValueError, match="unknown task spec .tiny:nope."):
        TaskReward("tiny:nope")


# ---- verl one-step-off: meshrl's side ------------------------------------------------------------------------------
def test_the_verl_trainer_mode_is_the_sync_trainer_only():
    """meshrl's verl trainer mode subclasses verl's synchronous v1 trainer, and it is the only one meshrl
    registers: Mesh balancing, MEI and the live health checks are not there for an asynchronous trainer."""
    source = Path(__file__).parents[2] / "src/meshrl/integrations/verl/trainer.py"
    registered = [node for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.ClassDef)
                  and any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "register_trainer"
                          for d in node.decorator_list)]
    assert [(c.name, [ast.unparse(b) for b in c.bases]) for c in registered] == [("MeshPPOTrainer", ["PPOTrainerSync"])]
    hooks = {n.name for n in registered[0].body if isinstance(n, ast.FunctionDef)}
    assert {"_compute_advantage", "_compute_old_log_prob", "_compute_metrics"} <= hooks


def test_the_doctor_reads_verl_records_without_judging_staleness(tmp_path):
    """On verl's metric rows (the file logger's names, which a one-step-off run logs as a synchronous one does)
    the doctor's checks run, the rollout-correction figures read as mismatch, and staleness is not judged."""
    rows = [{"step": s, "data": {"critic/score/mean": 0.2 + 0.05 * s, "actor/entropy": 1.0, "actor/grad_norm": 1.0,
                                 "actor/lr": 1e-6, "actor/pg_loss": 0.0, "response_length/mean": 40.0,
                                 "response_length/clip_ratio": 0.0, "critic/advantages/mean": 0.0,
                                 "rollout_corr/kl": 0.001, "rollout_corr/rollout_is_mean": 1.0}}
            for s in range(1, 9)]
    rec = verl_records(tmp_path, rows, [])
    assert rec.mapping["rollout_corr/kl"] == "mismatch/kl" and rec.mapping["critic/score/mean"] == "reward/mean"
    diagnosis = diagnose_records(rec)
    unchecked = {u.id: u.reason for u in diagnosis.unchecked}
    assert "verl runs do not log meshrl's lagged rollouts" in unchecked["stale_rollouts"]
    judged = set(diagnosis.passed) | {f.id for f in diagnosis.findings}
    assert {"length_blowup", "rollout_mismatch", "entropy_collapse", "reward_collapse"} <= judged
