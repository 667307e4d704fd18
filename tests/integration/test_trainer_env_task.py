"""Tool-using tasks in the trainer (``task=env:...``): the spec, the prompt that shows the tools, episodes as the
step's rollouts (tool output masked out of the update, the environment's reward or the data's grade), their
metrics in the step record, and the settings refused with them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from agents_support import ScriptedBackend, call_text  # noqa: E402

from meshrl.agents import EnvTask, split_env_spec  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402
from meshrl.testing import TINY_RUN  # noqa: E402
from meshrl.trainer import Trainer, load_config  # noqa: E402

RUN = [*TINY_RUN, "rollout.max_new_tokens=96", "optim.lr=1e-3"]


def test_data_takes_the_rest_of_the_spec():
    env, options, data = split_env_spec("env:calculator?max_turns=3&data=jsonl:x.jsonl?problem=q&answer=a")
    assert (env, options, data) == ("calculator", {"max_turns": 3}, "jsonl:x.jsonl?problem=q&answer=a")
    assert split_env_spec("env:m:F?data=tiny:repeat") == ("m:F", {}, "tiny:repeat")


@pytest.mark.parametrize("spec, message", [
    ("env:calculator?max_turns=3", "needs its problems as a last option data=SPEC"),
    ("env:?data=tiny:repeat", "name an environment"),
    ("env:calculator?turns=3&data=tiny:repeat", r"unknown option\(s\) \['turns'\]"),
    ("env:calculator?tools=abacus&data=tiny:repeat", "unknown tool set 'abacus'"),
    ("env:no_such_module_xyz:Env?data=tiny:repeat", "cannot import module 'no_such_module_xyz'"),
    ("env:calculator?max_turns=0&data=tiny:repeat", "max_turns"),
])
def test_bad_env_specs_name_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        load_task(spec)


def test_env_task_keeps_the_data_and_shows_the_tools():
    task = load_task("env:agents_support:CounterEnv?tools=calculator&max_turns=3&data=tiny:repeat")
    data = load_task("tiny:repeat")
    assert isinstance(task, EnvTask) and task.owns_reward and task.limits.max_turns == 3
    assert [p.id for p in task.problems()] == [p.id for p in data.problems()]
    assert {s["function"]["name"] for s in task.schemas} == {"calculator", "increment", "read"}
    assert not load_task("env:calculator?data=tiny:repeat").owns_reward


def _counter_script(tokenizer):
    """Turn 1: even rows increment by 3 (the target: reward 1), odd rows by 1 (reward 0); turn 2: an answer."""

    def script(context: list[int], row: int, seed: int) -> str:
        if "<s>tool\n" in tokenizer.decode(context):  # the tiny chat template's tool message
            return "done"
        return call_text("increment", {"step": 3 if row % 2 == 0 else 1})

    return script


def test_a_step_trains_on_episodes_with_tool_output_masked(tmp_path):
    cfg = load_config(overrides=[*RUN, "task=env:agents_support:CounterEnv?max_turns=3&data=tiny:repeat"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.sampler.backend = ScriptedBackend(trainer.tokenizer, _counter_script(trainer.tokenizer))
        before = [p.detach().clone() for p in trainer.model.parameters()]
        metrics = trainer.step()
        data = trainer.last_data
        assert len(data) == 16 and len(data.response_masks) == 16
        assert data.scores == [1.0, 0.0] * 8  # the environment's get_reward
        tok = trainer.tokenizer
        for ids, mask, text in zip(data.response_ids, data.response_masks, data.texts, strict=True):
            model_part = tok.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
            tool_part = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m], skip_special_tokens=True)
            assert model_part.startswith("<tool_call>") and model_part.endswith("done") and text == "done"
            assert tool_part.startswith("\ntool\n") and "<tool_call>" not in tool_part  # "<s>tool\n3</s>\n..."
            assert 0 < sum(mask) < len(ids)
        assert metrics["turns/mean"] == 2.0 and metrics["tools/calls_mean"] == 1.0
        assert metrics["strategy/mass/increment"] == 1.0 and metrics["strategy/unlabelled"] == 0.0  # tool pattern
        assert metrics["tools/share/increment"] == 1.0 and metrics["tools/error_frac"] == 0.0
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    finally:
        trainer.close()


def test_without_get_reward_the_data_grades_the_final_answer(tmp_path):
    cfg = load_config(overrides=[*RUN, "task=env:calculator?max_turns=3&data=tiny:repeat"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        tok = trainer.tokenizer

        def script(context: list[int], row: int, seed: int) -> str:
            text = tok.decode(context, skip_special_tokens=True)
            if "\ntool\n" not in text:
                return call_text("calculator", {"expression": "6*7"})
            assert text.split("\ntool\n")[-1].startswith("42")
            answer = text.split("Repeat: ")[1].split("\n")[0]
            return answer if row % 2 == 0 else answer + "x"

        trainer.sampler.backend = ScriptedBackend(tok, script)
        metrics = trainer.step()
        scores = trainer.last_data.scores  # tiny:repeat's grade of the final turn (partial credit below 1)
        assert scores[::2] == [1.0] * 8 and all(s < 1.0 for s in scores[1::2])
        assert metrics["tools/share/calculator"] == 1.0
    finally:
        trainer.close()


def test_plugins_that_read_one_sampled_stream_are_refused(tmp_path):
    from meshrl.trainer.episodes import check_episodic_config
    from meshrl.trainer.plugins import REGISTRY

    # each plug-in declares it (Plugin.episodes_ok); the check names none of them
    assert {n for n, c in REGISTRY.items() if not c.episodes_ok} == {"luffy", "ssd", "opsd", "remix", "calib"}
    for name in ("luffy", "ssd", "opsd", "remix", "calib"):
        cfg = load_config(overrides=RUN)
        getattr(cfg.plugins, name).enabled = True
        with pytest.raises(ValueError, match=rf"plugins\.{name}\.enabled"):
            check_episodic_config(cfg)
    check_episodic_config(load_config(overrides=[*RUN, "plugins.fork.enabled=true"]))  # token-level: allowed
    # coach-guided exploration forces the first model turn's opening (tests/integration/test_testbed_tools_guide.py)
    check_episodic_config(load_config(overrides=[*RUN, "recipe=cp_only", "mesh.adv_unit=query",
                                                  "plugins.coach_guide.enabled=true"]))


def test_held_out_evaluation_runs_episodes(tmp_path):
    """`meshrl eval` and the trainer's periodic evaluation on a tool-using task: every sample is an episode, graded
    like a training one, and the episodes' metrics are reported."""
    from meshrl.evaluation import EvalConfig, run_eval

    spec = "env:calculator?max_turns=2&max_total_tokens=24&data=tiny:add"
    s = run_eval(EvalConfig(model="tiny", data=spec, n=2, ks=[1, 2], limit=4, max_new_tokens=12, chunk_size=2),
                 tmp_path / "eval", progress=False)
    assert s["overall"]["problems"] == 4 and set(s["episodes"]) >= {"turns/mean", "tools/calls_mean"}
    assert 1.0 <= s["episodes"]["turns/mean"] <= 2.0
    cfg = load_config(overrides=[*RUN, f"task={spec}", "eval.every=1", "eval.limit=3", "eval.n=2", "steps=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        row = trainer.evaluator(0)
        assert row["eval/turns/mean"] >= 1.0 and "eval/mean@1" in row
    finally:
        trainer.close()


def test_mesh_coach_prefixes_suggest_a_tool_plan(tmp_path):
    """Coach Prompting on a tool-using task: without a prefixes file the coach's strategies are tool plans, shown
    in the system prompt beside the tools; the episodes of each prefix group train as usual."""
    import json

    data = tmp_path / "problems.jsonl"  # a file task: no rule strategies of its own
    data.write_text("".join(json.dumps({"q": f"Repeat: {c}", "a": c}) + "\n" for c in "abcdefgh"))
    cfg = load_config(overrides=[*RUN, "recipe=cp_only", "mesh.m=2", "mesh.template=plain",
                                 f"task=env:calculator?max_turns=2&data=jsonl:{data}?problem=q&answer=a&kind=exact"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        problem = trainer.problems[0]
        tok = trainer.tokenizer
        tool_plan = tok.decode(trainer.sampler.prompt_ids(problem, 0))
        direct = tok.decode(trainer.sampler.prompt_ids(problem, 1))
        assert "call the calculator tool first" in tool_plan and "answer directly" in direct
        assert '"name": "calculator"' in tool_plan and '"name": "calculator"' in direct  # the tools, both arms

        def script(context: list[int], row: int, seed: int) -> str:
            text = tok.decode(context, skip_special_tokens=True)
            if "call the calculator tool first" in text and "\ntool\n" not in text:
                return call_text("calculator", {"expression": "1+1"})
            return text.split("Repeat: ")[1].split("\n")[0]

        trainer.sampler.backend = ScriptedBackend(tok, script)
        metrics = trainer.step()
        assert set(trainer.last_data.strategy_ids) == {0, 1}
        calls = [len([m for m in mask if m == 0]) > 0 for mask in trainer.last_data.response_masks]
        assert calls == [k == 0 for k in trainer.last_data.strategy_ids]  # only the tool-plan group called it
        assert metrics["tools/calls_mean"] == 0.5
        assert metrics["strategy/mass/calculator"] == 0.5 and metrics["strategy/mass/direct"] == 0.5
    finally:
        trainer.close()


def test_the_strategy_label_is_the_tool_pattern():
    task = load_task("env:agents_support:CounterEnv?tools=calculator&data=tiny:repeat")
    assert task.strategies == ("direct", "calculator", "increment", "read", "mixed")
    assert task.label_strategy("the answer is 4") == "direct"
    assert task.label_strategy(call_text("read", {}) + "\ncount=1") == "read"
    assert task.label_strategy(call_text("read", {}) + "\n" + call_text("calculator", {"expression": "1"})) == "mixed"
    assert task.label_strategy(call_text("search", {"q": "x"})) is None  # not a tool of this task: unlabelled


def test_a_resumed_tool_using_run_equals_the_uninterrupted_one(tmp_path):
    """Episodes are seeded per step and turn, and the environments are made afresh per episode: a run resumed
    from its step-2 checkpoint reproduces the uninterrupted 3-step run's records and weights."""
    from safetensors.torch import load_file

    from meshrl.jsonl import read_jsonl
    from meshrl.trainer import train

    def cfg(steps: int):
        return load_config(overrides=[
            "model=tiny", "task=env:calculator?max_turns=2&max_total_tokens=24&data=tiny:repeat",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=1", "optim.lr=1e-2",
            "train.update_workers=1", "rollout.decode_workers=1", f"steps={steps}"])

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train(cfg(3), full)
    train(cfg(2), resumed)
    train(cfg(3), resumed, resume=True)

    def rows(run):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_jsonl(run / "metrics.jsonl")]

    assert rows(resumed) == rows(full) and "turns/mean" in rows(full)[-1]
    a, b = (load_file(str(r / "checkpoints" / "step_000003" / "model.safetensors")) for r in (full, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_environments_failed_rewards_count_as_reward_errors(tmp_path, monkeypatch):
    """NaN from ``get_reward`` scores 0 and reaches ``reward/errors`` (and so ``failure.max_reward_failed``), as a
    reward function's NaN does; a reward of 5 is clamped to 1 and counted too."""
    (tmp_path / "nan_env_mod.py").write_text(
        "from agents_support import CounterEnv\n\n"
        "class HalfBrokenEnv(CounterEnv):\n"
        "    def get_reward(self):\n"
        "        return float('nan') if self.count == 3 else 5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(overrides=[*RUN, "task=env:nan_env_mod:HalfBrokenEnv?max_turns=3&data=tiny:repeat"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.sampler.backend = ScriptedBackend(trainer.tokenizer, _counter_script(trainer.tokenizer))
        metrics = trainer.step()
        assert trainer.last_data.scores == [0.0, 1.0] * 8
        assert metrics["reward/errors"] == 16
        failure = trainer.last_reward_failure()
        assert "HalfBrokenEnv.get_reward" in failure and trainer.last_data.problems[-1].id in failure
    finally:
        trainer.close()
